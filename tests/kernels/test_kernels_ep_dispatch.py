"""ep_dispatch kernels (Triton) against their torch references: integer outputs, so exact."""
import pytest
import torch
from moetool.kernels import ep_dispatch as ed
from moetool.kernels.common import TOKEN_GROUP, PeerBuffers, act_scale_cols

from moetool.errors import MoetoolError
from moetool.model.placement import linear_placement
from moetool.verify.topology import RouteTable
from moetool.verify.wire import RowLayout


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
# (1300, k 8) and (2100, k 3) run route_tokens over several token blocks (512 / 1024 per block);
# block_elements 64 / 32 below make several blocks of the small cases too
CASES = [(37, 8, 4, 2, {1: [0, 2], 5: [3]}), (1, 4, 1, 1, None), (300, 64, 4, 8, {3: [1, 2, 3]}),
         (64, 16, 8, 3, None), (5, 6, 3, 6, {0: [1]}), (1300, 16, 4, 8, {2: [0]}), (2100, 12, 3, 3, None)]


@pytest.mark.parametrize("block_elements", [4096, 64])  # 64: several blocks even for small m (two passes)
@pytest.mark.parametrize("m,E,R,k,redundant", CASES)
def test_route_tokens_matches_reference(device, m, E, R, k, redundant, block_elements):
    table = _table(E, R, redundant)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(m)])  # distinct experts per token
    tok = 1000 + torch.arange(m)
    counts_ref = torch.full((R,), -7, dtype=torch.int64)
    order_ref = ed.route_tokens_ref(ids, tok, table.rank, table.count, counts_ref)
    counts = torch.full((R,), -7, dtype=torch.int64, device=device)
    order = ed.route_tokens(ids.to(device), tok.to(device), table.rank.to(device), table.count.to(device), counts,
                            block_elements=block_elements)
    assert torch.equal(order.cpu(), order_ref) and torch.equal(counts.cpu(), counts_ref)
    # the same choice as RouteTable.destinations; tokens ascending per rank, each counted once
    dest, _ = table.destinations(ids, tok)
    for r in range(R):
        sent = [t for t in range(m) if (dest[t] == r).any()]
        assert counts_ref[r] == len(sent)
        assert [t for t in range(m) if order_ref[r, t] >= 0] == sent
        assert order_ref[r, sent].tolist() == list(range(len(sent)))


@pytest.mark.parametrize("max_programs", [256, 3])  # 3: each program loops over several token blocks
@pytest.mark.parametrize("m,E,R,k,redundant", CASES)
def test_local_slots_match_reference_on_strided_views(device, m, E, R, k, redundant, max_programs):
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
                                             table.slot.to(device), table.count.to(device), rank, L,
                                             max_programs=max_programs)
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
    for rank in range(2):  # a rank whose dp group has no tokens still hosts experts
        got = ed.local_slots(ids, tok, table.rank.to(device), table.slot.to(device), table.count.to(device), rank, 2)
        want = ed.local_slots_ref(ids.cpu(), tok.cpu(), table.rank, table.slot, table.count, rank, 2)
        assert got[0].shape == (0, 2) and all(torch.equal(g.cpu(), w) for g, w in zip(got, want))
    from moetool.kernels import ep_combine as ec

    rows = torch.randn(3, 8, device=device)
    assert ec.combine_rows(rows, torch.zeros(0, 2, dtype=torch.int64, device=device)).shape == (0, 8)


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
    with pytest.raises(MoetoolError, match="fp8 group must be a power of two >= 16 or TOKEN_GROUP"):
        ed.pack_rows(x, ids, w, tok, order, counts, torch.zeros(4, 64, dtype=torch.uint8), torch.float8_e4m3fn,
                     (16, 32, 40, 48), 24)
    with pytest.raises(MoetoolError, match="out must be contiguous uint8"):
        ed.pack_rows(x, ids, w, tok, order, counts, torch.zeros(4, 40, dtype=torch.uint8), torch.float32,
                     (None, 16, 24, 32))
    with pytest.raises(MoetoolError, match="disagree on R"):
        ed.pack_rows(x, ids, w, tok, order, torch.zeros(3, dtype=torch.int64), torch.zeros(4, 48, dtype=torch.uint8),
                     torch.float32, (None, 32, 40, 16))
    # found by a review: each of these was accepted and read or wrote outside its tensor
    with pytest.raises(MoetoolError, match=r"do not fit rows of 48 bytes"):  # a field before the row
        ed.pack_rows(x, ids, w, tok, order, counts, torch.zeros(4, 48, dtype=torch.uint8), torch.float32,
                     (None, 32, 40, -16))
    wide = torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(MoetoolError, match=r"count_tab must be contiguous int64 \[E\] = \[4\]"):
        ed.route_tokens(ids, tok, table.rank, wide[:, 0], counts)
    with pytest.raises(MoetoolError, match=r"slot_tab \[2, 1\] must have rank_tab's shape \[4, 1\]"):
        ed.local_slots(ids, tok, table.rank, table.slot[:2].contiguous(), table.count, 0, 2)


def test_route_tokens_takes_any_block_size(device):
    """``block_elements`` is a tuning knob: one that is no power of two gives the same order."""
    table = _table(8, 4)
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(100)])
    tok = torch.arange(100)
    want = ed.route_tokens_ref(ids, tok, table.rank, table.count, torch.zeros(4, dtype=torch.int64))
    counts = torch.zeros(4, dtype=torch.int64, device=device)
    got = ed.route_tokens(ids.to(device), tok.to(device), table.rank.to(device), table.count.to(device), counts,
                          block_elements=100)
    assert torch.equal(got.cpu(), want)


def _offsets(H: int, k: int, dtype: torch.dtype, group: int) -> tuple[tuple, int]:
    """Parts 16-byte aligned as RowLayout lays them out: (scale, ids, weights, token), row bytes."""
    payload = ((dtype, H),) + (((torch.float32, act_scale_cols(H, group)),) if dtype == torch.float8_e4m3fn else ())
    layout = RowLayout(payload + ((torch.int32, k), (torch.float32, k), (torch.int64, 1)))
    offs = layout.offsets
    return ((offs[1] if len(payload) == 2 else None, *offs[-4:-1]), layout.row_bytes)


# (tokens, hidden, ranks, k, wire dtype, group): H not a multiple of the group, one group,
# several h-blocks (H 2304 = 18 groups of 128 -> 3 blocks of 8), bf16 / fp32 rows; per token
# (group 0): H 7168 in one h-block, H 9000 over two (each finds the row's amax), H 7 < 16
PACK_CASES = [(37, 384, 4, 3, torch.float8_e4m3fn, 128), (5, 200, 3, 2, torch.float8_e4m3fn, 128),
              (9, 2304, 2, 8, torch.float8_e4m3fn, 128), (16, 96, 4, 4, torch.float8_e4m3fn, 32),
              (23, 272, 4, 2, torch.bfloat16, 128), (11, 64, 3, 3, torch.float32, 128),
              (37, 384, 4, 3, torch.float8_e4m3fn, TOKEN_GROUP), (3, 7168, 2, 8, torch.float8_e4m3fn, TOKEN_GROUP),
              (4, 9000, 3, 2, torch.float8_e4m3fn, TOKEN_GROUP), (6, 7, 2, 2, torch.float8_e4m3fn, TOKEN_GROUP)]


@pytest.mark.parametrize("m,H,R,k,dtype,group", PACK_CASES)
def test_pack_rows_matches_reference_byte_for_byte(device, m, H, R, k, dtype, group):
    E = max(2 * R, k + 2)
    table = _table(E, R, {0: [R - 1]})
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(m)])
    tok = 50 + torch.arange(m)
    wide = torch.randn(m, H + 16) * torch.logspace(-3, 2, m)[:, None]  # rows of a wider buffer, scaled unevenly
    wide[0, 8:8 + (group or H)] = 0.0  # an all-zero group (per token: row) gets the clamped scale
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


# ---------------------------------------------------------------------------------------------
# peer mode: R ranks simulated in one process, each "rank's" buffer a separate tensor
# ---------------------------------------------------------------------------------------------


def _peers(R: int, shape: tuple, dtype: torch.dtype, device: str, fill: int = 0xA5):
    """R buffers pre-filled with stale bytes (what a previous chunk left), as PeerBuffers."""

    views = [torch.full(shape, fill, dtype=torch.uint8, device=device).view(dtype).reshape(shape)
             if dtype.itemsize == 1 else torch.full(shape, -5, dtype=dtype, device=device) for _ in range(R)]
    return PeerBuffers(views, torch.device(device))


@pytest.mark.parametrize("block_elements", [4096, 32])
@pytest.mark.parametrize("m,E,R,k,redundant", CASES[:5])
def test_route_tokens_stores_counts_into_every_peer(device, m, E, R, k, redundant, block_elements):
    table = _table(E, R, redundant)
    ref_peers, got_peers = _peers(R, (R,), torch.int64, "cpu"), _peers(R, (R,), torch.int64, device)
    sent = torch.zeros(R, R, dtype=torch.int64)  # [source, destination]
    for me in range(R):  # each simulated rank routes its own tokens
        ids = torch.stack([torch.randperm(E)[:k] for _ in range(m)])
        tok = me * m + torch.arange(m)
        counts_ref = torch.empty(R, dtype=torch.int64)
        order_ref = ed.route_tokens_ref(ids, tok, table.rank, table.count, counts_ref, ref_peers, me)
        counts = torch.empty(R, dtype=torch.int64, device=device)
        order = ed.route_tokens(ids.to(device), tok.to(device), table.rank.to(device), table.count.to(device),
                                counts, got_peers, me, block_elements=block_elements)
        assert torch.equal(order.cpu(), order_ref) and torch.equal(counts.cpu(), counts_ref)
        sent[me] = counts_ref
    for r in range(R):  # rank r's copy holds what every source sends it
        assert torch.equal(ref_peers.views[r], sent[:, r]) and torch.equal(got_peers.views[r].cpu(), sent[:, r])


@pytest.mark.parametrize("m,H,R,k,dtype,group", PACK_CASES)
def test_pack_rows_into_peer_buffers_byte_for_byte(device, m, H, R, k, dtype, group):
    """Each simulated rank packs into every rank's receive buffer: same bytes as the kernel's
    local mode puts in the send buffer, in region [me] of the destination, stale rows untouched."""
    E = max(2 * R, k + 2)
    table = _table(E, R, {0: [R - 1]})
    offsets, B = _offsets(H, k, dtype, group)
    cap = m + 3
    ref_peers, got_peers = _peers(R, (R * cap, B), torch.uint8, "cpu"), _peers(R, (R * cap, B), torch.uint8, device)
    stale = ref_peers.views[0].clone()
    filled = torch.zeros(R, R, dtype=torch.int64)  # [destination, source]
    for me in range(R):
        ids = torch.stack([torch.randperm(E)[:k] for _ in range(m)])
        tok = me * 100 + torch.arange(m)
        x = torch.randn(m, H) * torch.logspace(-2, 1, m)[:, None]
        weights = torch.rand(m, k)
        counts = torch.empty(R, dtype=torch.int64)
        order = ed.route_tokens_ref(ids, tok, table.rank, table.count, counts)
        pos_ref = ed.pack_rows_ref(x, ids, weights, tok, order, counts, ref_peers, dtype, offsets, group, me)
        pos = ed.pack_rows(x.to(device), ids.to(device), weights.to(device), tok.to(device), order.to(device),
                           counts.to(device), got_peers, dtype, offsets, group, me)
        assert torch.equal(pos.cpu(), pos_ref)
        local = torch.full((int(counts.sum()), B), 0xA5, dtype=torch.uint8)  # padding bytes stay stale too
        local_pos = ed.pack_rows_ref(x, ids, weights, tok, order, counts, local, dtype, offsets, group)
        for r in range(R):
            n = int(counts[r])
            rows = ref_peers.views[r][me * cap:me * cap + n]
            assert torch.equal(rows, local[local_pos[r][order[r] >= 0]])  # the same rows, tokens ascending
            assert torch.equal(pos_ref[r][order[r] >= 0], r * cap + torch.arange(n))
        filled[:, me] = counts
    for r in range(R):
        assert torch.equal(got_peers.views[r].cpu(), ref_peers.views[r])
        for s in range(R):  # rows past what source s sent keep their stale bytes
            n = int(filled[r, s])
            assert torch.equal(ref_peers.views[r][s * cap + n:(s + 1) * cap], stale[s * cap + n:(s + 1) * cap])


@pytest.mark.parametrize("max_programs", [256, 1])
def test_local_slots_skip_stale_rows_of_regions(device, max_programs):
    """Rows past each region's count hold garbage (ids far out of range): never read, ids -1."""
    E, R, k, cap = 12, 3, 4, 9
    table = _table(E, R, {2: [0, 1]})
    ids = torch.randint(-10**6, 10**6, (R * cap, k), dtype=torch.int32)  # stale
    tok = torch.randint(-10**9, 10**9, (R * cap,))
    filled = torch.tensor([4, 0, 9])
    for s, n in enumerate(filled.tolist()):
        ids[s * cap:s * cap + n] = torch.stack([torch.randperm(E)[:k] for _ in range(n)]).to(torch.int32) if n else ids[:0]
        tok[s * cap:s * cap + n] = 100 * s + torch.arange(n)
    for rank in range(R):
        L = len(table.rank[table.rank == rank])
        ref_ids, ref_counts = ed.local_slots_ref(ids, tok, table.rank, table.slot, table.count, rank, L, filled)
        got_ids, got_counts = ed.local_slots(ids.to(device), tok.to(device), table.rank.to(device),
                                             table.slot.to(device), table.count.to(device), rank, L, filled.to(device),
                                             max_programs=max_programs)
        assert torch.equal(got_ids.cpu(), ref_ids) and torch.equal(got_counts.cpu(), ref_counts)
        valid = torch.cat([torch.arange(cap) < n for n in filled.tolist()])
        assert (ref_ids[~valid] == -1).all()
        want, _ = ed.local_slots_ref(ids[valid], tok[valid], table.rank, table.slot, table.count, rank, L)
        assert torch.equal(ref_ids[valid], want)
    with pytest.raises(MoetoolError, match="equal regions"):
        ed.local_slots(ids.to(device), tok.to(device), table.rank.to(device), table.slot.to(device),
                       table.count.to(device), 0, 2, torch.tensor([1, 1], device=device))


@pytest.mark.parametrize("dtype,out_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                             (torch.bfloat16, torch.bfloat16)])
def test_combine_from_peers_equals_rows_sent_back_then_combined(device, dtype, out_dtype):
    """Every rank reads its tokens' rows where the experts left them and sums them: the same bytes
    as sending the rows back into the sender's layout first and summing there (combine_rows),
    also into tp gather buffers."""
    from moetool.kernels import ep_combine as ec

    R, m, H = 3, 7, 300
    cap = m
    sent = torch.rand(R, m, R) < 0.6  # [source, token, destination]
    sent[:, 0] = False  # a token sent nowhere sums to 0
    order = torch.where(sent, torch.cumsum(sent.long(), 1) - 1, -1)  # index among the tokens to that rank
    pos = torch.where(sent, torch.arange(R)[None, None, :] * cap + order, -1)  # [s, m, R]
    expert_out = _peers(R, (R * cap, H), dtype, device)  # rank r's results: region s = the rows s sent it
    for v in expert_out.views:
        v.copy_(torch.randn(R * cap, H).to(dtype))  # stale rows included: never read
    back = _peers(R, (R * cap, H), dtype, device)  # region r of rank s: rank r's results for s, in order
    for r in range(R):
        for s, n in enumerate(sent[:, :, r].sum(1).tolist()):
            back.views[s][r * cap:r * cap + n] = expert_out.views[r][s * cap:s * cap + n]
    for s in range(R):
        pos_s = pos[s].to(device)
        push = ec.combine_rows(back.views[s], pos_s, out=torch.empty(m, H, dtype=out_dtype, device=device))
        pull = ec.combine_from_peers(expert_out, pos_s, s, out=torch.empty(m, H, dtype=out_dtype, device=device))
        ref = ec.combine_from_peers_ref(_cpu(expert_out), pos[s], s, out=torch.empty(m, H, dtype=out_dtype))
        assert torch.equal(pull.cpu(), push.cpu()) and torch.equal(pull.cpu(), ref)
        assert not pull[0].any()
    # into every tp rank's gather buffer at row0, as combine_rows does (tp group = ranks 0 and 1)
    gathered, want = _peers(2, (2 * m, H), dtype, device), _peers(2, (2 * m, H), dtype, device)
    for s in range(2):
        ec.combine_from_peers(expert_out, pos[s].to(device), s, peers=gathered, row0=s * m)
        ec.combine_rows(back.views[s], pos[s].to(device), peers=want, row0=s * m)
    for g, w in zip(gathered.views, want.views):
        assert torch.equal(g.cpu(), w.cpu())
    with pytest.raises(MoetoolError, match=r"pos must be int32/int64 \[m, 3\]"):
        ec.combine_from_peers(expert_out, pos[0][:, :2].to(device), 0)


def _cpu(peers: PeerBuffers) -> PeerBuffers:
    return PeerBuffers([v.cpu() for v in peers.views], torch.device("cpu"))
