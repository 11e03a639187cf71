"""The stream <-> per-sample slot moves of rlkernel/model/layout.py: when a layout's slots are the
stream's first rows in order (equal-length samples back to back, as a training microbatch of one
response length is), `to_samples` is a view and `to_stream` a reshape, with the bytes and the
gradients of the gather / scatter path they replace — in a single process and at CP2 (2 gloo
ranks, local query slots and gathered logical keys both prefix maps). When each sample's slots
are one run of consecutive rows (`StreamLayout.packed_rows`: samples of any lengths as the packer
lays them out), the model's invariant attention reads the streams in place
(kernels/attention.attention_packed) with the bytes of the gather path, single process and CP2.
The native arm's `attention_packed` (flash varlen attention on CUDA) falls back on the CPU to the
gather path's bytes, single process and CP2; `StreamLayout.packed_segments` (its cu_seqlens) is
checked on hand-made layouts. model/varlen.py's varlen_attn call (both torch signatures: GQA,
causality, scale, unowned rows 0) runs on a CPU stand-in for varlen_attn, and `usable`'s host
checks on stand-ins for CUDA tensors (the CUDA test, tests/test_cuda_reference.py, runs the real
flash kernel, with the installed torch's signature only).

Run: `.venv/bin/python -m pytest -q tests/test_layout.py` (about 20 s).
"""

from __future__ import annotations

import pickle

import pytest
import torch

from rlkernel.model.checkpoint import init_weights
from rlkernel.model.config import tiny
from rlkernel.model.layout import (StreamLayout, chunk_layout, cp_local_layout, packed_layout,
                                   slots_are_views, to_samples, to_stream)
from rlkernel.model.ops import InvariantOps, NativeOps
from rlkernel.model.qwen3 import Qwen3ForCausalLM
from rlkernel.train.losses import LossCoefs, invariant_exp
from rlkernel.train.step import TrainSample, compute_gradients, gradients


def _seqs(lengths: list[int]) -> list[list[int]]:
    return [[(7 * i + j) % 250 for j in range(n)] for i, n in enumerate(lengths)]


def test_prefix_slots_only_for_equal_samples_back_to_back():
    """Equal leaf-multiple lengths (and one-token decode chunks) are the prefix case; unequal
    lengths, lengths off the leaf (gaps between samples) and a CP rank holding unequal parts of its
    samples are not; a CP layout's logical keys of equal samples are."""
    def prefix(lay, idx=None):
        return lay.slots_are_prefix(lay.q_idx if idx is None else idx)
    assert prefix(packed_layout(_seqs([32, 32, 32]), 257, multiple=64))
    assert prefix(packed_layout(_seqs([16]), 257))
    assert not prefix(packed_layout(_seqs([32, 16]), 257))
    assert not prefix(packed_layout(_seqs([30, 30]), 257))      # sample 1 starts at row 32
    assert prefix(chunk_layout([[1], [2], [3]], [4, 9, 2], 257))
    assert not prefix(chunk_layout([[1, 2], [3]], [0, 0], 257))
    full = packed_layout(_seqs([32, 32]), 257, multiple=64)
    even = cp_local_layout(full, torch.tensor([0, 1, 2, 3, 60, 61, 62, 63]))
    assert prefix(even) and prefix(even, even.kv_idx)      # 4 local rows of each sample
    uneven = cp_local_layout(full, torch.tensor([0, 1, 2, 3, 28, 29, 30, 31]))
    assert not prefix(uneven) and prefix(uneven, uneven.kv_idx)   # sample 1: no local row


def _moves(lay: StreamLayout, fast: bool, x: torch.Tensor, w_s: torch.Tensor,
           w_x: torch.Tensor):
    """to_samples then to_stream of x, through lay (fast) or through the gather path (lay None),
    and the gradient of a weighted sum of both results."""
    x = x.clone().requires_grad_(True)
    use = lay if fast else None
    s = to_samples(x, lay.q_idx, use)
    back = to_stream(s * 3.0, lay.q_idx, x.shape[0], use)
    ((s * w_s).sum() + (back * w_x).sum()).backward()
    return s, back, x.grad


def test_prefix_moves_give_the_gather_paths_bytes_and_gradients():
    """Padded stream (64 rows, 48 in slots): the view's values, the stream rebuilt with +0
    padding rows and the gradient reaching x are bitwise the gather / scatter path's, and the
    fast path really ran (the slot view shares x's storage)."""
    lay = packed_layout(_seqs([16, 16, 16]), 257, multiple=64)
    assert lay.tokens.shape[0] == 64 and lay.slots_are_prefix(lay.q_idx)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 4, generator=g)
    x[5] = -0.0                                          # the sign of a zero survives both
    w_s, w_x = torch.randn(3, 16, 3, 4, generator=g), torch.randn(64, 3, 4, generator=g)
    fast = _moves(lay, True, x, w_s, w_x)
    slow = _moves(lay, False, x, w_s, w_x)
    for a, b in zip(fast, slow):
        assert a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert torch.equal(fast[1][48:], torch.zeros(16, 3, 4))
    xv = torch.randn(48, 2, generator=g)
    assert to_samples(xv, lay.q_idx, lay).data_ptr() == xv.data_ptr()
    assert to_samples(xv, lay.q_idx, None).data_ptr() != xv.data_ptr()


def _equal_samples() -> list[TrainSample]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(3):
        ids = torch.randint(0, 250, (32,), generator=g).tolist()
        lp = -torch.rand(22, generator=g)
        out.append(TrainSample(i, tuple(ids[:10]), tuple(ids[10:]), lp, 0.5 - 0.4 * i))
    return out


def _step_bits(samples, pc=None, ops=InvariantOps):
    """Stats and gradients (int32 bits) of one bf16 step of the tiny model (pc: its ranks)."""
    cfg = tiny()
    pol = Qwen3ForCausalLM(cfg, ops, torch.bfloat16, pc)
    pol.load_tensors(init_weights(cfg, 0))
    st = compute_gradients(pol, None, samples, temperature=0.8,
                           coefs=LossCoefs(0.2, 0.0, 0.01, "k1"), micro_batch_tokens=512,
                           pad_id=257, exp=invariant_exp)
    return st, {n: g.view(torch.int32).clone() for n, g in gradients(pol).items()}


def _unequal_samples() -> list[TrainSample]:
    """Samples ending at their EOS: prompt 10, responses 22, 7, 15 (rows off the leaf)."""
    g = torch.Generator().manual_seed(3)
    out = []
    for i, n in enumerate((22, 7, 15)):
        ids = torch.randint(0, 250, (10 + n,), generator=g).tolist()
        out.append(TrainSample(i, tuple(ids[:10]), tuple(ids[10:]), -torch.rand(n, generator=g),
                               0.5 - 0.4 * i))
    return out


def _count_prefix_hits(monkeypatch) -> dict:
    """Count the layouts' prefix answers that were True (the views taken) and the packed
    attention calls (the streams read in place)."""
    calls = {"prefix": 0, "packed": 0}
    real, real_packed = StreamLayout.slots_are_prefix, InvariantOps.attention_packed

    def counted(self, idx):
        hit = real(self, idx)
        calls["prefix"] += hit
        return hit

    def counted_packed(*a, **kw):
        calls["packed"] += 1
        return real_packed(*a, **kw)
    monkeypatch.setattr(StreamLayout, "slots_are_prefix", counted)
    monkeypatch.setattr(InvariantOps, "attention_packed", staticmethod(counted_packed))
    return calls


def _same_bits(a, b) -> bool:
    (st_a, g_a), (st_b, g_b) = a, b
    return st_a == st_b and g_a.keys() == g_b.keys() and all(torch.equal(g_a[n], g_b[n])
                                                             for n in g_a)


def test_a_training_step_on_equal_samples_is_bitwise_the_gather_paths(monkeypatch):
    """compute_gradients on equal-length samples (the prefix case) with the views, with the
    views switched off (then the packed attention reads the streams in place) and with both off
    (the gathers): every gradient and stat has the same bytes, and each fast path was taken
    (counted). bf16 rounding points, so the views feed the casts the gathers fed."""
    samples = _equal_samples()
    calls = _count_prefix_hits(monkeypatch)
    views = _step_bits(samples)
    assert calls["prefix"] > 0 and calls["packed"] == 0
    monkeypatch.setattr(StreamLayout, "slots_are_prefix", lambda self, idx: False)
    packed = _step_bits(samples)
    assert calls["packed"] > 0
    monkeypatch.setattr(StreamLayout, "packed_rows", lambda self: None)
    gathers = _step_bits(samples)
    assert _same_bits(views, gathers) and _same_bits(packed, gathers)


def test_a_training_step_on_unequal_samples_reads_the_streams_in_place(monkeypatch):
    """Samples ending at their EOS (lengths 32, 17, 25: not the prefix case): the invariant
    attention reads each sample's rows of the packed streams in place (counted), with every
    gradient and stat bitwise the gather path's (packed_rows switched off). Control: key rows
    one off (k_rows + 1 in the layout's answer) change the bytes, so the comparison can fail."""
    samples = _unequal_samples()
    calls = _count_prefix_hits(monkeypatch)
    packed = _step_bits(samples)
    assert calls["packed"] > 0
    real = StreamLayout.packed_rows
    monkeypatch.setattr(StreamLayout, "packed_rows", lambda self: None)
    assert _same_bits(packed, _step_bits(samples))

    def one_off(self):
        rows = real(self)
        return None if rows is None else (rows[0], rows[1] + 1, rows[2])
    monkeypatch.setattr(StreamLayout, "packed_rows", one_off)
    assert not _same_bits(packed, _step_bits(samples))


def test_packed_rows_of_training_layouts_and_what_is_refused():
    """packed_rows: the packer's sample offsets for unequal and equal samples; a CP rank's local
    query rows and the logical key rows; the moved copy keeps the host answer (meta device).
    None where a sample's slots are not one run of rows from its first: slots reversed, a gap
    inside a sample, an empty slot before a valid one, validity of q_idx and q_pos disagreeing,
    keys fewer than kv_len (a decode chunk over a KV cache)."""
    lay = packed_layout(_seqs([32, 17, 25]), 257)
    q_rows, k_rows, tk = lay.packed_rows()
    assert q_rows.tolist() == k_rows.tolist() == [0, 32, 64] and tk == 32
    full = packed_layout(_seqs([32, 32]), 257, multiple=64)
    cp = cp_local_layout(full, torch.tensor([0, 1, 2, 3, 28, 29, 30, 31]))
    q_rows, k_rows, _ = cp.packed_rows()
    assert q_rows.tolist() == [0, 0] and k_rows.tolist() == [0, 32]
    moved = cp.to(torch.device("meta"))
    assert moved.packed_rows()[0].is_meta and moved.packed_rows()[2] == 32
    for q_idx in ([[3, 2, 1, 0], [4, 5, 6, 7]], [[0, 1, 2, 4], [5, 6, 7, 8]],
                  [[0, -1, 2, 3], [4, 5, 6, 7]]):
        assert _slot_map_layout(q_idx, 10).packed_rows() is None, q_idx
    ok = _slot_map_layout([[0, 1, 2, -1], [4, 5, 6, 7]], 10)
    assert ok.packed_rows()[0].tolist() == [0, 4]
    bad_pos = StreamLayout(ok.tokens, ok.positions, ok.q_idx, ok.q_pos.clamp(min=0), ok.kv_len)
    assert bad_pos.packed_rows() is None
    assert chunk_layout([[1], [2]], [4, 9], 257).packed_rows() is None



def test_packed_rows_need_q_idx_and_q_pos_valid_at_the_same_slots():
    """Sample 0's query slots are one run of rows (0, 1, 2, then an empty slot) and its q_pos
    has as many valid slots, but not the same ones (slot 2 empty, slot 3 valid: the kernels
    would read row 3, which q_idx does not name): packed_rows is None. Control: q_pos valid at
    q_idx's slots is packed."""
    idx = torch.tensor([[0, 1, 2, -1], [4, 5, 6, 7]])
    rows = torch.zeros(10, dtype=torch.long)
    kv_len = torch.tensor([3, 4])
    same = torch.tensor([[0, 1, 2, -1], [0, 1, 2, 3]])
    other = torch.tensor([[0, 1, -1, 2], [0, 1, 2, 3]])
    assert StreamLayout(rows, rows.clone(), idx, same, kv_len).packed_rows()[0].tolist() == [0, 4]
    assert StreamLayout(rows, rows.clone(), idx, other, kv_len).packed_rows() is None


def test_to_carries_the_packed_rows_values_to_the_moved_copy():
    """`to` hands the moved layout the host's packed_rows answer with its values: a CP rank's
    local query rows [0, 0], logical key rows [0, 32] and tk 32 (moved to "cpu:0", a device
    unequal to "cpu" whose tensors can be read, so the values themselves are checked)."""
    full = packed_layout(_seqs([32, 32]), 257, multiple=64)
    cp = cp_local_layout(full, torch.tensor([0, 1, 2, 3, 28, 29, 30, 31]))
    moved = cp.to(torch.device("cpu", 0))
    assert moved is not cp
    q_rows, k_rows, tk = moved.packed_rows()
    assert q_rows.tolist() == [0, 0] and k_rows.tolist() == [0, 32] and tk == 32


def test_to_hands_the_moved_copy_a_bound_one_past_its_last_position():
    """`to` gives the moved layout pos_bound = the largest position + 1, read on the host (the
    RoPE lookup then gathers from a device copy of the table without a host read): a fresh
    RopeTable looked up with that bound returns the rows of the unbounded lookup, bitwise, up to
    the last position (299, past the table's first 256 rows). A bound one short would leave the
    last position outside the table. A layout already carrying a bound keeps it."""
    from rlkernel.kernels.rope import RopeTable
    lay = packed_layout(_seqs([300, 17]), 257)
    moved = lay.to(torch.device("cpu", 0))
    assert moved.pos_bound == int(lay.positions.max()) + 1 == 300
    got = RopeTable(8, 1e6).lookup(moved.positions, moved.pos_bound)
    want = RopeTable(8, 1e6).lookup(lay.positions)
    for g, w in zip(got, want):
        assert torch.equal(g.view(torch.int32), w.view(torch.int32))
    again = moved.to(torch.device("cpu"))
    assert again.pos_bound == 300


def test_slots_are_views_only_when_query_and_key_slots_are_both_the_prefix():
    """slots_are_views (the model's choice of the views over the packed attention): True when
    the query slots and the key slots are both the streams' first rows in order (kv_idx None:
    the keys are the query slots); False when only one of them is (keys one row off, or
    queries one row off)."""
    prefix = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    rows = torch.zeros(10, dtype=torch.long)
    pos = torch.arange(4).expand(2, 4).clone()

    def lay(q_idx, kv_idx=None):
        return StreamLayout(rows, rows.clone(), q_idx, pos, torch.tensor([4, 4]), kv_idx)
    assert slots_are_views(lay(prefix), 10, 10)
    assert slots_are_views(lay(prefix, prefix.clone()), 10, 10)
    assert not slots_are_views(lay(prefix, prefix + 1), 10, 10)
    assert not slots_are_views(lay(prefix + 1, prefix.clone()), 10, 10)


def _cp2_rank(rank: int, out_dir: str) -> None:
    """One of 2 CP ranks (gloo): the equal-samples step with the prefix answers counted."""
    import torch.distributed as dist

    from rlkernel.config import RunConfig
    from rlkernel.distributed.context import build_contexts
    from rlkernel.distributed.topology import Topology, build_comms

    topo = Topology.from_config(RunConfig(cp=2), rank, dist.get_world_size())
    pc, _ = build_contexts(topo, build_comms(topo), tiny())
    mp = pytest.MonkeyPatch()
    try:
        calls = _count_prefix_hits(mp)
        equal = _step_bits(_equal_samples(), pc)
        hits = dict(calls)
        unequal = _step_bits(_unequal_samples(), pc)
    finally:
        mp.undo()
    with open(f"{out_dir}/rank{rank}.pkl", "wb") as f:
        pickle.dump((equal, hits, unequal, calls["packed"] - hits["packed"]), f)


def test_cp2_takes_the_fast_paths_and_gives_the_single_process_bytes(tmp_path):
    """CP2 (2 gloo ranks). Equal-length samples: each rank's local query slots and the gathered
    logical keys are read without gathers (prefix views, or the packed attention where a rank's
    query slots are not the prefix case; counted on both ranks); samples ending at their EOS:
    the packed attention on both ranks (counted). Every rank's gradients and stats have the
    single process's bytes in both cases."""
    from rlkernel.distributed.launch import launch

    one = _step_bits(_equal_samples()), _step_bits(_unequal_samples())
    launch(_cp2_rank, (str(tmp_path),), world_size=2, backend="gloo", timeout_s=120)
    for r in range(2):
        with open(tmp_path / f"rank{r}.pkl", "rb") as fh:
            equal, hits, unequal, packed_calls = pickle.load(fh)
        assert hits["prefix"] + hits["packed"] > 0, f"CP rank {r} gathered everything"
        assert packed_calls > 0, f"CP rank {r}: no packed attention on unequal samples"
        assert _same_bits(equal, one[0]), f"CP rank {r}, equal samples"
        assert _same_bits(unequal, one[1]), f"CP rank {r}, unequal samples"


def _slot_map_layout(q_idx: list[list[int]], n_rows: int) -> StreamLayout:
    """A layout of n_rows stream rows whose slot map is q_idx (−1 = empty slot)."""
    idx = torch.tensor(q_idx)
    pos = torch.where(idx >= 0, torch.arange(idx.shape[1]).expand_as(idx), -1)
    rows = torch.zeros(n_rows, dtype=torch.long)
    return StreamLayout(rows, rows.clone(), idx, pos, (idx >= 0).sum(1))


def test_slot_maps_one_step_off_the_prefix_take_the_gather_paths_bytes():
    """Slot maps one step away from the stream's first rows in order are not the prefix case:
    every slot one row later (row 0 unread), the two samples swapped, one sample's slots
    reversed, the last slot empty. Through such a layout to_samples / to_stream give the gather
    / scatter path's bytes and gradients (10-row stream, so a wrong view still fits). Control:
    the identity map is the prefix case, and its slot view shares x's storage."""
    maps = {"offset by one row": [[1, 2, 3, 4], [5, 6, 7, 8]],
            "samples swapped": [[4, 5, 6, 7], [0, 1, 2, 3]],
            "slots reversed": [[3, 2, 1, 0], [4, 5, 6, 7]],
            "last slot empty": [[0, 1, 2, 3], [4, 5, 6, -1]]}
    g = torch.Generator().manual_seed(2)
    x = torch.randn(10, 3, generator=g)
    w_s, w_x = torch.randn(2, 4, 3, generator=g), torch.randn(10, 3, generator=g)
    for what, q_idx in maps.items():
        lay = _slot_map_layout(q_idx, 10)
        assert not lay.slots_are_prefix(lay.q_idx), what
        fast = _moves(lay, True, x, w_s, w_x)
        slow = _moves(lay, False, x, w_s, w_x)
        for a, b in zip(fast, slow):
            assert a.shape == b.shape and torch.equal(a.view(torch.int32),
                                                      b.view(torch.int32)), what
    ident = _slot_map_layout([[0, 1, 2, 3], [4, 5, 6, 7]], 10)
    assert ident.slots_are_prefix(ident.q_idx)
    assert to_samples(x, ident.q_idx, ident).data_ptr() == x.data_ptr()


def test_to_carries_each_index_tensors_prefix_flag_to_its_moved_copy():
    """`to` hands the moved layout each index tensor's flag under that tensor's moved copy, read
    on the host before the move (on the device reading it would sync; here the "meta" device,
    which has no values to read at all): a CP rank holding unequal parts of its samples keeps
    q_idx False and kv_idx True, an even rank True and True, plain packed layouts their q_idx
    flag (True for equal samples, False for unequal ones)."""
    full = packed_layout(_seqs([32, 32]), 257, multiple=64)
    cases = [(cp_local_layout(full, torch.tensor([0, 1, 2, 3, 28, 29, 30, 31])), (False, True)),
             (cp_local_layout(full, torch.tensor([0, 1, 2, 3, 60, 61, 62, 63])), (True, True)),
             (full, (True, None)),
             (packed_layout(_seqs([32, 16]), 257), (False, None))]
    for lay, want in cases:
        here = (lay.slots_are_prefix(lay.q_idx),
                None if lay.kv_idx is None else lay.slots_are_prefix(lay.kv_idx))
        assert here == want
        moved = lay.to(torch.device("meta"))
        assert moved.q_idx.is_meta
        got = (moved.slots_are_prefix(moved.q_idx),
               None if moved.kv_idx is None else moved.slots_are_prefix(moved.kv_idx))
        assert got == want, (got, want)


def _count_native_packed(monkeypatch) -> list:
    """Count the native arm's packed attention calls (one per layer and pass)."""
    calls, real = [], NativeOps.attention_packed

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)
    monkeypatch.setattr(NativeOps, "attention_packed", staticmethod(counted))
    return calls


def _native_hidden_bits(seqs: list[list[int]]):
    """The bf16 native tiny model over packed_layout(seqs): its hidden rows and every
    parameter's gradient of a weighted sum of them (int32 bits)."""
    cfg = tiny()
    m = Qwen3ForCausalLM(cfg, NativeOps, torch.bfloat16)
    m.load_tensors(init_weights(cfg, 0))
    h = m.hidden(packed_layout(seqs, 257))
    w = torch.randn(h.shape, generator=torch.Generator().manual_seed(4))
    (h * w).sum().backward()
    return h.detach().view(torch.int32).clone(), {
        n: p.grad.view(torch.int32).clone() for n, p in m.named_parameters() if p.grad is not None}


def test_native_packed_attention_on_cpu_is_bitwise_the_gather_path(monkeypatch):
    """Ragged samples (lengths 32, 17, 25: not the prefix case) through the native arm on the
    CPU: its attention_packed runs (counted) and, flash being CUDA-only, takes the gather path
    inside it, so the hidden rows and every gradient of the model, and a training step's stats
    and gradients, are bitwise those of the model calling the gathers itself
    (packed_attention False: attention_packed not called)."""
    seqs = _seqs([32, 17, 25])
    calls = _count_native_packed(monkeypatch)
    packed = _native_hidden_bits(seqs), _step_bits(_unequal_samples(), ops=NativeOps)
    assert len(calls) > 0
    monkeypatch.setattr(NativeOps, "packed_attention", False)
    n_calls = len(calls)
    plain = _native_hidden_bits(seqs), _step_bits(_unequal_samples(), ops=NativeOps)
    assert len(calls) == n_calls
    assert torch.equal(packed[0][0], plain[0][0])
    assert packed[0][1].keys() == plain[0][1].keys() and len(plain[0][1]) > 0
    assert all(torch.equal(packed[0][1][n], plain[0][1][n]) for n in plain[0][1])
    assert _same_bits(packed[1], plain[1])


def _cp2_native_rank(rank: int, out_dir: str) -> None:
    """One of 2 CP ranks (gloo): the native step on unequal samples through attention_packed
    (counted: under CP its keys are gathered, so the gather path inside it) and with
    packed_attention off."""
    import torch.distributed as dist

    from rlkernel.config import RunConfig
    from rlkernel.distributed.context import build_contexts
    from rlkernel.distributed.topology import Topology, build_comms

    topo = Topology.from_config(RunConfig(cp=2), rank, dist.get_world_size())
    pc, _ = build_contexts(topo, build_comms(topo), tiny())
    mp = pytest.MonkeyPatch()
    try:
        calls = _count_native_packed(mp)
        packed = _step_bits(_unequal_samples(), pc, NativeOps)
        n_calls = len(calls)
        mp.setattr(NativeOps, "packed_attention", False)
        plain = _step_bits(_unequal_samples(), pc, NativeOps)
    finally:
        mp.undo()
    with open(f"{out_dir}/rank{rank}.pkl", "wb") as f:
        pickle.dump((packed, plain, n_calls, len(calls) - n_calls), f)


def test_cp2_native_packed_attention_is_bitwise_the_gather_path(tmp_path):
    """CP2 (2 gloo ranks), native arm, samples ending at their EOS: on every rank the step
    through attention_packed (called: counted) has the stats and gradient bytes of the step
    with packed_attention off (attention_packed not called)."""
    from rlkernel.distributed.launch import launch

    launch(_cp2_native_rank, (str(tmp_path),), world_size=2, backend="gloo", timeout_s=120)
    for r in range(2):
        with open(tmp_path / f"rank{r}.pkl", "rb") as fh:
            packed, plain, n_packed, n_plain = pickle.load(fh)
        assert n_packed > 0 and n_plain == 0, (r, n_packed, n_plain)
        assert _same_bits(packed, plain), f"CP rank {r}"


def _dense_layout(q_idx: list[list[int]], n_rows: int) -> StreamLayout:
    """A dense causal layout of n_rows stream rows whose slot map is q_idx (−1 = empty)."""
    lay = _slot_map_layout(q_idx, n_rows)
    return StreamLayout(lay.tokens, lay.positions, lay.q_idx, lay.q_pos, lay.kv_len,
                        dense_causal=True)


def test_packed_segments_cut_the_stream_at_each_samples_first_row():
    """packed_segments (the native arm's flash varlen cu_seqlens): the packer's layout of
    lengths 32, 17, 25 (gaps after samples 1 and 2, end padding) is cut at rows 0, 32, 64 and
    the stream's end, the padding rows in their sample's segment and not owned; rows before the
    first sample form a leading segment; one sample filling its stream is one segment, every
    row owned (owned None). None where the segments would be wrong: starts not increasing
    (samples swapped), a non-dense layout (rollout chunks), a CP rank's view (gathered keys),
    kv_len unequal to the query slots. `to` carries the host answer (meta device)."""
    lay = packed_layout(_seqs([32, 17, 25]), 257)
    seg = lay.packed_segments()
    assert lay.tokens.shape[0] == 96 and seg.n_rows == 96
    assert seg.cu_seqlens.dtype == torch.int32 and seg.cu_seqlens.tolist() == [0, 32, 64, 96]
    assert seg.max_len == 32
    want = torch.zeros(96, dtype=torch.bool)
    want[0:32] = want[32:49] = want[64:89] = True
    assert torch.equal(seg.owned, want)
    lead = _dense_layout([[2, 3, 4, -1], [5, 6, 7, 8]], 12).packed_segments()
    assert lead.cu_seqlens.tolist() == [0, 2, 5, 12] and lead.max_len == 7
    assert lead.owned.tolist() == [False] * 2 + [True] * 7 + [False] * 3
    one = _dense_layout([[0, 1, 2, 3]], 4).packed_segments()
    assert one.cu_seqlens.tolist() == [0, 4] and one.max_len == 4 and one.owned is None
    assert _dense_layout([[4, 5, 6, 7], [0, 1, 2, 3]], 8).packed_segments() is None
    assert _dense_layout([[4, 5, 6, 7], [0, 1, 2, 3]], 8).packed_rows() is not None
    assert _slot_map_layout([[0, 1, 2, 3], [4, 5, 6, 7]], 8).packed_segments() is None
    assert chunk_layout([[1, 2], [3, 4]], [0, 0], 257).packed_segments() is None
    full = packed_layout(_seqs([32, 32]), 257, multiple=64)
    assert full.packed_segments() is not None
    cp = cp_local_layout(full, torch.tensor([0, 1, 2, 3, 28, 29, 30, 31]))
    assert cp.packed_rows() is not None and cp.packed_segments() is None
    d = _dense_layout([[0, 1, 2, 3], [4, 5, 6, 7]], 8)
    shorter = StreamLayout(d.tokens, d.positions, d.q_idx, d.q_pos, d.kv_len - 1,
                           dense_causal=True)
    assert shorter.packed_rows() is not None and shorter.packed_segments() is None
    moved = lay.to(torch.device("meta"))
    got = moved.packed_segments()
    assert got.cu_seqlens.is_meta and got.owned.is_meta and got.max_len == 32
    assert got.n_rows == 96


def _stand_in_varlen(params: frozenset, calls: list):
    """A CPU stand-in for torch's varlen_attn whose keywords are `params` (torch 2.11+'s
    scale / window_size / enable_gqa, or 2.10's is_causal alone): each cu_seqlens segment
    attends over its own rows, window_size (left, right) read as flash reads it (key j of query
    i when i - left <= j <= i + right, -1 unbounded; is_causal: (-1, 0)), enable_gqa as SDPA's,
    in float64. Records each call's keywords."""
    import torch.nn.functional as F

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        assert set(kw) <= params, kw
        calls.append(kw)
        cuts = cu_q.tolist()
        assert torch.equal(cu_q, cu_k) and max_q == max_k == max(
            b - a for a, b in zip(cuts, cuts[1:]))
        assert kw.get("enable_gqa") or q.shape[1] == k.shape[1], "GQA heads without enable_gqa"
        left, right = kw.get("window_size", (-1, 0) if kw.get("is_causal") else (-1, -1))
        out = torch.zeros_like(q)
        for a, b in zip(cuts, cuts[1:]):
            i, j = torch.arange(b - a)[:, None], torch.arange(b - a)[None, :]
            vis = ((left < 0) | (j >= i - left)) & ((right < 0) | (j <= i + right))
            o = F.scaled_dot_product_attention(
                *(t[a:b].transpose(0, 1).double() for t in (q, k, v)), attn_mask=vis,
                scale=kw.get("scale"), enable_gqa=bool(kw.get("enable_gqa")))
            out[a:b] = o.transpose(0, 1).to(q.dtype)
        return out
    return varlen_attn


_VARLEN_2_13 = frozenset({"return_aux", "scale", "window_size", "enable_gqa"})
_VARLEN_2_10 = frozenset({"is_causal"})


@pytest.mark.parametrize("params", [_VARLEN_2_13, _VARLEN_2_10], ids=["torch2.11+", "torch2.10"])
@pytest.mark.parametrize("hkv", [4, 2])
def test_flash_varlen_call_is_each_samples_causal_attention(params, hkv, monkeypatch):
    """model/varlen.flash_varlen_attention builds its varlen_attn call for either torch
    signature (the CUDA test runs only the installed one): on a stand-in varlen_attn that
    attends within each cu_seqlens segment, a stream with leading rows, gaps and end padding
    (3 samples; Hq 4 over Hkv 4, and GQA over Hkv 2: enable_gqa, or K/V heads repeated so that
    query head h reads KV head h // 2) gives each sample's causal attention of its own rows
    (float64 on the bf16 inputs, within a bf16 rounding), with the scale passed where the
    signature takes one, and exactly 0 on the rows no sample owns. One call, bf16 in."""
    from rlkernel.model import varlen

    calls: list = []
    monkeypatch.setattr(varlen, "_varlen_attn",
                        lambda: (_stand_in_varlen(params, calls), params))
    lay = _dense_layout([[2, 3, 4, -1, -1], [5, 6, 7, 8, 9], [11, 12, -1, -1, -1]], 14)
    seg = lay.packed_segments()
    assert seg.cu_seqlens.tolist() == [0, 2, 5, 11, 14] and seg.owned is not None
    d, hq = 8, 4
    scale = 0.3 if "scale" in params else d ** -0.5
    g = torch.Generator().manual_seed(hkv)
    q = torch.randn(14, hq, d, generator=g)
    k, v = (torch.randn(14, hkv, d, generator=g) for _ in range(2))
    got = varlen.flash_varlen_attention(q, k, v, seg, scale, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and len(calls) == 1
    assert calls[0].get("window_size", (-1, 0)) == (-1, 0) and calls[0].get("is_causal", True)
    want = torch.zeros(14, hq, d, dtype=torch.float64)
    qb, kb, vb = (t.bfloat16().double() for t in (q, k, v))
    for s in range(lay.q_idx.shape[0]):
        r0, n = int(lay.q_idx[s, 0]), int(lay.kv_len[s])
        ks, vs = (t[r0:r0 + n].repeat_interleave(hq // hkv, dim=1) for t in (kb, vb))
        z = torch.einsum("qhd,khd->hqk", qb[r0:r0 + n], ks) * scale
        z = z.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        want[r0:r0 + n] = torch.einsum("hqk,khd->qhd", torch.softmax(z, -1), vs)
    assert torch.equal(got[~seg.owned], torch.zeros_like(got[~seg.owned]))
    assert (got.double() - want).abs().max().item() <= 2 ** -6


def test_varlen_usable_checks_what_flash_can_take_on_the_host(monkeypatch):
    """model/varlen.usable, with a varlen_attn present and an sm80+ device (both stood in; a
    stand-in for the CUDA tensors: usable reads only is_cuda, shape and device): True for q
    [14, 4, 8] and k [14, 2, 8] in bf16 or fp16 over a layout's 14 rows; False for a CPU
    tensor, no segments, fp32, a head dim not a multiple of 8 or past 256, Hkv not dividing Hq,
    q or k of another row count than the segments', a device before sm80, a torch whose
    varlen_attn takes neither window_size nor is_causal, and a scale other than 1/sqrt(D) where
    it takes no scale (which it then runs)."""
    import types

    from rlkernel.model import varlen

    params = {"v": _VARLEN_2_13}
    capable = {"v": True}
    monkeypatch.setattr(varlen, "_varlen_attn", lambda: (None, params["v"]))
    monkeypatch.setattr(varlen, "_flash_capable", lambda device: capable["v"])
    seg = _dense_layout([[2, 3, 4, -1, -1], [5, 6, 7, 8, 9], [11, 12, -1, -1, -1]],
                        14).packed_segments()

    def t(rows, heads, d=8):
        return types.SimpleNamespace(is_cuda=True, shape=(rows, heads, d), device="cuda:0")

    def usable(q=None, k=None, s=seg, scale=0.3, dtype=torch.bfloat16):
        return varlen.usable(t(14, 4) if q is None else q, t(14, 2) if k is None else k, s,
                             scale, dtype)

    assert usable() and usable(dtype=torch.float16) and usable(t(14, 4, 256), t(14, 2, 256))
    assert not usable(torch.zeros(14, 4, 8), torch.zeros(14, 2, 8))
    assert not usable(s=None) and not usable(dtype=torch.float32)
    assert not usable(t(14, 4, 12), t(14, 2, 12)) and not usable(t(14, 4, 264), t(14, 2, 264))
    assert not usable(k=t(14, 3))
    assert not usable(q=t(13, 4)) and not usable(k=t(16, 2))
    capable["v"] = False
    assert not usable()
    capable["v"] = True
    params["v"] = frozenset({"scale", "enable_gqa"})
    assert not usable()
    params["v"] = _VARLEN_2_10
    assert not usable() and usable(scale=8 ** -0.5)


def test_native_packed_attention_falls_back_with_the_layouts_causality(monkeypatch):
    """Where flash varlen cannot run (here: the CPU), NativeOps.attention_packed is the gather
    path the model takes with packed_attention off, dense_causal included: SDPA's is_causal
    (its flash kernel on CUDA) for a dense causal layout, the explicit mask otherwise. (On the
    CPU both give the same bits, so the bitwise tests above cannot tell.)"""
    from rlkernel.distributed.parallel import ParallelCtx

    seen, real = [], NativeOps.attention

    def spied(*a, **kw):
        seen.append(a[8])
        return real(*a, **kw)
    monkeypatch.setattr(NativeOps, "attention", staticmethod(spied))
    for dense in (True, False):
        d = _dense_layout([[2, 3, 4, -1, -1], [5, 6, 7, 8, 9]], 12)
        lay = StreamLayout(d.tokens, d.positions, d.q_idx, d.q_pos, d.kv_len,
                           dense_causal=dense)
        q, k, v = (torch.randn(12, 2, 8) for _ in range(3))
        NativeOps.attention_packed(q, k, v, lay.packed_rows(), lay.q_pos, lay.kv_len, 8 ** -0.5,
                                   ParallelCtx.single(), lay.attention_bounds(), lay=lay)
    assert seen == [True, False]
