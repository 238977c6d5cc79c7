"""combine_rows (Triton) against combine_rows_ref (torch): bit-exact, fp32 and bf16 outputs."""
import pytest
import torch
from moetool.kernels import ep_combine as ec

from moetool.errors import MoetoolError


def _case(m: int, R: int, H: int, dtype: torch.dtype):
    """Random destinations per token, rows laid out rank-major as the all2all dispatcher sends."""
    sent = torch.rand(m, R) < 0.6
    sent[torch.arange(m), torch.randint(0, R, (m,))] = True  # every token goes somewhere
    counts = sent.sum(0)
    start = torch.cumsum(counts, 0) - counts
    pos = torch.where(sent, torch.cumsum(sent, 0) - 1 + start, -1)
    rows = (torch.randn(int(counts.sum()), H) * 3).to(dtype)
    return rows, pos


@pytest.mark.parametrize("m,R,H", [(7, 4, 70), (1, 1, 8), (33, 2, 1100), (5, 8, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_rows_bit_exact(device, m, R, H, dtype):
    rows, pos = _case(m, R, H, dtype)
    ref = ec.combine_rows_ref(rows, pos)
    assert torch.equal(ec.combine_rows(rows.to(device), pos.to(device)).cpu(), ref)
    # pos as the dispatcher keeps it: a transposed view of [R, m]
    pos_t = pos.t().contiguous().to(device).t()
    assert not pos_t.is_contiguous() or R == 1
    assert torch.equal(ec.combine_rows(rows.to(device), pos_t).cpu(), ref)
    # explicit sum in rank order: the reference is what its docstring says
    want = torch.zeros(m, H)
    for t in range(m):
        for r in range(R):
            if pos[t, r] >= 0:
                want[t] += rows[pos[t, r]].float()
    assert torch.equal(ref, want)


def test_combine_rows_into_bf16_strided_buffer_rounds_to_nearest_even(device):
    rows, pos = _case(9, 4, 96, torch.float32)
    buf = torch.full((12, 128), 7.0, dtype=torch.bfloat16, device=device)
    ec.combine_rows(rows.to(device), pos.to(device), out=buf[:9, :96])  # row stride 128, not H
    assert torch.equal(buf[:9, :96].cpu(), ec.combine_rows_ref(rows, pos).to(torch.bfloat16))
    untouched = torch.full((12, 128), 7.0, dtype=torch.bfloat16)
    assert torch.equal(buf[9:].cpu(), untouched[9:]) and torch.equal(buf[:, 96:].cpu(), untouched[:, 96:])
    ref_buf = torch.empty(9, 96, dtype=torch.bfloat16)
    assert torch.equal(ec.combine_rows_ref(rows, pos, out=ref_buf), buf[:9, :96].cpu())


def test_combine_rows_token_sent_nowhere_is_zero(device):
    rows = torch.randn(2, 16)
    pos = torch.tensor([[0, -1], [-1, -1], [-1, 1]])
    out = ec.combine_rows(rows.to(device), pos.to(device)).cpu()
    assert torch.equal(out[1], torch.zeros(16)) and torch.equal(out[0], rows[0]) and torch.equal(out[2], rows[1])


def test_combine_rows_rejects_bad_arguments(device):
    rows = torch.randn(3, 8, device=device)
    with pytest.raises(MoetoolError, match="pos must be int32/int64"):
        ec.combine_rows(rows, torch.zeros(2, 2, device=device))
    with pytest.raises(MoetoolError, match="out must be float32 or bfloat16"):
        ec.combine_rows(rows, torch.zeros(2, 2, dtype=torch.int64, device=device),
                        out=torch.empty(2, 8, dtype=torch.float16, device=device))
    with pytest.raises(MoetoolError, match=r"out must be \[m, H\]"):
        ec.combine_rows(rows, torch.zeros(2, 2, dtype=torch.int64, device=device), out=torch.empty(3, 8, device=device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_rows_into_peer_buffers_is_an_all_gather(device, dtype):
    """Each simulated tp rank stores its combined part at row i * width of every rank's buffer."""
    from moetool.kernels.common import PeerBuffers

    tp, width, H, P = 3, 4, 72, 20
    views_ref = [torch.full((tp * width + 2, H), 7.0, dtype=dtype) for _ in range(tp)]
    views = [v.clone().to(device) for v in views_ref]
    ref_peers, peers = PeerBuffers(views_ref, torch.device("cpu")), PeerBuffers(views, torch.device(device))
    parts = []
    for i in range(tp):
        rows = torch.randn(P, H)
        m = width - (i == tp - 1)  # the last part is shorter: its padding row keeps its old bytes
        pos = torch.randint(-1, P, (m, 2))
        ec.combine_rows_ref(rows, pos, peers=ref_peers, row0=i * width)
        assert ec.combine_rows(rows.to(device), pos.to(device), peers=peers, row0=i * width) is None
        parts.append(ec.combine_rows_ref(rows, pos, torch.empty(m, H, dtype=dtype)))
    want = torch.cat([torch.cat([p, torch.full((width - p.shape[0], H), 7.0, dtype=dtype)]) for p in parts])
    for v_ref, v in zip(views_ref, views):
        assert torch.equal(v_ref[:tp * width], want) and torch.equal(v.cpu(), v_ref)
    with pytest.raises(MoetoolError, match="cannot take"):
        ec.combine_rows(torch.randn(P, H, device=device), torch.zeros(3, 2, dtype=torch.int64, device=device),
                        peers=peers, row0=tp * width)
