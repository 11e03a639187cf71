"""The fused dW kernel (rlkernel/kernels/triton_grad_weight.py) on the GPU, bf16 (tensor cores)
and fp32 operands.

Bitwise: its accumulator == the reference path's (per-leaf partials from the `bmm` kernel of
kernels/triton_matmul.py, added by the fixed-point accumulate kernel) on model-like shapes, with
every tile forced through the EMIT path, other tiles, a planted element whose two inexact
adds send its tile to the retry (checked lo word) and one whose partials only the EMIT path can
hold, and gradient-like operands that the one-slot first pass covers almost everywhere; a stream cut at any leaf boundary into two calls
(microbatches, CP ranks) adds up to the one-call accumulator. Against float64: the rounded dW
within (TOKEN_LEAF + 1)·2**-24·Σ|terms| of dYᵀ·X computed in float64 from the same bf16 operands.
Negative control: cuBLAS (torch.matmul) dW of the two halves, added, differs from the whole.
Direct rounding: `rounded_grad_weight` (the double words rounded by round_double_words) ==
round_fp32 of the accumulator, bytewise, or None when a tile is flagged; and kernels/matmul.py
`grad_weight` in a one-rank direct sink, which takes that path chunk by chunk, == the same sink
with the hook off (digits) == a persistent sink, bytewise, including a chunk with a flagged
tile (digits for it alone).
Skipped without CUDA. Run on the GPU machine:
    PYTHONPATH=. python3 -m pytest -q tests/test_cuda_grad_weight.py
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():   # before the Triton modules: CPU installs have no triton
    pytest.skip("needs a CUDA device", allow_module_level=True)

from rlkernel.distributed import tokensum  # noqa: E402
from rlkernel.distributed.comm import Comm  # noqa: E402
from rlkernel.kernels import matmul as mm  # noqa: E402
from rlkernel.kernels import triton_grad_weight as tgw  # noqa: E402
from rlkernel.kernels import triton_matmul as tmm  # noqa: E402
from rlkernel.numerics import fixedpoint as fx  # noqa: E402
from rlkernel.numerics import triton_fixedpoint as tfx  # noqa: E402
from rlkernel.spec import CUDA_TOKEN_LEAF as TOKEN_LEAF  # noqa: E402  (the kernel's leaf)

DEV = "cuda"


def _operands(tokens: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    """dy [T, N], x [T, K]: gradients whose scale varies by token (as a loss's do), activations."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    scale = torch.exp2(torch.randint(-12, 3, (tokens, 1), generator=g, device=DEV).float())
    dy = torch.randn(tokens, n, generator=g, device=DEV) * scale
    x = torch.randn(tokens, k, generator=g, device=DEV)
    return dy.to(dtype), x.to(dtype)


def _reference(dy, x, acc0=None):
    acc = fx.zeros((dy.shape[1], x.shape[1]), DEV) if acc0 is None else acc0.clone()
    parts = tmm.token_leaf_partials(dy, x, dy.shape[0] // TOKEN_LEAF)
    return tfx.accumulate_(acc.view(-1, fx.N_COLS), parts.view(parts.shape[0], -1)).view(acc.shape)


def _fused(dy, x, acc0=None, **kw):
    acc = fx.zeros((dy.shape[1], x.shape[1]), DEV) if acc0 is None else acc0.clone()
    return tgw.accumulate_grad_weight_(acc, dy, x, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,n,k", [(1024, 1024, 3072), (512, 2048, 1024), (384, 200, 130)])
def test_fused_accumulator_is_the_reference_bytes(dtype, tokens, n, k):
    dy, x = _operands(tokens, n, k, dtype)
    want = _reference(dy, x)
    got, redone = _fused(dy, x)
    assert torch.equal(got, want), int((got != want).any(-1).sum())
    assert redone == 0
    forced, redone = _fused(dy, x, force_flag=True)
    assert torch.equal(forced, want) and redone > 0


def _count_retries(monkeypatch) -> list[int]:
    """Tiles flagged by the first pass of each launch (then retried with the checked lo word)."""
    seen: list[int] = []
    real = tgw._retry_flagged

    def spy(a, b, words, flags, *rest):
        seen.append(int(flags.sum()))
        return real(a, b, words, flags, *rest)
    monkeypatch.setattr(tgw, "_retry_flagged", spy)
    return seen


def test_gradient_like_operands_are_rarely_retried(monkeypatch):
    """With a loss's gradients (scales 2**-12 .. 2**2 by token) against activations, at most 1 %
    of the tiles meet two inexact adds in one element (the one-slot pass is the common path)."""
    seen = _count_retries(monkeypatch)
    dy, x = _operands(4096, 1024, 1024, torch.bfloat16, seed=5)
    got, redone = _fused(dy, x)
    tiles = (1024 // tgw.TILE[0]) * (1024 // tgw.TILE[1])
    assert redone == 0 and sum(seen) <= tiles // 100, (seen, tiles)
    assert torch.equal(got, _reference(dy, x))


def test_two_inexact_adds_in_one_element_are_retried_exactly(monkeypatch):
    """Element (3, 7)'s leaf partials 1, 2**-80, 2**-81 (bf16 operands): two inexact adds, which
    the one error slot cannot hold, so its tile is retried with the checked lo word — not sent
    to the EMIT path — and the bytes are the reference's (a kernel that kept only one error would
    lose 2**-81 and round differently: the exact sum 1 + 3·2**-81 rounds to 1.0 either way, so
    the accumulator is compared, not the fp32 gradient)."""
    seen = _count_retries(monkeypatch)
    dy, x = _operands(3 * TOKEN_LEAF, 300, 200, torch.bfloat16, seed=2)
    dy[:, 3] = 0
    x[:, 7] = 0
    for leaf, v in enumerate([1.0, 2.0**-80, 2.0**-81]):
        t = leaf * TOKEN_LEAF
        x[t] = 0
        dy[t, 3] = v
        x[t, 7] = 1.0
    got, redone = _fused(dy, x)
    assert redone == 0 and seen == [1], seen
    assert torch.equal(got, _reference(dy, x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tiles_never_change_bytes(dtype):
    dy, x = _operands(512, 512, 768, dtype, seed=1)
    want = _fused(dy, x)[0]
    for tile in ((64, 128, 4, 3), (128, 64, 8, 3), (64, 64, 8, 2)):
        assert torch.equal(_fused(dy, x, tile=tile)[0], want), tile


@pytest.mark.parametrize("tokens,n,k", [(1024, 1024, 3072), (512, 200, 136), (256, 2048, 8)])
def test_tma_fetches_equal_pointer_loads(monkeypatch, tokens, n, k):
    """bf16 operands with 16-byte aligned rows go through TMA descriptors by default (edge
    tiles at 200 rows, a 8-column operand narrower than the tile) and give the pointer loads'
    bytes, first pass and forced retry/EMIT alike, and the direct rounding's."""
    seen = []
    real = tgw._descriptors

    def spy(a, b, tile, use_tma):
        out = real(a, b, tile, use_tma)
        seen.append(out[2])
        return out
    monkeypatch.setattr(tgw, "_descriptors", spy)
    dy, x = _operands(tokens, n, k, torch.bfloat16, seed=3)
    for force in (False, True):
        seen.clear()
        got = _fused(dy, x, force_flag=force)[0]
        assert seen and all(seen), seen
        seen.clear()
        assert torch.equal(got, _fused(dy, x, force_flag=force, use_tma=False)[0])
        assert seen and not any(seen), seen
    want = fx.round_fp32(_fused(dy, x)[0]).view(torch.int32)
    assert torch.equal(tgw.rounded_grad_weight(dy, x).view(torch.int32), want)
    assert torch.equal(tgw.rounded_grad_weight(dy, x, use_tma=False).view(torch.int32), want)


def _plant_extreme(dy, x) -> None:
    """Element (3, 7)'s leaf partials become 2**100, 1.5·2**46, 2**-100 (one token per leaf
    against a 1, in place): no double word holds their sum, so its tile is flagged."""
    dy[:, 3] = 0
    x[:, 7] = 0
    for leaf, v in enumerate([2.0**100, 1.5 * 2.0**46, 2.0**-100]):
        t = leaf * TOKEN_LEAF
        x[t] = 0            # so row 3's other elements get plain partials
        dy[t, 3] = v
        x[t, 7] = 1.0


def test_planted_extreme_element_is_redone_exactly():
    """Element (3, 7)'s leaf partials 2**100, 1.5·2**46, 2**-100 (bf16 operands, one token per
    leaf): only the EMIT path can hold them; exactly its tile is redone, bytes == reference."""
    dy, x = _operands(3 * TOKEN_LEAF, 300, 200, torch.bfloat16, seed=2)
    _plant_extreme(dy, x)
    got, redone = _fused(dy, x)
    assert redone == 1
    assert torch.equal(got, _reference(dy, x))


def test_split_stream_adds_up_to_one_call_and_cublas_does_not():
    """Tokens [0, a) then [a, T) into one accumulator == all T at once (a at a leaf boundary: a
    microbatch or CP cut), rounded bytes included. Control: cuBLAS dYᵀ·X in fp32 of the halves,
    added, differs from the whole."""
    dy, x = _operands(1024, 1024, 1024, torch.bfloat16, seed=3)
    whole = _fused(dy, x)[0]
    for cut in (TOKEN_LEAF, 384, 512):
        acc = _fused(dy[:cut], x[:cut])[0]
        acc = _fused(dy[cut:], x[cut:], acc0=acc)[0]
        assert torch.equal(fx.round_fp32(acc).view(torch.int32),
                           fx.round_fp32(whole).view(torch.int32)), cut
    a, b = dy.float(), x.float()
    halves = a[:512].t() @ b[:512] + a[512:].t() @ b[512:]
    assert not torch.equal(halves, a.t() @ b), "control: cuBLAS halves matched the whole"


def test_rounded_dw_is_within_float64_bound():
    dy, x = _operands(512, 256, 384, torch.bfloat16, seed=4)
    got = fx.round_fp32(_fused(dy, x)[0]).double()
    a, b = dy.double(), x.double()
    ref = a.t() @ b
    # each leaf partial is an fp32 sum of TOKEN_LEAF exact products (<= TOKEN_LEAF roundings),
    # then one rounding of the exact sum of partials
    bound = (TOKEN_LEAF + 1) * 2.0**-24 * (a.abs().t() @ b.abs())
    assert ((got - ref).abs() <= bound).all()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,n,k", [(1024, 1024, 3072), (512, 2048, 1024), (384, 200, 130)])
def test_rounded_grad_weight_is_the_digit_path_rounding(dtype, tokens, n, k):
    """rounded_grad_weight(dy, x) == round_fp32(accumulate_grad_weight_(zeros, dy, x)), bytewise;
    with every tile forced through the flag: None (the caller's digit path)."""
    dy, x = _operands(tokens, n, k, dtype, seed=5)
    want = fx.round_fp32(_fused(dy, x)[0])
    got = tgw.rounded_grad_weight(dy, x)
    assert got is not None and torch.equal(_bits(got), _bits(want)), \
        int((_bits(got) != _bits(want)).sum())
    assert tgw.rounded_grad_weight(dy, x, force_flag=True) is None


def _sink_grad(dy, x, direct: bool) -> torch.Tensor:
    """w's gradient through kernels/matmul.py grad_weight in a one-rank sink (direct or
    persistent), finished."""
    w = torch.nn.Parameter(torch.zeros(dy.shape[1], x.shape[1], device=DEV))
    sink = tokensum.GradSink.single()
    sink.begin({"w": w}, direct=direct)
    assert mm.grad_weight(dy, x, w, tokensum.TokenSum(Comm.single("tokens"), sink=sink)) is None
    return sink.finish()["w"]


_DEFERRED = tgw.rounded_grad_weight_deferred


def _spied_rounded(monkeypatch) -> list:
    """A fresh spy in place of rounded_grad_weight_deferred (the real one inside; the hook
    kernels/matmul.py hands the sink): records each call of the direct path as (rows, no tile
    still flagged). The spy reads the count (a host sync the sink itself does not take)."""
    calls = []

    def spy(dy, x, **kw):
        out, flagged = _DEFERRED(dy, x, **kw)
        calls.append((dy.shape[1], int(flagged) == 0))
        return out, flagged
    monkeypatch.setattr(tgw, "rounded_grad_weight_deferred", spy)
    return calls


@pytest.mark.parametrize("tokens,n,k,chunk_rows", [(1024, 1024, 3072, 256), (512, 2048, 1024, 700),
                                                   (384, 200, 130, 64)])
def test_direct_grad_weight_words_path_equals_the_digit_path(monkeypatch, tokens, n, k,
                                                             chunk_rows):
    """bf16 operands through kernels/matmul.py grad_weight: a one-rank direct sink
    (DIRECT_CHUNK_ELEMS = chunk_rows·K: several chunks, the last shorter) rounds every chunk
    from the double words (spied: each call returned a gradient), and its bytes == the same
    sink with the hook off (_rounded_rows -> None: digits for every chunk) == a persistent
    sink. With an extreme element planted in row 3 (leaf partials 2**100, 1.5·2**46, 2**-100:
    a flagged tile) the first chunk alone takes the digits — redone by the sink once it reads
    the chunk's flag count behind its CUDA event (GradSink._defer) —, same bytes as the other
    paths."""
    monkeypatch.setattr(tokensum, "DIRECT_CHUNK_ELEMS", chunk_rows * k)
    dy, x = _operands(tokens, n, k, torch.bfloat16, seed=6)
    chunks = -(-n // chunk_rows)
    for plant in (False, True):
        if plant:
            _plant_extreme(dy, x)
        persistent = _sink_grad(dy, x, direct=False)
        calls = _spied_rounded(monkeypatch)
        got = _sink_grad(dy, x, direct=True)
        assert [ok for _, ok in calls] == [not (plant and i == 0) for i in range(chunks)], calls
        with monkeypatch.context() as m:
            m.setattr(mm, "_rounded_rows", lambda dy, x: None)
            digits = _sink_grad(dy, x, direct=True)
        assert torch.equal(_bits(got), _bits(persistent)), int((got != persistent).sum())
        assert torch.equal(_bits(digits), _bits(persistent))


@pytest.mark.parametrize("plant", [False, True])
def test_direct_chunks_over_two_ranks_go_as_words_in_a_late_sink(monkeypatch, plant):
    """bf16 operands through kernels/matmul.py grad_weight on two ranks (replayed one after
    the other: kernel_helpers.run_ranks_sequentially), each with half the tokens, a late
    direct sink over them, DIRECT_CHUNK_ELEMS = 300·K (four chunks of a [1000, K] weight, the
    last shorter): every chunk is summed as the kernel's double words (tokensum.words_finished,
    spied: the rows of each chunk), never by the digits (accumulate_grad_weight_ unused), and
    the gradient == one rank holding every token by the digits, bytewise on both ranks. With
    the extreme element planted in row 3 (a flagged tile on rank 0) the late sink counts it,
    late_flagged says run again on both ranks, and a sink that is not late takes the digits
    for every chunk — the same bytes."""
    from kernel_helpers import run_ranks_sequentially
    tokens, n, k = 1024, 1000, 640
    monkeypatch.setattr(tokensum, "DIRECT_CHUNK_ELEMS", 300 * k)
    dy, x = _operands(tokens, n, k, torch.bfloat16, seed=8)
    if plant:
        _plant_extreme(dy, x)
    whole = _bits(fx.round_fp32(_reference(dy, x)))
    sent, digits = [], []
    real_words, real_digits = tokensum.words_finished, mm.accumulate_grad_weight_

    def spy_words(comm, words, op):
        sent.append(words.shape[1])
        return real_words(comm, words, op)

    def spy_digits(acc, dy, x):
        digits.append(dy.shape[1])
        return real_digits(acc, dy, x)
    monkeypatch.setattr(tokensum, "words_finished", spy_words)
    monkeypatch.setattr(mm, "accumulate_grad_weight_", spy_digits)

    def rank(r, comm, late):
        w = torch.nn.Parameter(torch.zeros(n, k, device=DEV))
        sink = tokensum.GradSink({"dp_cp": comm, "world": comm})
        sink.begin({"w": w}, direct=True, late=late)
        mine = slice(r * tokens // 2, (r + 1) * tokens // 2)
        tok = tokensum.TokenSum(comm, sink=sink)
        assert mm.grad_weight(dy[mine], x[mine], w, tok) is None
        flagged = sink.late_flagged()
        return None if flagged else sink.finish()["w"], flagged
    got = run_ranks_sequentially(2, lambda r, c: rank(r, c, True))
    assert sent == [300, 300, 300, 100] * 4 and digits == []   # 2 passes x 2 ranks x 4 chunks
    assert [f for _, f in got] == [plant, plant]
    if plant:
        sent.clear()
        got = run_ranks_sequentially(2, lambda r, c: rank(r, c, False))
        assert sent == [] and len(digits) == 2 * 2 * 4
    for grad, _ in got:
        assert torch.equal(_bits(grad), whole), int((_bits(grad) != whole).sum())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,n,k,cuts", [(1024, 1024, 3072, (384, 512)),
                                             (768, 200, 136, (128, 256, 640))])
def test_persistent_sink_carries_double_words_over_microbatches(dtype, tokens, n, k, cuts):
    """kernels/matmul.py grad_weight with a persistent one-rank sink, the stream cut into
    microbatches at `cuts`: every call continues the sink's double words (no digit accumulator
    is made), and the finished gradient == one call's digit path rounded, bytewise; with an
    extreme element planted (2**100, 1.5·2**46, 2**-100 in three leaves, which no double word
    holds) the weight moves to digits once that call's flag count is read, same bytes; and through a
    sink whose scope group has a second rank adding nothing (finish adds the words to digits
    before the integer sum)."""
    dy, x = _operands(tokens, n, k, dtype, seed=8)

    class _PairComm:       # a second rank that adds nothing: finish's multi-rank branch
        size = 2

        def sum_ints(self, t, op, *, inplace=False):
            return t

        def sum_ints_finished(self, t, op, finish):
            return finish(t.reshape(-1, t.shape[-1])).reshape(t.shape[:-1])

        def all_gather_object(self, obj, op):     # the other rank holds its sums as this one
            return [obj, obj]

        def finish_words(self, words, op, finish):
            flat = words.reshape(words.shape[0], -1)
            return finish([flat, torch.zeros_like(flat)]).reshape(words.shape[1:])

    for plant, groups in ((False, None), (False, "pair"), (True, None)):   # plant: in place
        if plant:
            _plant_extreme(dy, x)
        want = _bits(fx.round_fp32(_fused(dy, x)[0]))
        w = torch.nn.Parameter(torch.zeros(n, k, device=DEV))
        sink = tokensum.GradSink(
            {"dp_cp": _PairComm(), "world": Comm.single("world")} if groups
            else {s: Comm.single(s) for s in tokensum.SCOPES})
        sink.begin({"w": w})
        tok = tokensum.TokenSum(Comm.single("tokens"), sink=sink)
        bounds = [0, *cuts, tokens]
        for a, b in zip(bounds, bounds[1:]):
            assert mm.grad_weight(dy[a:b], x[a:b], w, tok) is None
        sink._resolve(0)    # the flag counts, left on the device, read (as finish does first)
        assert (list(sink._acc), list(sink._words)) == ((["w"], []) if plant else ([], ["w"]))
        got = _bits(sink.finish()["w"])
        assert torch.equal(got, want), (plant, groups, int((got != want).sum()))


def test_flag_count_slots_are_zeroed_per_mini_batch_and_grow_past_a_buffer(monkeypatch):
    """The sink's flag counters (GradSink.flag_count, SLOT_CHUNK lowered to 2 so that three
    calls span two buffers): mini-batch 1 has the planted extreme element (its tile's count is
    1, the weight moves to digits); mini-batch 2 on the same sink, clean operands, reuses the
    same slots and must stay in words (a slot not zeroed again would carry mini-batch 1's count
    and move it to digits). Both gradients == the one-call digit path, bytewise."""
    monkeypatch.setattr(tokensum, "SLOT_CHUNK", 2)
    n, k, tokens, cuts = 200, 136, 768, (128, 384)
    w = torch.nn.Parameter(torch.zeros(n, k, device=DEV))
    sink = tokensum.GradSink({s: Comm.single(s) for s in tokensum.SCOPES})
    tok = tokensum.TokenSum(Comm.single("tokens"), sink=sink)
    for plant in (True, False):
        dy, x = _operands(tokens, n, k, torch.bfloat16, seed=9)
        if plant:
            _plant_extreme(dy, x)
        want = _bits(fx.round_fp32(_fused(dy, x)[0]))
        sink.begin({"w": w})
        bounds = [0, *cuts, tokens]
        for a, b in zip(bounds, bounds[1:]):
            assert mm.grad_weight(dy[a:b], x[a:b], w, tok) is None
        sink._resolve(0)
        # planted: the second call's count (read at once, the GPU being idle) may send the
        # third call to digits before it takes a slot; clean: three slots over two buffers
        assert sink._next_slot >= 2 if plant else (len(sink._slots), sink._next_slot) == (2, 3)
        assert (list(sink._acc), list(sink._words)) == ((["w"], []) if plant else ([], ["w"]))
        got = _bits(sink.finish()["w"])
        assert torch.equal(got, want), (plant, int((got != want).sum()))
