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
# (1300, k 8) and (2100, k 3) run send_positions over several token blocks (512 / 1024 per block)
CASES = [(37, 8, 4, 2, {1: [0, 2], 5: [3]}), (1, 4, 1, 1, None), (300, 64, 4, 8, {3: [1, 2, 3]}),
         (64, 16, 8, 3, None), (5, 6, 3, 6, {0: [1]}), (1300, 16, 4, 8, {2: [0]}), (2100, 12, 3, 3, None)]


@pytest.mark.parametrize("m,E,R,k,redundant", CASES)
def test_route_and_positions_match_reference(device, m, E, R, k, redundant):
    table = _table(E, R, redundant)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(m)])  # distinct experts per token
    tok = 1000 + torch.arange(m)
    args = (table.rank, table.count, R)
    dest_ref, counts_ref = ed.route_ranks_ref(ids, tok, *args)
    dest, counts = ed.route_ranks(ids.to(device), tok.to(device), *(a.to(device) if torch.is_tensor(a) else a for a in args))
    assert torch.equal(dest.cpu(), dest_ref) and torch.equal(counts.cpu(), counts_ref)
    assert counts_ref.tolist() == [int((dest_ref == r).any(dim=1).sum()) for r in range(R)]
    P = int(counts_ref.sum())
    pos_ref, pair_ref = ed.send_positions_ref(dest_ref, counts_ref, P)
    pos, pair = ed.send_positions(dest, counts, P)
    assert torch.equal(pos.cpu(), pos_ref) and torch.equal(pair.cpu(), pair_ref)
    # rank-major, tokens ascending, every sent (rank, token) once
    want = [t for r in range(R) for t in range(m) if (dest_ref[t] == r).any()]
    assert pair_ref.tolist() == want
    for r in range(R):
        for t in range(m):
            p = int(pos_ref[r, t])
            assert (p >= 0) == bool((dest_ref[t] == r).any()) and (p < 0 or want[p] == t)


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
    dest, counts = ed.route_ranks(ids, tok, table.rank.to(device), table.count.to(device), 2)
    assert dest.shape == (0, 2) and counts.tolist() == [0, 0]
    pos, pair = ed.send_positions(dest, counts, 0)
    assert pos.shape == (2, 0) and pair.shape == (0,)


def test_bad_arguments_are_named(device):
    table = _table(4, 2)
    with pytest.raises(MoetoolError, match="token_index must be int64"):
        ed.route_ranks(torch.zeros(3, 2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), table.rank, table.count, 2)
    with pytest.raises(MoetoolError, match="topk ids must be int32/int64"):
        ed.local_slots(torch.zeros(3, 2), torch.zeros(3, dtype=torch.int64), table.rank, table.slot, table.count, 0, 2)
    with pytest.raises(MoetoolError, match="dest must be contiguous int32"):
        ed.send_positions(torch.zeros(3, 2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), 0)
