"""ep_dispatch kernels (Triton) against their torch references: integer outputs, so exact."""
import pytest
import torch
from moetool.kernels import ep_dispatch as ed

from moetool.errors import MoetoolError
from moetool.placement import linear_placement
from moetool.verify.dispatch import RouteTable


def _table(E: int, R: int, redundant: dict | None = None) -> RouteTable:
    """Linear placement, plus redundant copies {expert: [extra ranks]} (slots appended)."""
    placement = linear_placement(E, R)
    for e, ranks in (redundant or {}).items():
        for r in ranks:
            slot = len(placement.slots[r])
            placement.replicas[e].append((r, slot))
            placement.slots[r].append(e)
    return RouteTable.build(placement, torch.device("cpu"))


# (tokens, experts, ranks, k, redundant copies)
# (1300, k 8) and (2100, k 3) run route_tokens over several token blocks (512 / 1024 per block)
CASES = [(37, 8, 4, 2, {1: [0, 2], 5: [3]}), (1, 4, 1, 1, None), (300, 64, 4, 8, {3: [1, 2, 3]}),
         (64, 16, 8, 3, None), (5, 6, 3, 6, {0: [1]}), (1300, 16, 4, 8, {2: [0]}), (2100, 12, 3, 3, None)]


@pytest.mark.parametrize("m,E,R,k,redundant", CASES)
def test_route_tokens_matches_reference(device, m, E, R, k, redundant):
    table = _table(E, R, redundant)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(m)])  # distinct experts per token
    tok = 1000 + torch.arange(m)
    counts_ref = torch.full((R,), -7, dtype=torch.int64)
    order_ref = ed.route_tokens_ref(ids, tok, table.rank, table.count, counts_ref)
    counts = torch.full((R,), -7, dtype=torch.int64, device=device)
    order = ed.route_tokens(ids.to(device), tok.to(device), table.rank.to(device), table.count.to(device), counts)
    assert torch.equal(order.cpu(), order_ref) and torch.equal(counts.cpu(), counts_ref)
    # the same choice as RouteTable.destinations; tokens ascending per rank, each counted once
    dest, _ = table.destinations(ids, tok)
    for r in range(R):
        sent = [t for t in range(m) if (dest[t] == r).any()]
        assert counts_ref[r] == len(sent)
        assert [t for t in range(m) if order_ref[r, t] >= 0] == sent
        assert order_ref[r, sent].tolist() == list(range(len(sent)))


@pytest.mark.parametrize("m,E,R,k,redundant", CASES)
def test_local_slots_match_reference_on_strided_views(device, m, E, R, k, redundant):
    table = _table(E, R, redundant)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(m)]).to(torch.int32)
    tok = 7 + torch.arange(m) * 3
    wide = torch.zeros(m, k + 5, dtype=torch.int32)  # rows inside a wider received buffer
    wide[:, 2:2 + k] = ids
    toks = torch.zeros(m, 3, dtype=torch.int64)
    toks[:, 1] = tok
    for rank in range(R):
        L = len(table.rank[table.rank == rank])
        ref_ids, ref_counts = ed.local_slots_ref(ids, tok, table.rank, table.slot, table.count, rank, L)
        got_ids, got_counts = ed.local_slots(wide.to(device)[:, 2:2 + k], toks.to(device)[:, 1], table.rank.to(device),
                                             table.slot.to(device), table.count.to(device), rank, L)
        assert torch.equal(got_ids.cpu(), ref_ids) and torch.equal(got_counts.cpu(), ref_counts)
        # the same choice as RouteTable.destinations
        r, s = table.destinations(ids.long(), tok)
        assert torch.equal(ref_ids, torch.where(r == rank, s, -1))


def test_empty_inputs(device):
    table = _table(4, 2)
    ids = torch.zeros(0, 2, dtype=torch.int64, device=device)
    tok = torch.zeros(0, dtype=torch.int64, device=device)
    counts = torch.full((2,), 5, dtype=torch.int64, device=device)
    order = ed.route_tokens(ids, tok, table.rank.to(device), table.count.to(device), counts)
    assert order.shape == (2, 0) and counts.tolist() == [0, 0]
    out = torch.full((0, 48), 7, dtype=torch.uint8, device=device)
    x = torch.zeros(0, 8, device=device)
    pos = ed.pack_rows(x, ids, torch.zeros(0, 2, device=device), tok, order, counts, out, torch.float32,
                       (None, 32, 40, 16), 128)
    assert pos.shape == (2, 0)


def test_bad_arguments_are_named(device):
    table = _table(4, 2)
    counts = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(MoetoolError, match="token_index must be int64"):
        ed.route_tokens(torch.zeros(3, 2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), table.rank,
                        table.count, counts)
    with pytest.raises(MoetoolError, match="counts must be contiguous int64"):
        ed.route_tokens(torch.zeros(3, 2, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), table.rank,
                        table.count, torch.zeros(2))
    with pytest.raises(MoetoolError, match="topk ids must be int32/int64"):
        ed.local_slots(torch.zeros(3, 2), torch.zeros(3, dtype=torch.int64), table.rank, table.slot, table.count, 0, 2)
    x, ids, w, tok = torch.zeros(3, 8), torch.zeros(3, 2, dtype=torch.int64), torch.zeros(3, 2), torch.arange(3)
    order = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(MoetoolError, match="do not fit rows of 48 bytes"):
        ed.pack_rows(x, ids, w, tok, order, counts, torch.zeros(4, 48, dtype=torch.uint8), torch.float32,
                     (None, 32, 40, 48))
    with pytest.raises(MoetoolError, match="fp8 rows need a scale offset"):
        ed.pack_rows(x, ids, w, tok, order, counts, torch.zeros(4, 64, dtype=torch.uint8), torch.float8_e4m3fn,
                     (None, 16, 32, 48))
    with pytest.raises(MoetoolError, match="out must be contiguous uint8"):
        ed.pack_rows(x, ids, w, tok, order, counts, torch.zeros(4, 40, dtype=torch.uint8), torch.float32,
                     (None, 16, 24, 32))
    with pytest.raises(MoetoolError, match="disagree on R"):
        ed.pack_rows(x, ids, w, tok, order, torch.zeros(3, dtype=torch.int64), torch.zeros(4, 48, dtype=torch.uint8),
                     torch.float32, (None, 32, 40, 16))


def _offsets(H: int, k: int, dtype: torch.dtype, group: int) -> tuple[tuple, int]:
    """Parts 16-byte aligned as RowLayout lays them out: (scale, ids, weights, token), row bytes."""
    from moetool.verify.dispatch import RowLayout

    payload = ((dtype, H),) + (((torch.float32, -(-H // group)),) if dtype == torch.float8_e4m3fn else ())
    layout = RowLayout(payload + ((torch.int32, k), (torch.float32, k), (torch.int64, 1)))
    offs = layout.offsets
    return ((offs[1] if len(payload) == 2 else None, *offs[-4:-1]), layout.row_bytes)


# (tokens, hidden, ranks, k, wire dtype, group): H not a multiple of the group, one group,
# several h-blocks (H 2304 = 18 groups of 128 -> 3 blocks of 8), bf16 / fp32 rows
PACK_CASES = [(37, 384, 4, 3, torch.float8_e4m3fn, 128), (5, 200, 3, 2, torch.float8_e4m3fn, 128),
              (9, 2304, 2, 8, torch.float8_e4m3fn, 128), (16, 96, 4, 4, torch.float8_e4m3fn, 32),
              (23, 272, 4, 2, torch.bfloat16, 128), (11, 64, 3, 3, torch.float32, 128)]


@pytest.mark.parametrize("m,H,R,k,dtype,group", PACK_CASES)
def test_pack_rows_matches_reference_byte_for_byte(device, m, H, R, k, dtype, group):
    E = max(2 * R, k + 2)
    table = _table(E, R, {0: [R - 1]})
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(m)])
    tok = 50 + torch.arange(m)
    wide = torch.randn(m, H + 16) * torch.logspace(-3, 2, m)[:, None]  # rows of a wider buffer, scaled unevenly
    wide[0, :group] = 0.0  # an all-zero group gets the clamped scale
    x = wide[:, 8:8 + H]
    weights = torch.rand(m, k)
    counts = torch.empty(R, dtype=torch.int64)
    order = ed.route_tokens_ref(ids, tok, table.rank, table.count, counts)
    offsets, B = _offsets(H, k, dtype, group)
    P = int(counts.sum())
    ref = torch.zeros(P + 2, B, dtype=torch.uint8)
    pos = ed.pack_rows_ref(x, ids, weights, tok, order, counts, ref, dtype, offsets, group)
    got = torch.zeros(P + 2, B, dtype=torch.uint8, device=device)
    got_pos = ed.pack_rows(x.to(device), ids.to(device), weights.to(device), tok.to(device), order.to(device),
                           counts.to(device), got, dtype, offsets, group)
    assert torch.equal(got.cpu(), ref) and torch.equal(got_pos.cpu(), pos)
    # rank-major, tokens ascending: rank r's rows follow those of the ranks before it
    sent = [(r, t) for r in range(R) for t in range(m) if order[r, t] >= 0]
    assert [int(pos[r, t]) for r, t in sent] == list(range(P)) and int((pos >= 0).sum()) == P
    # the reference's rows hold what the pieces say: the fp8 codes of quant.fp8_act_quant_ref
    from moetool.kernels.quant import fp8_act_quant_ref

    for r in range(R):
        for t in range(m):
            p = int(pos[r, t])
            if p < 0:
                continue
            row = ref[p]
            if dtype == torch.float8_e4m3fn:
                q, s = fp8_act_quant_ref(x[t:t + 1], group)
                assert torch.equal(row[:H], q.view(torch.uint8)[0])
                assert torch.equal(row[offsets[0]:offsets[0] + 4 * s.shape[1]].view(torch.float32), s[0])
            else:
                assert torch.equal(row[:H * dtype.itemsize].view(dtype), x[t].to(dtype))
            assert row[offsets[1]:offsets[1] + 4 * k].view(torch.int32).tolist() == ids[t].tolist()
            assert torch.equal(row[offsets[2]:offsets[2] + 4 * k].view(torch.float32), weights[t])
            assert int(row[offsets[3]:offsets[3] + 8].view(torch.int64)) == 50 + t
    assert (ref[P:] == 0).all()  # rows past the last sent one are not touched
