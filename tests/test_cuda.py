"""CUDA backend: the invariance tests of tests/test_kernels_*.py / tests/test_rollout.py through the
Triton kernels, bytewise, each with a stock-kernel negative control; plus accuracy vs float64.

Equalities are on integer views of the bytes (`_same`): -0.0 vs +0.0 and NaN payloads count.
Chain for the model: (a) matmul / attention / norm / logprobs rows do not depend on the batch,
(b) attention decode == chunked prefill == prefill, (c) fused LM-head logprobs == unfused, hence
(d) a rollout sample's tokens and logprobs are the same alone and in a batch, and the trainer's
recomputed logprobs equal the rollout's.
Skipped without CUDA (CI has no GPU). Run on the GPU machine:
    PYTHONPATH=. python3 -m pytest -q tests/test_cuda.py
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEV = "cuda"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = {4: torch.int32, 2: torch.int16, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).norm() / ref.norm())


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


# ------------------------------------------------------------------------------------- matmul
@pytest.fixture(scope="module")
def tm():
    from rlkernel.kernels import triton_matmul
    return triton_matmul


@pytest.mark.parametrize("dtype,k,n", [(torch.bfloat16, 4096, 4096), (torch.float32, 1024, 1536),
                                       (torch.bfloat16, 1000, 777)])
def test_matmul_row0_identical_at_batch_1_64_257_and_at_offset(tm, dtype, k, n):
    """row 0 of x·wᵀ at M=1 == at M=64 == at M=257 == the same row placed at row 131 of 257."""
    g = _gen(1)
    x = torch.randn(257, k, device=DEV, generator=g).to(dtype)
    w = torch.randn(n, k, device=DEV, generator=g).to(dtype)
    row = tm.linear_nt(x[:1], w)[0]
    for m in (64, 257):
        assert _same(tm.linear_nt(x[:m], w)[0], row), m
    xs = torch.cat([x[1:132], x[:1], x[132:]])
    assert _same(tm.linear_nt(xs, w)[131], row)


def test_negative_control_cublas_bf16_row0_changes_with_batch():
    """control: cuBLAS bf16 (the stock path) changes row 0 for some M in {64, 257, 1024}."""
    g = _gen(2)
    x = torch.randn(1024, 4096, device=DEV, generator=g).bfloat16()
    w = torch.randn(4096, 4096, device=DEV, generator=g).bfloat16()
    row = F.linear(x[:1], w)[0]
    assert any(not _same(F.linear(x[:m], w)[0], row) for m in (64, 257, 1024))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matmul_bits_identical_for_every_tile_of_the_table(tm, dtype):
    """every (BLOCK_M, BLOCK_N, warps, stages) row of the literal table gives the same bytes."""
    g = _gen(3)
    x = torch.randn(300, 2048, device=DEV, generator=g).to(dtype)
    w = torch.randn(640, 2048, device=DEV, generator=g).to(dtype)
    tiles = [cfg for _, cfg in tm._TILES[dtype]]
    base = tm.linear_nt(x, w, tile=tiles[0])
    for cfg in tiles[1:]:
        assert _same(tm.linear_nt(x, w, tile=cfg), base), cfg


def test_matmul_tma_kernel_gives_the_pointer_kernel_bytes(tm):
    """the persistent TMA kernel == the pointer kernel, bytewise, for every TMA tile tried."""
    g = _gen(31)
    x = torch.randn(1030, 4096, device=DEV, generator=g).bfloat16()
    w = torch.randn(1536, 4096, device=DEV, generator=g).bfloat16()
    for out in (torch.bfloat16, torch.float32):     # bf16 linears keep fp32 outputs
        base = tm.matmul(x, w.t(), out_dtype=out)                 # the pointer kernel
        for _, cfg in tm._TMA_TILES if out == torch.bfloat16 else tm._TMA_TILES_F32_OUT:
            for flat in (False, True):
                got = tm.linear_nt_tma(x, w, out_dtype=out, tile=cfg, flatten=flat)
                assert _same(got, base), (cfg, flat, out)
        assert _same(tm.linear_nt(x, w, out_dtype=out), base), out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matmul_columns_identical_when_n_is_split(tm, dtype):
    """x·w[:a]ᵀ and x·w[a:]ᵀ are the column blocks of x·wᵀ, bitwise (N split as TP does)."""
    g = _gen(4)
    x = torch.randn(77, 1536, device=DEV, generator=g).to(dtype)
    w = torch.randn(1000, 1536, device=DEV, generator=g).to(dtype)
    full = tm.linear_nt(x, w)
    for a in (128, 500, 999):
        assert _same(tm.linear_nt(x, w[:a]), full[:, :a])
        assert _same(tm.linear_nt(x, w[a:]), full[:, a:])


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-5)])
def test_matmul_vs_float64(tm, dtype, tol):
    """‖x·wᵀ − float64 reference‖ / ‖ref‖ below tol (fp32 fma chain; bf16 inputs exact products)."""
    g = _gen(5)
    x = torch.randn(129, 3000, device=DEV, generator=g).to(dtype)
    w = torch.randn(257, 3000, device=DEV, generator=g).to(dtype)
    ref = x.double() @ w.double().t()
    assert _rel(tm.linear_nt(x, w), ref) < tol


def test_row_parallel_tree_of_rank_subtrees_equals_tp1_for_1_2_4_8(tm):
    """TP=t ranks each tree their 8/t shard partials of K; the tree over ranks == TP1 bytes."""
    from rlkernel.kernels.matmul import row_parallel_nt, row_parallel_partials
    from rlkernel.numerics.trees import tree_sum
    g = _gen(6)
    x = torch.randn(65, 1024, device=DEV, generator=g)
    w = torch.randn(384, 1024, device=DEV, generator=g)
    full = row_parallel_nt(x, w)
    for t in (1, 2, 4, 8):
        ks = 1024 // t
        locs = [tree_sum(row_parallel_partials(x[:, r * ks:(r + 1) * ks], w[:, r * ks:(r + 1) * ks],
                                               8 // t), 0) for r in range(t)]
        assert _same(tree_sum(torch.stack(locs), 0), full), t
    ref = x.double() @ w.double().t()
    assert _rel(full, ref) < 1e-6


def test_negative_control_cublas_tp_split_of_k_changes_bits():
    """control: summing stock F.linear over 2 K halves differs from one F.linear over K."""
    g = _gen(7)
    x = torch.randn(64, 4096, device=DEV, generator=g)
    w = torch.randn(512, 4096, device=DEV, generator=g)
    split = F.linear(x[:, :2048], w[:, :2048]) + F.linear(x[:, 2048:], w[:, 2048:])
    assert not _same(split, F.linear(x, w))


def test_column_dx_tree_equals_tp_rank_subtrees(tm):
    """column-parallel dX: the virtual-TP tree over N shards == the tree of TP-rank subtrees."""
    from rlkernel.kernels.matmul import column_parallel_dx
    from rlkernel.numerics.trees import tree_sum
    g = _gen(8)
    dy = torch.randn(70, 1024, device=DEV, generator=g)
    w = torch.randn(1024, 512, device=DEV, generator=g)
    full = column_parallel_dx(dy, w)
    for t in (2, 4, 8):
        ns = 1024 // t
        locs = [column_parallel_dx(dy[:, r * ns:(r + 1) * ns], w[r * ns:(r + 1) * ns], 8 // t)
                for r in range(t)]
        assert _same(tree_sum(torch.stack(locs), 0), full), t
    assert _rel(full, dy.double() @ w.double()) < 1e-6


def test_token_dw_equals_cp_ranks_adding_their_leaves_exactly(tm):
    """dW by the exact token sum == each of 2/4/8 ranks accumulating its own leaves, the integer
    accumulators added (any split of whole leaves gives the same bytes)."""
    from rlkernel.kernels.matmul import accumulate_grad_weight_, token_grad_weight
    from rlkernel.numerics import fixedpoint as fx
    g = _gen(9)
    dy = torch.randn(1024, 96, device=DEV, generator=g)
    x = torch.randn(1024, 80, device=DEV, generator=g)
    full = token_grad_weight(dy, x)
    for c in (2, 4, 8):
        per = 1024 // c   # whole CUDA_TOKEN_LEAF leaves (128) per rank
        accs = [accumulate_grad_weight_(fx.zeros((96, 80), DEV), dy[r * per:(r + 1) * per],
                                        x[r * per:(r + 1) * per]) for r in range(c)]
        assert _same(fx.round_fp32(torch.stack(accs).sum(0)), full), c
    assert _rel(full, dy.double().t() @ x.double()) < 1e-6


def test_fixedpoint_on_cuda_equals_cpu_bytes_and_ignores_order():
    """numerics/fixedpoint on CUDA tensors: the accumulator holds the CPU's exact integer and the
    sum rounded once is the CPU's bytes, for rows in any order and for two accumulators added.
    Column j draws its values from binades around 2**(j - 140), so every exponent bin of the
    accumulator decides some column's result (a wrong scale in one bin changes that column:
    torch.ldexp on CUDA did so for 2**54); plus ±0 and an Inf column. Negative control: torch.sum
    on CUDA of the same rows reversed changes bytes."""
    from rlkernel.numerics import fixedpoint as fx
    g = torch.Generator().manual_seed(11)
    cols = 260     # 2**(j - 140): subnormals up to 2**119 (x 8 at most: finite in fp32)
    scale = torch.exp2(torch.arange(cols, dtype=torch.float64) - 140)
    jitter = torch.exp2(torch.randint(-3, 4, (4096, cols), generator=g).double())
    x = (torch.randn(4096, cols, generator=g, dtype=torch.float64) * scale * jitter).float()
    x[:, 0] = 0.0
    x[::2, 1] = -0.0
    x[7, 2] = float("inf")
    want_acc = fx.normalise_(fx.accumulate_(fx.zeros((cols,)), x))
    want = fx.round_fp32(want_acc)
    xc = x.to(DEV)
    got_acc = fx.accumulate_(fx.zeros((cols,), DEV), xc)
    assert torch.equal(fx.normalise_(got_acc).cpu(), want_acc)
    assert _same(fx.round_fp32(got_acc).cpu(), want)
    assert _same(fx.exact_sum_fp32(xc.flip(0)).cpu(), want)
    a = fx.accumulate_(fx.zeros((cols,), DEV), xc[:1000])
    b = fx.accumulate_(fx.zeros((cols,), DEV), xc[1000:])
    assert a.is_cuda and _same(fx.round_fp32(a + b).cpu(), want)
    y = torch.randn(4096, 64, device=DEV, generator=_gen(12))
    assert not _same(y.sum(0), y.flip(0).sum(0))


@pytest.mark.parametrize("k,m", [(16384, 128), (1024, 2048), (1000, 3)])
def test_accumulate_row_parts_equal_the_single_pass(k, m):
    """The norm weights' shapes (few columns, many leaf rows): accumulate_ with its rows cut
    into parts == the single-pass launch (min_programs=0), bitwise, onto a non-zero
    accumulator, with NaN/Inf counts."""
    from rlkernel.numerics import fixedpoint as fx
    from rlkernel.numerics import triton_fixedpoint as tfx
    g = _gen(13)
    x = torch.randn(k, m, device=DEV, generator=g) * torch.exp2(
        torch.randint(-40, 40, (k, 1), device=DEV, generator=g).float())
    x[3, 0], x[9, 1 % m] = float("inf"), float("nan")
    acc0 = tfx.accumulate_(fx.zeros((m,), DEV), torch.randn(5, m, device=DEV, generator=g))
    assert tfx.triton.cdiv(m, tfx.BLOCK) < tfx.MIN_PROGRAMS     # the parts path is taken
    assert torch.equal(tfx.accumulate_(acc0.clone(), x),
                       tfx.accumulate_(acc0.clone(), x, min_programs=0))



def test_accumulate_row_parts_make_no_host_sync():
    """The parts path issues its work without a host sync (torch's sync debug mode raises on
    any: a blocking host-to-device copy made one per call, ~2 ms each in the training step),
    and the negative control shows the mode does catch a sync of that kind."""
    from rlkernel.numerics import fixedpoint as fx
    from rlkernel.numerics import triton_fixedpoint as tfx
    x = torch.randn(16384, 128, device=DEV, generator=_gen(14))
    acc = fx.zeros((128,), DEV)
    tfx.accumulate_(acc, x)                       # compile outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tfx.accumulate_(acc, x)
        with pytest.raises(RuntimeError, match="synchroniz"):
            torch.arange(3, device=DEV)[-1] = 7   # a Python scalar into a 0-dim CUDA view
    finally:
        torch.cuda.set_sync_debug_mode("default")

def _fx_wide(k: int, m: int, seed: int) -> torch.Tensor:
    """fp32 [k, m] on the CPU: randn times 2**[-60, 40) per value, with NaN, ±Inf and subnormal
    values sprinkled over rows 3, 5, 6 and 9."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(k, m, generator=g)
    x *= torch.exp2(torch.randint(-60, 40, (k, m), generator=g, dtype=torch.int32).float())
    x[3, ::9973] = float("nan")
    x[5, ::7919] = float("inf")
    x[6, ::7919] = float("-inf")
    x[9, ::1000] = 1e-45
    return x


def test_fixedpoint_triton_kernel_equals_cpu_torch_path_large():
    """x [64, 1_000_003] (magnitudes 2**-60..2**40, NaN/±Inf/subnormals), then 7 more rows on
    the same accumulator: accumulate_ on CUDA (the Triton kernel) == the CPU torch path, bytewise
    on all int64 columns, and so is the rounded sum. The kernel called directly with other launch
    shapes (BLOCK, warps) and on a column-major copy of x gives the same bytes."""
    from rlkernel.numerics import fixedpoint as fx
    from rlkernel.numerics import triton_fixedpoint as tfx
    m = 1_000_003
    x = _fx_wide(64, m, 13)
    more = -2.0 * x[:7].flip(0)
    want1 = fx.accumulate_(fx.zeros((m,)), x)
    want2 = fx.accumulate_(want1.clone(), more)
    xc = x.to(DEV)
    got = fx.accumulate_(fx.zeros((m,), DEV), xc)
    assert torch.equal(got.cpu(), want1)
    assert torch.equal(fx.accumulate_(got, more.to(DEV)).cpu(), want2)
    assert _same(fx.round_fp32(got).cpu(), fx.round_fp32(want2))
    for block, warps in ((32, 1), (64, 2), (256, 8)):
        acc = tfx.accumulate_(fx.zeros((m,), DEV), xc, block=block, num_warps=warps)
        assert torch.equal(acc.cpu(), want1), (block, warps)
    col_major = xc[:, :200_000].t().contiguous().t()          # strides (1, 64)
    acc = tfx.accumulate_(fx.zeros((200_000,), DEV), col_major)
    assert torch.equal(acc.cpu(), want1[:200_000])           # elements are independent


def test_fixedpoint_segments_on_cuda_equal_cpu_path_and_embedding_grad():
    """accumulate_segments_ on CUDA (one Triton launch) == the CPU torch path bytewise: 300
    segments of 0-40 rows of wide-magnitude values (NaN/±Inf/subnormals) into scattered rows of
    a non-zero accumulator, [*, 257] columns (several column blocks). The embedding gradient
    (sparse leaf partials + segments) on CUDA == on CPU at 2048 tokens, vocab 5000, H 96."""
    from rlkernel.kernels import embedding
    from rlkernel.numerics import fixedpoint as fx
    g = torch.Generator().manual_seed(41)
    lens = torch.randint(0, 41, (300,), generator=g)
    lens[::17] = 0
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    x = _fx_wide(int(offsets[-1]), 257, 42)
    dest = torch.randperm(700, generator=g)[:300]
    start = fx.accumulate_(fx.zeros((700 * 257,)), _fx_wide(10, 700 * 257, 43)).view(700, 257, -1)
    want = fx.accumulate_segments_(start.clone(), x, offsets, dest)
    got = fx.accumulate_segments_(start.to(DEV), x.to(DEV), offsets.to(DEV), dest.to(DEV))
    assert torch.equal(got.cpu(), want)
    ids = torch.randint(0, 5000, (2048,), generator=g)
    ids[::7] = 3                                   # one id in every leaf
    dy = torch.randn(2048, 96, generator=g) * torch.exp2(torch.randint(-20, 20, (2048, 1),
                                                                      generator=g).float())
    want = embedding.embedding_grad(ids, dy, 5000)
    got = embedding.embedding_grad(ids.to(DEV), dy.to(DEV), 5000)
    assert _same(got.cpu(), want)


def test_fixedpoint_triton_kernel_every_bin_and_several_flushes():
    """The kernel == the CPU torch path bytewise for (a) x [64, 260], column j around
    2**(j − 140) (every exponent bin, subnormals, ±0, an Inf), and (b) k = 2·2**13 + 37 rows of
    values at the top of bins 7 and 15 with an odd multiple of the bin unit every 64th row: each
    flush's float64 bin sum sits just below its 2**52-unit exactness bound, over three flushes."""
    from rlkernel.numerics import fixedpoint as fx
    from rlkernel.numerics import triton_fixedpoint as tfx
    g = torch.Generator().manual_seed(14)
    scale = torch.exp2(torch.arange(260, dtype=torch.float64) - 140)
    x = (torch.randn(64, 260, generator=g, dtype=torch.float64) * scale).float()
    x[:, 0], x[::2, 1], x[7, 2] = 0.0, -0.0, float("inf")
    k = 2 * tfx.SEG + 37
    y = _fx_wide(k, 300, 15)
    odd = (torch.arange(k) % 64) == 63
    for c, field, sign in ((0, 127, 1.0), (1, 254, -1.0)):
        top = sign * (2.0 - 2.0**-23) * 2.0 ** (field - 127)
        low = sign * (1.0 + 2.0**-23) * 2.0 ** (field - 15 - 127)
        y[:, c] = torch.where(odd, torch.tensor(low), torch.tensor(top)).float()
    for v in (x, y):
        want = fx.accumulate_(fx.zeros(v.shape[1:]), v)
        got = tfx.accumulate_(fx.zeros(v.shape[1:], DEV), v.to(DEV))
        assert torch.equal(got.cpu(), want)


def test_fixedpoint_round_kernel_equals_cpu_torch_path_on_adversarial_accumulators():
    """fixedpoint.round_fp32 on CUDA (the Triton rounding kernel) == round_fp32_torch on the CPU,
    bytewise, for every case of tests/fixedpoint_round_cases.py (ties with and without sticky
    bits at every rounding position, fp32 range edges and subnormals, random / unnormalised /
    int64-wrapping digits, sums of accumulators, zeros, NaN/±Inf counts, a 20_011-row tail),
    the device input unchanged; also with other launch shapes, a column-major copy, an N-d
    accumulator, and for the sum of two 1_000_003-row accumulators of wide values with NaN/±Inf.
    Negative control: the digits evaluated in float64 and cast (double rounding) differ."""
    from fixedpoint_round_cases import cases

    from rlkernel.numerics import fixedpoint as fx
    from rlkernel.numerics import triton_fixedpoint as tfx
    all_cases = cases()
    for name, acc in all_cases.items():
        want = fx.round_fp32_torch(acc)
        dev = acc.to(DEV)
        before = dev.clone()
        assert _same(fx.round_fp32(dev).cpu(), want), name
        assert torch.equal(dev, before), name
        for block, warps in ((32, 1), (256, 8)):
            got = tfx.round_fp32(dev, block=block, num_warps=warps)
            assert _same(got.cpu(), want), (name, block, warps)
        assert _same(tfx.round_fp32(dev.t().contiguous().t()).cpu(), want), name
    nd = all_cases["large_with_tail"][:20_000].reshape(100, 200, fx.N_COLS)
    assert _same(fx.round_fp32(nd.to(DEV)).cpu(), fx.round_fp32_torch(nd))
    m = 1_000_003
    x = _fx_wide(64, m, 16).to(DEV)
    acc = fx.accumulate_(fx.zeros((m,), DEV), x) + fx.accumulate_(fx.zeros((m,), DEV), -0.5 * x[:9])
    assert _same(fx.round_fp32(acc).cpu(), fx.round_fp32_torch(acc.cpu()))
    ties = all_cases["ties_and_sticky_bits"].to(DEV)
    digits = fx.normalise_(ties.clone())[:, :fx.N_DIGITS].double()
    scale = torch.tensor([2.0 ** (fx.DIGIT_BITS * i - 149) for i in range(fx.N_DIGITS)],
                         dtype=torch.float64, device=DEV)
    assert not _same((digits * scale).sum(1).float(), fx.round_fp32(ties))


def test_round_double_words_kernel_equals_cpu_reference_and_the_digit_kernels():
    """fixedpoint.round_double_words on CUDA (the Triton kernel: TwoSum, round to odd and the
    device's cvt.rn.f32.f64) == round_double_words_torch on the CPU == round_fp32_torch of the
    accumulator holding hi + lo (Python integers), bytewise, for every double-word case of
    tests/fixedpoint_round_cases.py (fp32 ties at every binade, powers of two, subnormal results,
    the fp32 top, zeros, TwoSum accumulations, random words), also at BLOCK 128 with 1 warp;
    and for 2**22 double words made on the GPU by TwoSum accumulation of 32 fp32 values per
    element (a per-element scale 2**[−100, 90], jitter 2**±20, a third cancelling exactly; the
    few whose checks fail dropped) == round_fp32(add_double_words_(zeros, words)) on the
    device. Negative control: the plain cast of hi + lo differs on the ties."""
    import fixedpoint_round_cases as rc

    from rlkernel.numerics import fixedpoint as fx
    from rlkernel.numerics import triton_fixedpoint as tfx
    for name, words in rc.word_cases().items():
        want = fx.round_fp32_torch(rc.word_accumulator(words))
        assert _same(fx.round_double_words_torch(words), want), name
        dev = words.to(DEV)
        assert _same(fx.round_double_words(dev).cpu(), want), name
        assert _same(tfx.round_double_words(dev, block=128, num_warps=1).cpu(), want), name
        if name == "ties":
            assert not _same((dev[0] + dev[1]).float().cpu(), want)
    g, k, m = _gen(17), 32, 1 << 22
    scale = torch.exp2(torch.randint(-100, 91, (1, m), generator=g, device=DEV).double())
    jitter = torch.exp2(torch.randint(-20, 21, (k, m), generator=g, device=DEV).double())
    x = (torch.randn(k, m, generator=g, device=DEV, dtype=torch.float64) * scale * jitter).float()
    x[k // 2:, ::3] = -x[:k // 2, ::3]
    words, ok = rc.two_sum_words(x)
    assert ok.float().mean() > 0.99
    words = words[:, ok].contiguous()
    acc = tfx.add_double_words_(fx.zeros((words.shape[1],), DEV), words)
    assert _same(tfx.round_double_words(words), tfx.round_fp32(acc))


def test_round_words_sum_kernel_equals_the_digit_kernels_and_the_cpu_path():
    """triton_fixedpoint.round_words_sum on CUDA (P ranks' double words summed with the digits
    in registers, rounded once) == round_fp32 of P add_double_words_ passes' digits on the
    device == tokensum's CPU path (digits by the torch add_double_words_, round_fp32_torch),
    bytewise, for P = 2, 3 and 4 parts of 2**21 double words made on the GPU by TwoSum
    accumulation (per-element scales 2**[−100, 90], a third of the parts cancelling another
    part exactly: zero sums) and for the double-word hazard cases with hi on one part and lo
    on the other (fp32 ties decided by lo across the ranks); the
    CUDA _round_words_sum (the sink's) takes the kernel. Control: a float64 sum of the parts
    rounds a planted element (1 + 2**-24 on one part, 2**-100 on another) to 1.0,
    the exact sum to 1 + 2**-23. (On an H100 the random elements alone rounded alike: the
    control needs a planted tie.)"""
    import fixedpoint_round_cases as rc

    from rlkernel.distributed import tokensum
    from rlkernel.numerics import fixedpoint as fx
    from rlkernel.numerics import triton_fixedpoint as tfx
    g, m = _gen(23), 1 << 21
    for p in (2, 3, 4):
        scale = torch.exp2(torch.randint(-100, 91, (1, m), generator=g, device=DEV).double())
        x = (torch.randn(p, 8, m, generator=g, device=DEV, dtype=torch.float64) * scale).float()
        x[p - 1, :, ::3] = -x[0, :, ::3]
        parts = []
        for r in range(p):
            words, ok = rc.two_sum_words(x[r])
            parts.append(torch.where(ok, words, 0.0))
        parts[0][:, 7] = torch.tensor([1.0 + 2.0**-24, 0.0], dtype=torch.float64)
        for i, w in enumerate(parts[1:]):     # a tie in float64 only: the exact sum is above it
            w[:, 7] = torch.tensor([2.0**-100 if i == 0 else 0.0, 0.0], dtype=torch.float64)
        acc = fx.zeros((m,), DEV)
        for w in parts:
            tfx.add_double_words_(acc, w)
        want = tfx.round_fp32(acc)
        assert _same(tfx.round_words_sum(torch.stack(parts)), want), p
        assert _same(tokensum._round_words_sum(parts), want), p
        cpu = tokensum._round_words_sum([w[:, :1 << 16].cpu() for w in parts])
        assert _same(cpu, want[:1 << 16].cpu()), p
        plain = sum(w[0] + w[1] for w in parts).float()
        assert plain[7].item() == 1.0 and want[7].item() == 1.0 + 2.0**-23, p
    for name, words in rc.word_cases().items():
        dev = words.to(DEV)                   # hi on one rank, lo on the other: (hi, 0), (0, lo)
        pair = [torch.stack([dev[0], torch.zeros_like(dev[0])]),
                torch.stack([torch.zeros_like(dev[1]), dev[1]])]
        acc = fx.zeros((words.shape[1],), DEV)
        for w in pair:
            tfx.add_double_words_(acc, w.contiguous())
        assert _same(tfx.round_words_sum(torch.stack(pair)), tfx.round_fp32(acc)), name


# ---------------------------------------------------------------------------------- attention
def _attn_inputs(dtype, s_=3, hq=8, hkv=2, t=300, d=128, seed=10):
    g = _gen(seed)
    q = torch.randn(s_, hq, t, d, device=DEV, generator=g).to(dtype)
    k = torch.randn(s_, hkv, t, d, device=DEV, generator=g).to(dtype)
    v = torch.randn(s_, hkv, t, d, device=DEV, generator=g).to(dtype)
    return q, k, v


def _pos(s_, t, start=0):
    return torch.arange(start, start + t, device=DEV).repeat(s_, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_prefill_equals_chunked_prefill_equals_decode(dtype):
    """decode (one query at a time, NaN in cache slots past kv_len) == chunked prefill == prefill."""
    from rlkernel.kernels.triton_attention import attention_forward
    q, k, v = _attn_inputs(dtype)
    s_, _, t, d = q.shape
    sc = 1 / math.sqrt(d)
    lens = torch.full((s_,), t, device=DEV)
    full, lse = attention_forward(q, k, v, _pos(s_, t), lens, sc)
    kc, vc = k.clone(), v.clone()
    for p in (0, 1, 63, 64, 65, 200, 299):
        kc[:, :, p + 1:] = float("nan")
        vc[:, :, p + 1:] = float("nan")
        kc[:, :, :p + 1], vc[:, :, :p + 1] = k[:, :, :p + 1], v[:, :, :p + 1]
        o, l = attention_forward(q[:, :, p:p + 1], kc, vc, _pos(s_, 1, p),
                                 torch.full((s_,), p + 1, device=DEV), sc)
        assert _same(o[:, :, 0], full[:, :, p]), p
        assert _same(l[..., 0], lse[..., p]), p
    for a, b in ((0, 100), (100, 137), (137, 300)):
        o, _ = attention_forward(q[:, :, a:b], k, v, _pos(s_, b - a, a),
                                 torch.full((s_,), b, device=DEV), sc)
        assert _same(o, full[:, :, a:b]), (a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_bits_identical_for_every_tile_of_the_table(dtype):
    """every row tile (BLOCK_M, warps, stages) of the literal table gives the same bytes."""
    from rlkernel.kernels import triton_attention as ta
    q, k, v = _attn_inputs(dtype, seed=11)
    s_, _, t, d = q.shape
    outs = [ta.attention_forward(q, k, v, _pos(s_, t), torch.full((s_,), t, device=DEV),
                                 1 / math.sqrt(d), tile=cfg)[0] for _, cfg in ta._TILES[dtype]]
    assert all(_same(o, outs[0]) for o in outs[1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_sample_alone_equals_sample_in_batch_with_other_lengths(dtype):
    """sample 0 alone == sample 0 in a padded batch whose other samples are longer/shorter."""
    from rlkernel.kernels.triton_attention import attention_forward
    q, k, v = _attn_inputs(dtype, s_=4, seed=12)
    s_, _, t, d = q.shape
    sc = 1 / math.sqrt(d)
    pos = _pos(s_, t)
    pos[0, 180:] = -1
    pos[2, 50:] = -1
    lens = torch.tensor([180, t, 50, t], device=DEV)
    batch, _ = attention_forward(q, k, v, pos, lens, sc)
    alone, _ = attention_forward(q[:1, :, :180], k[:1, :, :180], v[:1, :, :180],
                                 pos[:1, :180], lens[:1], sc)
    assert _same(batch[:1, :, :180], alone)
    assert torch.count_nonzero(batch[0, :, 180:]) == 0


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_attention_vs_float64(dtype, tol):
    """out and lse vs a float64 softmax attention with the same causal/kv_len masks."""
    from rlkernel.kernels.triton_attention import attention_forward
    q, k, v = _attn_inputs(dtype, s_=2, t=200, seed=13)
    s_, hq, t, d = q.shape
    g = hq // k.shape[1]
    sc = 1 / math.sqrt(d)
    out, lse = attention_forward(q, k, v, _pos(s_, t), torch.full((s_,), t, device=DEV), sc)
    kk = k.double().repeat_interleave(g, 1)
    vv = v.double().repeat_interleave(g, 1)
    s = (q.double() @ kk.transpose(-1, -2)) * sc
    s = s.masked_fill(torch.ones(t, t, device=DEV, dtype=torch.bool).triu(1), float("-inf"))
    assert _rel(out, torch.softmax(s, -1) @ vv) < tol
    ref_lse = torch.logsumexp(s, -1).reshape(s_, k.shape[1], g, t)
    assert _rel(lse, ref_lse) < tol


def test_negative_control_sdpa_decode_differs_from_prefill():
    """control: stock SDPA (flash, bf16) gives different bytes for decode vs causal prefill."""
    q, k, v = _attn_inputs(torch.bfloat16, s_=4, hq=8, hkv=8, t=512, seed=14)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    diff = 0
    for p in (100, 300, 511):
        o = F.scaled_dot_product_attention(q[:, :, p:p + 1], k[:, :, :p + 1], v[:, :, :p + 1])
        diff += int(not _same(o[:, :, 0], full[:, :, p]))
    assert diff > 0


def test_attention_autograd_through_cuda_forward_matches_float64():
    """the public attention() runs the Triton forward and the Triton backward on CUDA."""
    from rlkernel.kernels.attention import attention
    g = _gen(15)
    s_, hq, hkv, t, d = 2, 4, 2, 128, 16
    q = torch.randn(s_, hq, t, d, device=DEV, generator=g, requires_grad=True)
    k = torch.randn(s_, hkv, t, d, device=DEV, generator=g, requires_grad=True)
    v = torch.randn(s_, hkv, t, d, device=DEV, generator=g, requires_grad=True)
    out = attention(q, k, v, _pos(s_, t), torch.full((s_,), t, device=DEV), 1 / math.sqrt(d))
    dout = torch.randn(out.shape, device=DEV, generator=g)
    out.backward(dout)
    qd, kd, vd = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    mask = torch.ones(t, t, device=DEV, dtype=torch.bool).triu(1)
    s = (qd @ kd.repeat_interleave(2, 1).transpose(-1, -2)) / math.sqrt(d)
    ref = torch.softmax(s.masked_fill(mask, float("-inf")), -1) @ vd.repeat_interleave(2, 1)
    ref.backward(dout.double())
    assert _rel(out.detach(), ref.detach()) < 1e-5
    for a, b in ((q, qd), (k, kd), (v, vd)):
        assert _rel(a.grad, b.grad) < 1e-4


# ---------------------------------------------------------------------------------- rms norm
def test_rms_norm_row_alone_equals_row_in_batch_and_vs_float64():
    """RMSNorm row at batch 1 == the same row at row 77 of 300; per-head [L, heads, D] too."""
    from rlkernel.kernels.norm import rms_norm
    g = _gen(16)
    w = torch.randn(1024, device=DEV, generator=g)
    x = torch.randn(300, 1024, device=DEV, generator=g)
    y = rms_norm(x, w, 1e-6)
    assert _same(rms_norm(x[77:78], w, 1e-6)[0], y[77])
    xd = x.double()
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert _rel(y, ref) < 1e-6
    xh = torch.randn(50, 16, 128, device=DEV, generator=g)
    wh = torch.randn(128, device=DEV, generator=g)
    yh = rms_norm(xh, wh, 1e-6)
    assert _same(rms_norm(xh[3:4, 5:6], wh, 1e-6)[0, 0], yh[3, 5])


def test_rms_norm_inference_pass_equals_the_autograd_pass():
    """The inference pass (one kernel: weight, and Q/K RoPE) == rms_norm (then apply_rope) with
    autograd on, bitwise: hidden rows and per-head rows at positions to 40k. Control: RoPE
    applied to x̂ before the weight gives other bytes."""
    from rlkernel.kernels.norm import rms_norm, rms_norm_inference
    from rlkernel.kernels.rope import RopeTable, apply_rope
    g = _gen(17)
    w = torch.randn(1024, device=DEV, generator=g, requires_grad=True)
    x = torch.randn(300, 1024, device=DEV, generator=g)
    assert _same(rms_norm_inference(x, w.detach(), 1e-6), rms_norm(x, w, 1e-6).detach())
    pos = torch.randint(0, 40000, (50,), device=DEV, generator=g)
    cos, sin = RopeTable(128, 1e6).lookup(pos, 40000)
    xh = torch.randn(50, 16, 128, device=DEV, generator=g)
    wh = torch.randn(128, device=DEV, generator=g, requires_grad=True)
    want = apply_rope(rms_norm(xh, wh, 1e-6), cos, sin).detach()
    assert _same(rms_norm_inference(xh, wh.detach(), 1e-6, cos, sin), want)
    other = apply_rope(rms_norm_inference(xh, torch.ones_like(wh.detach()), 1e-6), cos, sin)
    assert not _same(other * wh.detach(), want)
    # bf16 output: the kernel's integer rounding == torch's CUDA cast of the fp32 result
    big = x * 1e4
    assert _same(rms_norm_inference(big, w.detach(), 1e-6, out_dtype=torch.bfloat16),
                 rms_norm(big, w, 1e-6).detach().to(torch.bfloat16))
    assert _same(rms_norm_inference(xh, wh.detach(), 1e-6, cos, sin, torch.bfloat16),
                 want.to(torch.bfloat16))


@pytest.mark.parametrize("heads,h", [(1, 2048), (1, 1000), (16, 128)])
def test_rms_norm_training_forward_pass_equals_stats_then_torch_product(heads, h):
    """The training forward in one pass (kernels/triton_norm.rms_forward: r, x̂ and x̂·w) ==
    the statistics kernel then x̂ * w as a torch op on CUDA, bitwise, hidden rows and Q/K heads;
    and kernels/norm.rms_norm (autograd) returns those bytes. Control: x·(r·w) differs."""
    from rlkernel.kernels import norm, triton_norm
    g = _gen(20)
    shape = (4096, heads, h) if heads > 1 else (4096, h)
    x = torch.randn(shape, device=DEV, generator=g) * 3
    x[7] = 0.0
    w = torch.randn(h, device=DEV, generator=g)
    r, xh, y = triton_norm.rms_forward(x, w, 1e-6)
    r2, xh2 = triton_norm.rms_stats(x, 1e-6)
    assert _same(r, r2) and _same(xh, xh2) and _same(y, xh2 * w)
    assert _same(norm.rms_norm(x, w, 1e-6), y)
    assert not _same(x * (r[..., None] * w), y)


@pytest.mark.parametrize("heads,h", [(1, 2048), (1, 1000), (16, 128), (8, 128)])
def test_rms_norm_backward_kernel_equals_the_torch_ops(heads, h):
    """The one-pass backward (kernels/triton_norm.rms_backward) == kernels/norm.py's torch ops
    on CUDA, bitwise: dx and the per-leaf dW partials, hidden rows and Q/K heads, 4,096 tokens
    with zero and -0.0 rows. Control: at H = 1000 the tree's `/ H` as a true division (a CUDA
    tensor divisor) gives other dx bytes than PyTorch's reciprocal multiply, which both paths
    use."""
    from rlkernel.kernels import norm, triton_norm
    from rlkernel.numerics.trees import tree_sum
    from rlkernel.spec import TOKEN_LEAF
    g = _gen(18)
    shape = (4096, heads, h) if heads > 1 else (4096, h)
    x = torch.randn(shape, device=DEV, generator=g) * 3
    r, xh = triton_norm.rms_stats(x, 1e-6)
    dy = torch.randn(shape, device=DEV, generator=g)
    dy[5], dy[6] = 0.0, -0.0
    w = torch.randn(h, device=DEV, generator=g)
    dx, part = triton_norm.rms_backward(dy, xh, r, w, TOKEN_LEAF, True)
    want_dx, want_part = norm._backward_rows_torch(dy, xh, r, w, True)
    assert _same(dx, want_dx) and _same(part, want_part)
    assert _same(norm._backward_rows(dy, xh, r, w, True)[1], part)     # the dispatch
    if h == 1000:
        gw = dy * w
        q = tree_sum(gw * xh, -1) / torch.tensor(float(h), device=DEV)
        assert not _same(r[..., None] * (gw - xh * q[..., None]), dx)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_rope_passes_equal_torch_ops_and_autograd(out_dtype):
    """kernels/rope.rope on CUDA (two Triton passes) == apply_rope's torch ops, then
    `.to(out_dtype)`, forward and torch autograd's backward, bitwise, Q/K shapes at positions to
    40k, with ±0.0 gradient rows. bf16: the store's rounding == torch's cast (both to nearest
    even), and the bf16 gradient widened in the kernel == the cast's backward."""
    from rlkernel.kernels.rope import RopeTable, apply_rope, rope
    g = _gen(19)
    for heads, d in ((16, 128), (8, 128), (4, 64)):
        pos = torch.randint(0, 40000, (300,), device=DEV, generator=g)
        cos, sin = RopeTable(d, 1e6).lookup(pos, 40000)
        x = torch.randn(300, heads, d, device=DEV, generator=g)
        dy = torch.randn(300, heads, d, device=DEV, generator=g).to(out_dtype)
        dy[3], dy[4, :, ::2] = 0.0, -0.0
        a, b = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        ya, yb = rope(a, cos, sin, out_dtype), apply_rope(b, cos, sin).to(out_dtype)
        assert ya.grad_fn is not None and "Rope" in type(ya.grad_fn).__name__
        assert ya.dtype == out_dtype
        ya.backward(dy)
        yb.backward(dy)
        assert _same(ya.detach(), yb.detach()) and _same(a.grad, b.grad), (heads, d)


# --------------------------------------------------------------------------------- logprobs
def test_logprobs_row_alone_equals_row_in_batch_and_fused_equals_unfused():
    """token logprobs/entropy: row alone == row in batch; fused LM head == unfused, bitwise;
    log_softmax at the target == token logprob; and vs float64."""
    from rlkernel.kernels.logprobs import (linear_token_logprobs_entropy, log_softmax,
                                           token_logprobs_entropy)
    from rlkernel.kernels.matmul import linear_nt
    g = _gen(17)
    n, h, v = 256, 512, 151936
    x = torch.randn(n, h, device=DEV, generator=g)
    w = torch.randn(v, h, device=DEV, generator=g) * 0.05
    tg = torch.randint(0, v, (n,), device=DEV, generator=g)
    logits = linear_nt(x, w)
    lp, ent = token_logprobs_entropy(logits, tg, 0.8)
    lp1, ent1 = token_logprobs_entropy(linear_nt(x[9:10], w), tg[9:10], 0.8)
    assert _same(lp1[0], lp[9]) and _same(ent1[0], ent[9])
    flp, fent = linear_token_logprobs_entropy(x, w, tg, 0.8)
    assert _same(flp, lp) and _same(fent, ent)
    ls = log_softmax(logits[:5], 0.8)
    assert _same(ls.gather(1, tg[:5, None])[:, 0], lp[:5])
    ref = torch.log_softmax(logits.double() / 0.8, -1)
    assert _rel(lp, ref.gather(1, tg[:, None])[:, 0]) < 1e-6
    assert _rel(ent, -(ref.exp() * ref).sum(-1)) < 1e-5


@pytest.mark.parametrize("shards", [1, 2, 3, 5, 8, 16])
def test_finish_kernel_equals_cpu_torch_path_on_the_same_stats(shards):
    """triton_logprobs.finish_stats on CUDA stats (m, s, t) == the CPU torch path on the same
    stats copied to the CPU (merge_shard_stats, lse = m + log32(s), entropy = lse − t/s:
    logprobs_finish_cases.finish_want), bitwise but for NaN payloads and signs (swiglu_cases
    .same_bits: a GPU's NaN is canonical), on the random and adversarial stats of
    tests/logprobs_finish_cases.py (all-masked rows, ±Inf, NaN, s = 0, huge / subnormal s).
    (Not CUDA log_softmax == CPU log_softmax: the CUDA shard statistics have their own chunk
    order, by design.)"""
    from logprobs_finish_cases import finish_case, finish_want
    from swiglu_cases import same_bits

    from rlkernel.kernels.triton_logprobs import finish_stats
    m, s, t = finish_case(1000, shards, seed=shards, device=DEV)
    for g, w in zip(finish_stats(m, s, t), finish_want(m, s, t), strict=True):
        assert same_bits(g.cpu(), w)


def test_logprobs_call_sites_finish_cuda_stats_as_the_cpu_torch_path():
    """The call sites on CUDA: log_softmax's and token_logprobs_entropy's lse / entropy
    (logprobs._forward_stats) and the fused LM head's logprobs / entropy == the CPU torch path
    (finish_want) on their CUDA shard statistics (triton_logprobs.shard_stats /
    linear_shard_stats) copied to the CPU, bitwise; with a padded vocabulary."""
    from logprobs_finish_cases import finish_want

    from rlkernel.kernels import triton_logprobs
    from rlkernel.kernels.logprobs import (_div_t, _forward_stats, linear_token_logprobs_entropy,
                                           log_softmax)
    from rlkernel.kernels.matmul import linear_nt
    g = _gen(19)
    x = torch.randn(256, 512, device=DEV, generator=g)
    w = torch.randn(8192, 512, device=DEV, generator=g) * 0.05
    tg = torch.randint(0, 8000, (256,), device=DEV, generator=g)
    z = _div_t(linear_nt(x, w), 0.8, 8000)
    lse_want, ent_want = finish_want(*triton_logprobs.shard_stats(z, 1.0, 8)[:3])
    lse, ent = _forward_stats(z, 8)
    assert _same(lse.cpu(), lse_want) and _same(ent.cpu(), ent_want)
    ls = log_softmax(linear_nt(x, w), 0.8, live_vocab=8000)
    assert _same(ls.cpu(), z.cpu() - lse_want[:, None])
    m, s, t, z_y = triton_logprobs.linear_shard_stats(x, w, tg, 0.8, 8, 8000)
    lse_want, ent_want = finish_want(m, s, t)
    lp, ent = linear_token_logprobs_entropy(x, w, tg, 0.8, live_vocab=8000)
    assert _same(lp.cpu(), z_y.cpu() - lse_want) and _same(ent.cpu(), ent_want)


@pytest.mark.parametrize("cd", [torch.float32, torch.bfloat16])
def test_fused_logprobs_gradients_equal_unfused_column_parallel_path(cd):
    """d(logprobs, entropy)/d(h, W) through the fused op == through the LM head + logprobs, in
    fp32 and with the bf16 compute dtype (the fused kernel's tensor-core logits == linear_nt's)."""
    from rlkernel.kernels.logprobs import linear_token_logprobs_entropy, token_logprobs_entropy
    from rlkernel.kernels.matmul import column_parallel_linear
    g = _gen(18)
    x = torch.randn(256, 64, device=DEV, generator=g, requires_grad=True)
    w = (torch.randn(2048, 64, device=DEV, generator=g) * 0.1).bfloat16().float().requires_grad_(True)
    tg = torch.randint(0, 2048, (256,), device=DEV, generator=g)
    lp, ent = linear_token_logprobs_entropy(x, w, tg, 0.7, compute_dtype=cd)
    (lp.sum() + 0.3 * ent.sum()).backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    (logits,) = column_parallel_linear(x, [w], compute_dtype=cd)
    lp2, ent2 = token_logprobs_entropy(logits, tg, 0.7)
    (lp2.sum() + 0.3 * ent2.sum()).backward()
    assert _same(lp, lp2) and _same(ent, ent2) and _same(gx, x.grad) and _same(gw, w.grad)


@pytest.mark.parametrize("which", ["column", "row"])
def test_bf16_linears_batch_invariant_and_within_bf16_of_float64(which):
    """bf16 compute dtype on the tensor cores: forward, dX and dW of 128 rows alone == the same
    rows inside a 1152-row batch (leaf-aligned, so dW sums the same leaves plus others: compared
    through the 128-row run's own dW vs a run on those rows padded with zero rows), bitwise; and
    y within 2·2**-8·Σ|x||w| + 1e-4 of float64 (bf16 operand rounding). Control: cuBLAS bf16
    changes row 0 with the batch (test_negative_control_cublas_bf16_row0_changes_with_batch)."""
    from rlkernel.kernels.matmul import column_parallel_linear, row_parallel_linear
    g = _gen(41)
    x = torch.randn(1152, 512, device=DEV, generator=g)
    w = (torch.randn(384, 512, device=DEV, generator=g) * 0.05).bfloat16().float()
    dy = torch.randn(1152, 384, device=DEV, generator=g)

    def run(xx, dd):
        xx, ww = xx.clone().requires_grad_(), w.clone().requires_grad_()
        y = (column_parallel_linear(xx, [ww], compute_dtype=torch.bfloat16)[0] if which == "column"
             else row_parallel_linear(xx, ww, compute_dtype=torch.bfloat16))
        y.backward(dd)
        return y.detach(), xx.grad, ww.grad

    y, gx, gw = run(x, dy)
    y1, gx1, gw1 = run(x[:128], dy[:128])
    assert _same(y1, y[:128]) and _same(gx1, gx[:128])
    pad = torch.zeros(1024, 512, device=DEV), torch.zeros(1024, 384, device=DEV)
    _, _, gw_pad = run(torch.cat([x[:128], pad[0]]), torch.cat([dy[:128], pad[1]]))
    assert _same(gw1, gw_pad)
    ref = x.double() @ w.double().t()
    bound = 2 * 2.0 ** -8 * (x.double().abs() @ w.double().abs().t()) + 1e-4
    assert bool(((y.double() - ref).abs() <= bound).all())


def test_padded_vocab_fused_equals_unfused_and_masked_rows_get_no_gradient():
    """Qwen3's padded vocabulary (151,936 rows, 151,669 tokenizer ids): fused LM head == unfused
    with live_vocab, forward and d(h, W), bitwise; log_softmax is −inf past live_vocab; W's
    masked rows get exactly 0."""
    from rlkernel.kernels.logprobs import (linear_token_logprobs_entropy, log_softmax,
                                           token_logprobs_entropy)
    from rlkernel.kernels.matmul import column_parallel_linear
    g = _gen(19)
    v, live = 151936, 151669
    x = torch.randn(128, 64, device=DEV, generator=g, requires_grad=True)
    w = (torch.randn(v, 64, device=DEV, generator=g) * 0.1).requires_grad_(True)
    tg = torch.randint(0, live, (128,), device=DEV, generator=g)
    lp, ent = linear_token_logprobs_entropy(x, w, tg, 0.7, live_vocab=live)
    (lp.sum() + 0.3 * ent.sum()).backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    (logits,) = column_parallel_linear(x, [w])
    lp2, ent2 = token_logprobs_entropy(logits, tg, 0.7, live_vocab=live)
    (lp2.sum() + 0.3 * ent2.sum()).backward()
    assert _same(lp, lp2) and _same(ent, ent2) and _same(gx, x.grad) and _same(gw, w.grad)
    assert bool((gw[live:] == 0).all())
    ls = log_softmax(logits.detach()[:4], 0.7, live_vocab=live)
    assert bool((ls[:, live:] == float("-inf")).all())
    assert _same(ls.gather(1, tg[:4, None])[:, 0], lp[:4])


@pytest.mark.parametrize("cd", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("live", [151669, 20000])
def test_vocab_parallel_fused_lm_head_equals_tp1_on_thread_ranks(cd, live):
    """The fused LM head with Qwen3's vocabulary split over TP = 2, 4, 8 thread ranks on one GPU
    (each its slice of W and local shards, the Triton statistics and d-logits kernels on the
    slice, the statistics all-gathered): every rank's logprobs and entropy, the canonical tree
    of the ranks' dh partials and the ranks' dW slices end to end == TP1, bitwise; the live
    bound inside the last rank's slice (151,669) or leaving whole slices dead (20,000).
    Control: the dh partials added left to right (a stock SUM) differ at TP8. (Thread ranks
    work here because the op's backward waits on no other rank; parallel.enter_tp, which does,
    is outside it. CPU: tests/test_kernels_logprobs.py.)"""
    from kernel_helpers import run_ranks

    from rlkernel.kernels.logprobs import linear_token_logprobs_entropy
    from rlkernel.numerics.trees import tree_combine
    g = _gen(23)
    v = 151936
    x0 = torch.randn(128, 64, device=DEV, generator=g)
    w0 = torch.randn(v, 64, device=DEV, generator=g) * 0.1
    tg = torch.randint(0, live, (128,), device=DEV, generator=g)
    a, b = torch.randn(128, device=DEV, generator=g), torch.randn(128, device=DEV, generator=g)

    def run(r, comm, tp):
        x = x0.clone().requires_grad_(True)
        w = w0[r * (v // tp):(r + 1) * (v // tp)].clone().requires_grad_(True)
        lp, ent = linear_token_logprobs_entropy(x, w, tg, 0.7, shards=8 // tp, live_vocab=live,
                                                compute_dtype=cd, vocab_comm=comm)
        ((lp * a).sum() + (ent * b).sum()).backward()
        torch.cuda.synchronize()
        return lp.detach(), ent.detach(), x.grad, w.grad

    want = run(0, None, 1)
    for tp in (2, 4, 8):
        ranks = run_ranks(tp, lambda r, comm: run(r, comm, tp))
        assert all(_same(lp, want[0]) and _same(ent, want[1]) for lp, ent, _, _ in ranks), tp
        assert _same(tree_combine([r[2] for r in ranks]), want[2]), tp
        assert _same(torch.cat([r[3] for r in ranks]), want[3]), tp
        if tp == 8 and live > 100000:
            assert not _same(torch.stack([r[2] for r in ranks]).sum(0), want[2])


# ------------------------------------------------------------------------------- exact norm
def _wide(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    e = torch.randint(0, 255, (n,), generator=g, dtype=torch.int32)
    m = torch.randint(0, 1 << 23, (n,), generator=g, dtype=torch.int32)
    s = torch.randint(0, 2, (n,), generator=g, dtype=torch.int32)
    return ((s << 31) | (e << 23) | m).view(torch.float32)


def test_exact_norm_cuda_equals_cpu_accumulator_under_split_and_permutation():
    """to_tensor() bytes: CUDA == CPU, for any split and permutation, incl. huge/tiny/subnormal."""
    from rlkernel.numerics.exact import ExactSumOfSquares
    g = torch.Generator().manual_seed(19)
    x = torch.cat([torch.randn(3_000_000, generator=g) * 1e-3, _wide(200_000, 20),
                   torch.tensor([3.4e38, 2.0**-149, -1e-45, 0.0, -0.0])])
    cpu = ExactSumOfSquares()
    cpu.add_(x)
    ref = cpu.to_tensor()
    xc = x.to(DEV)
    for cuts, perm_seed in (((), None), ((1, 4096, 999_999), None), ((), 1), ((12345,), 2)):
        y = xc if perm_seed is None else xc[torch.randperm(xc.numel(), generator=torch.Generator()
                                                           .manual_seed(perm_seed)).to(DEV)]
        acc = ExactSumOfSquares()
        prev = 0
        for c in list(cuts) + [y.numel()]:
            acc.add_(y[prev:c])
            prev = c
        assert torch.equal(acc.to_tensor(), ref), (cuts, perm_seed)
    bf = ExactSumOfSquares()
    bf.add_(xc[:100_000].bfloat16())
    bc = ExactSumOfSquares()
    bc.add_(x[:100_000].bfloat16())
    assert torch.equal(bf.to_tensor(), bc.to_tensor())


def test_exact_norm_cuda_reports_nan_and_inf_and_matches_fsum():
    """NaN/±Inf are counted (not dropped) and make the norm NaN; finite data matches math.fsum."""
    from rlkernel.numerics.exact import ExactSumOfSquares
    acc = ExactSumOfSquares()
    x = torch.randn(10_000, device=DEV)
    x[7] = float("nan")
    x[9000] = float("inf")
    x[9001] = float("-inf")
    acc.add_(x, "g")
    assert acc.nonfinite == {"nan": 1, "posinf": 1, "neginf": 1}
    assert acc.nonfinite_names == ["g"] and math.isnan(acc.norm())
    y = torch.randn(100_000, device=DEV) * 3
    ok = ExactSumOfSquares()
    ok.add_(y)
    assert ok.norm() == math.sqrt(math.fsum(v * v for v in y.double().cpu().tolist()))


def test_negative_control_stock_norm_changes_with_split_or_permutation():
    """control: the stock global norm (vector_norm of per-shard vector_norms, as
    clip_grad_norm_ combines tensors) takes more than one value over splits and permutations,
    while the exact norm takes one."""
    from rlkernel.numerics.exact import ExactSumOfSquares
    exact = set()
    x = torch.full((4_000_000,), 1e-2, device=DEV)       # one big value among many small ones:
    x[0] = 100.0                                           # where it meets them decides what is lost
    g = torch.Generator().manual_seed(3)
    vals = set()
    for cuts in ((), (1_000_003,), (17, 2_000_000, 3_999_000), (123_457, 777_777, 2_500_001)):
        for perm in (False, True):
            y = x[torch.randperm(x.numel(), generator=g).to(DEV)] if perm else x
            parts = torch.tensor_split(y, list(cuts))
            n = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p) for p in parts]))
            vals.add(n.view(torch.int32).item())
            acc = ExactSumOfSquares()
            for p in parts:
                acc.add_(p)
            exact.add(acc.norm())
    assert len(vals) > 1 and len(exact) == 1


# ---------------------------------------------------------------------------------- rollout
def _rollout_setup(wide: bool = False):
    from rlkernel.model.checkpoint import init_weights
    from rlkernel.model.config import tiny
    from rlkernel.rollout.engine import Request, SamplingParams
    cfg = tiny()
    if wide:   # real-model widths, where cuBLAS picks other kernels for decode and packed rows
        cfg = cfg.replace(hidden_size=1024, intermediate_size=3072, head_dim=128)
    w = init_weights(cfg, 0)
    sp = SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=24, seed=11, eos_id=256)

    def reqs(n, start):
        g = torch.Generator().manual_seed(start + 1)
        return [Request(start + i, tuple(torch.randint(32, 127, (int(torch.randint(
            3, 30, (1,), generator=g)),), generator=g).tolist())) for i in range(n)]
    return cfg, w, sp, reqs


def _engine(ops, chunk=None, dtype=torch.bfloat16, wide=False):
    from rlkernel.rollout.engine import RolloutEngine
    cfg, w, _, _ = _rollout_setup(wide)
    e = RolloutEngine(cfg, ops, dtype, pad_id=257, prefill_chunk=chunk, device=DEV)
    e.load_weights(w)
    return e


def _bits(c):
    return c.response_ids, c.logprob_tensor().view(torch.int32).tolist()


def _variants(ops):
    _, _, sp, reqs = _rollout_setup()
    target, others = reqs(1, 100)[0], reqs(15, 0)
    eng = _engine(ops)
    return (eng.generate([target], sp)[0], eng.generate([target] + others, sp)[0],
            eng.generate(others[:11] + [target] + others[11:], sp)[11])


def test_rollout_sample_alone_equals_row0_and_row11_of_16_on_cuda():
    """tokens + logprob bits of a sample: alone == row 0 of 16 == row 11 of 16 (invariant ops)."""
    from rlkernel.model.ops import InvariantOps
    alone, row0, row11 = _variants(InvariantOps)
    assert len(alone.response_ids) > 1
    assert _bits(alone) == _bits(row0) == _bits(row11)


def test_rollout_chunked_prefill_identical_on_cuda():
    """whole-prompt prefill == chunked prefill (chunks 1, 5) on CUDA, bitwise."""
    from rlkernel.model.ops import InvariantOps
    _, _, sp, reqs = _rollout_setup()
    r = reqs(6, 40)
    base = [_bits(c) for c in _engine(InvariantOps).generate(r, sp)]
    for chunk in (1, 5):
        assert [_bits(c) for c in _engine(InvariantOps, chunk).generate(r, sp)] == base


def _trainer_bits(ops, comps, dtype=torch.bfloat16, wide=False):
    from rlkernel.model.qwen3 import Qwen3ForCausalLM
    from rlkernel.train.step import TrainSample, trainer_logprobs
    cfg, w, sp, _ = _rollout_setup(wide)
    model = Qwen3ForCausalLM(cfg, ops, dtype).to(DEV)
    model.load_tensors(w)
    samples = [TrainSample(c.sample_id, c.prompt_ids, tuple(c.response_ids), c.logprob_tensor(),
                           0.0) for c in comps]
    return [lp.view(torch.int32).tolist()
            for lp in trainer_logprobs(model, samples, sp.temperature, 257)]


def test_trainer_recompute_equals_rollout_logprobs_on_cuda():
    """trainer logprobs (packed, fused LM head) == rollout logprobs (KV-cache decode), bitwise."""
    from rlkernel.model.ops import InvariantOps
    _, _, sp, reqs = _rollout_setup()
    comps = _engine(InvariantOps).generate(reqs(8, 7), sp)
    assert _trainer_bits(InvariantOps, comps) == [_bits(c)[1] for c in comps]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_negative_control_native_cuda_trainer_differs_from_rollout(dtype):
    """control: stock ops on CUDA (cuBLAS, SDPA; bf16 GEMMs and flash for a bf16 model) —
    trainer logprobs differ from the rollout's. The bf16 case uses real widths (hidden 1024):
    at the tiny model's K = 64 the bf16 output rounding can hide the order differences."""
    from rlkernel.model.ops import InvariantOps, NativeOps
    wide = dtype == torch.bfloat16
    _, _, sp, reqs = _rollout_setup(wide)
    comps = _engine(NativeOps, dtype=dtype, wide=wide).generate(reqs(8, 7), sp)
    assert _trainer_bits(NativeOps, comps, dtype, wide) != [_bits(c)[1] for c in comps]
    if wide:   # the invariant path at the same widths agrees
        comps = _engine(InvariantOps, dtype=dtype, wide=True).generate(reqs(8, 7), sp)
        assert _trainer_bits(InvariantOps, comps, dtype, True) == [_bits(c)[1] for c in comps]
