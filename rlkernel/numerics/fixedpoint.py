"""Exact, order-free elementwise sums of fp32 tensors: fixed-point digits, rounded once.

What it does: `accumulate_` adds fp32 values into an integer accumulator per element that holds
their *exact* mathematical sum; `round_fp32` rounds that sum once (round-half-even) to fp32.
Integer addition is associative, so the result depends only on the multiset of values added —
never on their order, on how they were grouped (microbatches), or on which ranks added which
(accumulators of different ranks are added as integers). This is what makes weight gradients
invariant to DP size, microbatch size, CP/SP layout and packing (DESIGN.md §1: "exact fixed-point
accumulation of per-block partials").

Representation: a finite fp32 x is ±M·2**E' units of 2**-149 (M < 2**24 the significand with its
implicit bit, E' = max(e, 1) − 1 in [0, 253] from the biased exponent field e), an integer below
2**277. It is cut into base-2**31 digits held in int64: M·2**(E' mod 31) (< 2**54) goes to digits
q = E' // 31 and up. N_DIGITS = 10 digits span 310 bits, so a sum of up to 2**33 values of the
largest magnitude still fits. Three more columns count the NaN, +Inf and −Inf values added (the
digits hold the exact sum of the finite ones), so every column is a function of the multiset of
values. An accumulator is
int64 [..., N_COLS], kept carry-normalised by `accumulate_` (`normalise_`); sums of accumulators
(an all-gather + sum across ranks) stay exact.
Adding (`_add_chunk`): values are first summed exactly in float64 per exponent bin (16 exponent
fields per bin: all values of a bin are integer multiples of the bin's smallest ulp below 2**39
ulps, so 2**13 of them add exactly in any order), then each non-empty bin's sum is shifted into
the digits — a few vector ops per value instead of a digit split per value.

Rounding (`round_fp32`; `round_fp32_torch` is its torch path): carry-normalise, take the sign,
find the top non-zero digit, keep the top two digits (a window below 2**62), round the window to
24 significant bits with the digits below as sticky bits, scale. Exact zero gives +0.0 (the sign of a zero sum is not defined by a
multiset); NaN if a NaN or both infinities were added, else ±Inf if one infinity was; a finite
sum beyond the fp32 range rounds to ±Inf as IEEE does.
Double words (`round_double_words`): where a value is already held exactly as a float64 pair
hi + lo (a checked TwoSum accumulation, kernels/triton_grad_weight.py) and no other rank's
integers are to be added, it is rounded straight from the pair (TwoSum, round to odd at 53
bits, then round to nearest at 24: its doc says why that is the direct rounding) — the bytes
`round_fp32` gives for an accumulator holding hi + lo, without the 13 digits.
Prior art: Kulisch's exact (long) accumulator; Demmel–Nguyen's reproducible summation (ReproBLAS)
bins by exponent in the same spirit but is not exact. Written from the definitions above.

CUDA tensors go to Triton kernels (triton_fixedpoint.py): one for `accumulate_` that holds the
bins in registers and gives the same integer (and its segmented form for
`accumulate_segments_`: many row ranges into many accumulator rows, one launch), one for
`round_fp32` and one for `round_double_words` that give the same fp32 bytes in one pass per
element; these torch paths are the references and the CPU backend. `normalise_` has no kernel:
on CUDA only the torch references and tests call it (the kernels carry in registers).
Cost (torch path): ~5 vector ops and one float64 `index_add_` per added value, ~15 per element
and non-empty bin per chunk; memory N_COLS int64 (104 bytes) per accumulated element.
Does not: communicate (callers sum accumulators across ranks).
Tests: `.venv/bin/python -m pytest -q tests/test_fixedpoint.py tests/test_fixedpoint_triton.py`.
"""

from __future__ import annotations

import math

import torch

DIGIT_BITS = 31
N_DIGITS = 10
N_COLS = N_DIGITS + 3
"""Columns of an accumulator: N_DIGITS digits (least significant first), NaN, +Inf, −Inf counts."""
_NAN, _PINF, _NINF = N_DIGITS, N_DIGITS + 1, N_DIGITS + 2
_MASK = (1 << DIGIT_BITS) - 1
_UNIT_EXP = -149
_CHUNK = 1 << 22   # values per vectorised pass: bounds the temporaries
_NORMALISE_EVERY = 1 << 20   # chunks between carry passes: a chunk adds < 2**36 to a digit


def zeros(shape: tuple[int, ...] | torch.Size, device: torch.device | str = "cpu") -> torch.Tensor:
    """An empty accumulator for values of `shape`: int64 [*shape, N_COLS] of zeros."""
    return torch.zeros(*shape, N_COLS, dtype=torch.int64, device=device)


def accumulate_(acc: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """acc += the exact sum of x over dim 0, in place; returns acc.

    acc int64 [*S, N_COLS] (contiguous), x fp32 [n, *S] (bf16/fp16 are converted exactly).
    Raises ValueError on mismatched shapes or a non-int64 accumulator.
    """
    if acc.dtype != torch.int64 or acc.shape[-1] != N_COLS or not acc.is_contiguous():
        raise ValueError(f"accumulate_: accumulator must be contiguous int64 [..., {N_COLS}], got "
                         f"{acc.dtype} {tuple(acc.shape)}")
    if tuple(x.shape[1:]) != tuple(acc.shape[:-1]):
        raise ValueError(f"accumulate_: values {tuple(x.shape)} do not sum to accumulator "
                         f"elements {tuple(acc.shape[:-1])}")
    n = x.shape[0]
    m = acc[..., 0].numel()
    if n == 0 or m == 0:
        return acc
    flat = acc.view(m, N_COLS)
    vals = x.detach().to(torch.float32).reshape(n, m)
    if acc.is_cuda:   # one Triton pass, same integer (tests/test_fixedpoint_triton.py)
        from rlkernel.numerics import triton_fixedpoint
        triton_fixedpoint.accumulate_(flat, vals)
    else:
        accumulate_torch_(flat, vals)
    return acc


def accumulate_torch_(flat: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """The torch path of `accumulate_` on any device: flat [m, N_COLS] += exact Σ of vals [n, m]
    fp32 over dim 0, then normalise. The CPU backend and the reference of the CUDA kernel
    (benchmarks/bench_fixedpoint.py times it on CUDA). Returns flat."""
    n, m = vals.shape
    rows = max(1, min(_BIN_ROWS, _CHUNK // m))
    for i, start in enumerate(range(0, n, rows)):
        if i and i % _NORMALISE_EVERY == 0:
            normalise_(flat)
        _add_chunk(flat, vals[start:start + rows])
    return normalise_(flat)


def accumulate_segments_(acc: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor,
                         dest: torch.Tensor) -> torch.Tensor:
    """acc[dest[g]] += the exact sum of x[offsets[g]:offsets[g + 1]] over dim 0, for every
    segment g, in place; returns acc. One `accumulate_` per segment, in one pass.

    acc int64 [r, *S, N_COLS] (contiguous), x fp32 [n, *S] (bf16/fp16 converted exactly),
    offsets int64 [G + 1] non-decreasing from 0 to n, dest int64 [G] distinct rows of acc.
    A non-empty segment's row leaves normalised (the bytes `accumulate_` gives it); an empty
    segment's row and rows no segment names are untouched. CUDA tensors go to one Triton launch
    (triton_fixedpoint.accumulate_segments_), others to `accumulate_segments_torch_`: the same
    bytes (tests/test_fixedpoint_triton.py). Raises ValueError on mismatched shapes or dtypes and
    on offsets/dest values outside that contract (checked here, at one host sync: the kernel
    would race on a repeated row or read out of bounds).
    """
    if acc.dtype != torch.int64 or acc.dim() < 2 or acc.shape[-1] != N_COLS \
            or not acc.is_contiguous():
        raise ValueError(f"accumulate_segments_: accumulator must be contiguous int64 "
                         f"[r, ..., {N_COLS}], got {acc.dtype} {tuple(acc.shape)}")
    if x.dim() < 1 or tuple(x.shape[1:]) != tuple(acc.shape[1:-1]):
        raise ValueError(f"accumulate_segments_: values {tuple(x.shape)} do not sum to "
                         f"accumulator rows {tuple(acc.shape[1:-1])}")
    g, n, r = dest.numel(), x.shape[0], acc.shape[0]
    if (offsets.dtype != torch.int64 or dest.dtype != torch.int64 or dest.dim() != 1
            or tuple(offsets.shape) != (g + 1,)):
        raise ValueError(f"accumulate_segments_: int64 offsets [G + 1] and dest [G] expected, "
                         f"got {offsets.dtype} {tuple(offsets.shape)} and {dest.dtype} "
                         f"{tuple(dest.shape)}")
    d = dest.sort().values
    bad = torch.stack([offsets[0] != 0, offsets[-1] != n, (offsets.diff() < 0).any(),
                       (d < 0).any() | (d >= r).any(), (d.diff() == 0).any()]).tolist()
    if any(bad):
        raise ValueError(f"accumulate_segments_: offsets must rise from 0 to {n} and dest hold "
                         f"distinct rows in [0, {r}); failed (start, end, order, range, "
                         f"distinct): {bad}")
    m = math.prod(x.shape[1:])
    if g == 0 or n == 0 or m == 0:
        return acc
    rows = acc.view(r, m, N_COLS)
    vals = x.detach().to(torch.float32).reshape(n, m)
    if acc.is_cuda:   # one Triton launch, same integers (tests/test_fixedpoint_triton.py)
        from rlkernel.numerics import triton_fixedpoint
        triton_fixedpoint.accumulate_segments_(rows, vals, offsets.contiguous(),
                                               dest.contiguous())
    else:
        accumulate_segments_torch_(rows, vals, offsets, dest)
    return acc


_SEGMENT_ELEMS = 1 << 18   # accumulator elements a round of the segment torch path gathers


def accumulate_segments_torch_(rows: torch.Tensor, vals: torch.Tensor, offsets: torch.Tensor,
                               dest: torch.Tensor) -> torch.Tensor:
    """The torch path of `accumulate_segments_` on any device (checked arguments): rows
    [r, m, N_COLS] += per segment the exact Σ of its rows of vals [n, m]. The CPU backend and the
    reference of the CUDA kernel. Returns rows.

    Segments sorted by length (longest first) are taken in chunks of at most _SEGMENT_ELEMS
    accumulator elements; round j of a chunk gathers the j-th value of every segment longer than
    j (a prefix of the chunk) and adds it with `accumulate_torch_` (carry-normalising the rows,
    as the kernel does). Temporaries: the chunk's rows (104 bytes per element) and one round's
    working set (`_add_chunk`: ~200 bytes per element), so ~80 MB at most, whatever r, G or n.
    """
    m = vals.shape[1]
    lengths = offsets.diff()
    order = torch.argsort(lengths, descending=True, stable=True)
    lens, starts, dest = lengths[order].tolist(), offsets[:-1][order], dest[order]
    per = max(1, _SEGMENT_ELEMS // m)
    for c0 in range(0, len(lens), per):
        c_lens = lens[c0:c0 + per]
        if c_lens[0] == 0:
            break                                  # the rest are empty: rows untouched
        idx = dest[c0:c0 + per]
        got = rows[idx]                            # [c, m, N_COLS] (a copy)
        live = len(c_lens)
        for j in range(c_lens[0]):
            while c_lens[live - 1] <= j:
                live -= 1                          # segments of length <= j are done
            x = vals[starts[c0:c0 + live] + j]     # [live, m]: value j of each live segment
            accumulate_torch_(got[:live].view(live * m, N_COLS), x.reshape(1, live * m))
        rows[idx] = got
    return rows


_BIN_FIELDS = 16          # fp32 exponent fields per float64 bin
_N_BINS = 256 // _BIN_FIELDS
_BIN_ROWS = 1 << 13       # values per element per bin flush: keeps every bin sum exact


def _add_chunk(flat: torch.Tensor, x: torch.Tensor) -> None:
    """flat [m, N_COLS] += exact Σ over dim 0 of x [k, m] fp32 (k <= _BIN_ROWS).

    Two stages. (1) Each value goes, by its exponent field f, to bin f // 16 of its element, where
    float64 adds it: every value of bin b is an integer multiple of u_b = 2**(max(16b, 1) − 150)
    below 2**39·u_b, so fewer than 2**13 of them sum exactly in float64 (53 bits), in any order.
    (2) Each non-empty bin's exact sum I·u_b (|I| < 2**52) is shifted into the digits. Stage 1 is
    a handful of vector ops per value, stage 2 runs once per element and active bin.
    """
    k, m = x.shape
    bits = x.contiguous().view(torch.int32)
    b = (bits >> (23 + 4)) & (_N_BINS - 1)      # exponent field // 16 (sign bit masked off)
    idx = torch.arange(0, m * _N_BINS, _N_BINS, device=x.device, dtype=torch.int64) + b
    bins = torch.zeros(m * _N_BINS, dtype=torch.float64, device=x.device)
    x64 = x.to(torch.float64)
    bins.index_add_(0, idx.reshape(-1), x64.reshape(-1))
    bins = bins.view(m, _N_BINS)
    active = (bins != 0).any(0).nonzero().flatten().tolist()   # NaN/Inf make bin 15 non-zero
    for j in active:
        s = bins[:, j]
        if j == _N_BINS - 1:   # fields 240..255: the top finite binades, and Inf/NaN (255)
            _count_nonfinite(flat, x)
            s = torch.where((b == j) & torch.isfinite(x), x64, torch.zeros_like(x64)).sum(0)
        unit = max(_BIN_FIELDS * j, 1) - 150     # u_b = 2**unit
        n_int = (s * 2.0 ** -unit).to(torch.int64)   # a power of two: the product is exact
        shift = unit + 149                      # position of u_b in units of 2**-149
        q, r = divmod(shift, DIGIT_BITS)
        sign = torch.where(n_int < 0, -1, 1)
        mag = n_int.abs()                        # < 2**52
        a = (mag & _MASK) << r                   # < 2**61
        c = (mag >> DIGIT_BITS) << r             # < 2**51
        flat[:, q] += (a & _MASK) * sign
        flat[:, q + 1] += ((a >> DIGIT_BITS) + (c & _MASK)) * sign
        flat[:, q + 2] += (c >> DIGIT_BITS) * sign


def add_double_words_(acc: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """acc int64 [m, N_COLS] (contiguous) += words[0] + words[1] exactly, in place; returns acc,
    normalised. words float64 [2, m]: per element a double word (hi, lo) of finite multiples
    of 2**-149 with |hi|, |lo| < 2**150 — what a checked TwoSum accumulation of fp32 values
    leaves (kernels/triton_grad_weight.py); the contract is not checked (a value outside it is
    added wrongly). NaN/Inf counts unchanged. CUDA tensors go to one Triton pass
    (triton_fixedpoint.add_double_words_), others to `add_double_words_torch_`; the same
    integers. Raises ValueError for other dtypes or shapes."""
    m = acc.shape[0] if acc.dim() == 2 else -1
    if acc.dtype != torch.int64 or acc.dim() != 2 or acc.shape[1] != N_COLS \
            or not acc.is_contiguous():
        raise ValueError(f"add_double_words_: contiguous int64 [m, {N_COLS}] accumulator "
                         f"expected, got {acc.dtype} {tuple(acc.shape)}")
    if words.dtype != torch.float64 or tuple(words.shape) != (2, m):
        raise ValueError(f"add_double_words_: float64 [2, {m}] words expected, got "
                         f"{words.dtype} {tuple(words.shape)}")
    if acc.is_cuda:
        from rlkernel.numerics import triton_fixedpoint
        return triton_fixedpoint.add_double_words_(
            acc, words if words.stride(1) == 1 else words.contiguous())
    return add_double_words_torch_(acc, words)


def add_double_words_torch_(flat: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """The torch path of `add_double_words_` on any device (same contract): each word
    ±mant·2**(e − 1075) (53-bit mant, biased exponent e) is ±mant·2**sh units of 2**-149,
    sh = e − 926 (the bits shifted out when sh < 0 are zero for a multiple of 2**-149), and
    goes into digits q = sh // 31 and up at bit r = sh % 31, as `_add_chunk` places a bin sum
    (q <= 7 for |v| < 2**150). Returns flat, normalised."""
    for word in words:
        bits = word.contiguous().view(torch.int64)
        e = (bits >> 52) & 0x7FF
        mant = torch.where(e > 0, (bits & ((1 << 52) - 1)) | (1 << 52), torch.zeros_like(bits))
        sh = e - 926
        mant = torch.where(sh < 0, mant >> (-sh).clamp(max=63), mant)
        sh = sh.clamp(min=0)
        q, r = sh // DIGIT_BITS, sh % DIGIT_BITS
        sign = torch.where(bits < 0, -1, 1)
        a = (mant & _MASK) << r                  # < 2**61
        c = (mant >> DIGIT_BITS) << r            # < 2**52
        for j, part in enumerate(((a & _MASK), (a >> DIGIT_BITS) + (c & _MASK),
                                  c >> DIGIT_BITS)):
            flat.scatter_add_(1, (q + j).unsqueeze(1), (part * sign).unsqueeze(1))
    return normalise_(flat)


def _count_nonfinite(flat: torch.Tensor, x: torch.Tensor) -> None:
    """flat[:, NaN/+Inf/−Inf columns] += how many values of x [k, m] are NaN, +Inf, −Inf.

    Counted per value (not per bin sum, which cannot tell Inf + Inf from Inf, nor +Inf − Inf
    from NaN), so the columns, like the digits, depend only on the multiset of values: the CUDA
    kernel (triton_fixedpoint.py) counts the same way in any chunking."""
    flat[:, _NAN] += torch.isnan(x).sum(0)
    flat[:, _PINF] += (x == float("inf")).sum(0)
    flat[:, _NINF] += (x == float("-inf")).sum(0)


def normalise_(acc: torch.Tensor) -> torch.Tensor:
    """Propagate carries in place: digits 0..N_DIGITS-2 in [0, 2**31), the top digit signed.
    The represented value is unchanged. Returns acc."""
    d = acc[..., :N_DIGITS]
    for i in range(N_DIGITS - 1):
        c = d[..., i] >> DIGIT_BITS            # floor division by 2**31 (arithmetic shift)
        d[..., i] -= c << DIGIT_BITS
        d[..., i + 1] += c
    return acc


def _bit_length(x: torch.Tensor) -> torch.Tensor:
    """Bit length of non-negative int64 values below 2**31 (0 for 0), exactly: the exponent
    field of x as float64 (x < 2**31 converts exactly), read from the bits."""
    e = (x.to(torch.float64).view(torch.int64) >> 52) - 1022
    return torch.where(x > 0, e, torch.zeros_like(x))


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2.0**e as float64 for int64 e in the normal range [-1022, 1023], built from the bits.

    Why not torch.ldexp / exp2: on CUDA they are computed through pow/exp2 in floating point and
    were measured (H200, torch 2.11) to return a value other than 2**54 for e = 54, which made
    the device accumulator inexact; a power of two written into the exponent field is exact."""
    return ((e + 1023) << 52).view(torch.float64)


def round_fp32(acc: torch.Tensor) -> torch.Tensor:
    """The exact sum each accumulator element holds, rounded once to fp32 (round-half-even).

    acc int64 [*S, N_COLS] (any digits: a sum of accumulators is fine; any strides) -> fp32 [*S].
    Exact zero is +0.0; NaN/±Inf as the module doc says. The input is not modified.
    CUDA tensors go to one Triton pass (triton_fixedpoint.round_fp32), the same bytes as
    `round_fp32_torch` (tests/test_fixedpoint_triton.py); others to `round_fp32_torch`.
    Raises ValueError for another dtype or last dimension.
    """
    _check_round(acc)
    if acc.is_cuda:   # one Triton pass instead of ~100 strided int64 ops (~2.3 s of a step)
        from rlkernel.numerics import triton_fixedpoint
        return triton_fixedpoint.round_fp32(acc.reshape(-1, N_COLS)).reshape(acc.shape[:-1])
    return round_fp32_torch(acc)


def _check_round(acc: torch.Tensor) -> None:
    if acc.dtype != torch.int64 or acc.dim() < 1 or acc.shape[-1] != N_COLS:
        raise ValueError(f"round_fp32: expected int64 [..., {N_COLS}], got {acc.dtype} "
                         f"{tuple(acc.shape)}")


def round_fp32_torch(acc: torch.Tensor) -> torch.Tensor:
    """The torch path of `round_fp32` on any device (same contract): the CPU backend and the
    reference of the CUDA kernel (benchmarks/bench_fixedpoint.py times both on CUDA).

    Carry-normalise a copy, take the sign, normalise |sum|, find the top non-zero digit, round
    the two-digit window (< 2**62) to 24 significant bits with the digits below as sticky bits,
    scale by a power of two built from exponent bits (q < 2**25 and the product are exact in
    float64; the float32 cast is exact or overflows to ±Inf), then the zero/NaN/±Inf rules.
    """
    _check_round(acc)
    shape = acc.shape[:-1]
    a = normalise_(acc.reshape(-1, N_COLS).clone())
    d = a[:, :N_DIGITS]
    neg = d[:, -1] < 0
    mag = normalise_(torch.where(neg[:, None], -a, a))[:, :N_DIGITS]   # |sum|, all digits >= 0
    k = torch.arange(1, N_DIGITS + 1, device=a.device)
    top = ((mag != 0) * k).amax(1) - 1                                 # -1 when the sum is 0
    t = top.clamp(min=1)
    hi = mag.gather(1, t[:, None])[:, 0]
    lo = mag.gather(1, (t - 1)[:, None])[:, 0]
    below = torch.where(k[None, :] - 1 < (t - 1)[:, None], mag, torch.zeros_like(mag))
    rest = (below != 0).any(1)
    # Beyond every fp32: a top digit >= 2**31, or one that wrapped int64 when negated (a top
    # digit of -2**63 with zeros below: |sum| >= 2**63 digits, it would round to -0.0 else).
    over = (hi >= (1 << DIGIT_BITS)) | (hi < 0)
    hi_c = torch.where(over, torch.zeros_like(hi), hi)
    window = (hi_c << DIGIT_BITS) + lo                                 # < 2**62
    nbits = torch.where(hi_c > 0, _bit_length(hi_c) + DIGIT_BITS, _bit_length(lo))
    s = (nbits - 24).clamp(min=0)
    q = window >> s
    half = torch.where(s > 0, (window >> (s - 1).clamp(min=0)) & 1, torch.zeros_like(s))
    low_mask = (torch.ones_like(s) << (s - 1).clamp(min=0)) - 1
    sticky = torch.where(s > 1, (window & low_mask) != 0, torch.zeros_like(rest)) | rest
    odd = (q & 1) != 0
    q = q + half * (sticky | odd).to(torch.int64)
    exp = s + (t - 1) * DIGIT_BITS + _UNIT_EXP
    val = (q.to(torch.float64) * _pow2(exp)).to(torch.float32)   # q < 2**25: exact product
    val = torch.where(over, torch.full_like(val, float("inf")), val)
    val = torch.where(neg, -val, val)
    val = torch.where(top < 0, torch.zeros_like(val), val)
    nan, pinf, ninf = a[:, _NAN] > 0, a[:, _PINF] > 0, a[:, _NINF] > 0
    val = torch.where(pinf, torch.full_like(val, float("inf")), val)
    val = torch.where(ninf, torch.full_like(val, float("-inf")), val)
    val = torch.where(nan | (pinf & ninf), torch.full_like(val, float("nan")), val)
    return val.reshape(shape)


def two_sum(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, e): s = fl(a + b) and its exact rounding error e = a + b − s, elementwise (Knuth's
    TwoSum, TAOCP vol. 2 §4.2.2; each torch op rounds on its own, so no contraction can break
    it). The torch twin of triton_fixedpoint.two_sum."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def round_double_words(words: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """words float64 [2, *S] (hi = words[0], lo = words[1]) -> fp32 [*S]: the exact real hi + lo
    rounded once to fp32, round-half-even, ±Inf past the range, an exact zero as +0.0 — the bytes
    of `round_fp32` of an accumulator holding hi + lo. Contract (not checked): hi and lo finite
    multiples of 2**-149 with |hi| < 2**150, what a checked TwoSum accumulation of fp32 values
    leaves (kernels/triton_grad_weight.py); no NaN/Inf. CUDA tensors go to one Triton pass
    (triton_fixedpoint.round_double_words), others to `round_double_words_torch`; same bytes.
    out: a contiguous fp32 tensor of shape words.shape[1:] on the words' device to write into
    (returned; on CUDA no second copy is made). Raises ValueError for another dtype or a first
    dimension other than 2, or an `out` of another shape, dtype, layout or device."""
    if words.dtype != torch.float64 or words.dim() < 1 or words.shape[0] != 2:
        raise ValueError(f"round_double_words: expected float64 [2, ...], got {words.dtype} "
                         f"{tuple(words.shape)}")
    if out is not None and (out.dtype != torch.float32 or out.shape != words.shape[1:]
                            or not out.is_contiguous() or out.device != words.device):
        raise ValueError(f"round_double_words: out must be a contiguous fp32 "
                         f"{tuple(words.shape[1:])} on {words.device}, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
    if words.is_cuda:
        from rlkernel.numerics import triton_fixedpoint
        flat = words.reshape(2, -1)
        if flat.stride(1) != 1:
            flat = flat.contiguous()
        dst = None if out is None else out.view(-1)
        return triton_fixedpoint.round_double_words(flat, out=dst).reshape(words.shape[1:])
    res = round_double_words_torch(words)
    return res if out is None else out.copy_(res)


def round_double_words_torch(words: torch.Tensor) -> torch.Tensor:
    """The torch path of `round_double_words` on any device (same contract; the CPU backend and
    the reference of the CUDA kernel).

    Why it is exact: (s, e) = TwoSum(hi, lo) gives s = RN64(hi + lo) and the exact error e. If
    e != 0 and s's last significand bit is 0, s moves one unit toward e (its bit pattern +1 when
    e has s's sign, −1 otherwise: float64 bit patterns are monotone in magnitude), so s becomes
    hi + lo rounded to odd at 53 bits. Rounding that to nearest at 24 bits or fewer (fp32,
    subnormals included) is the direct rounding: Boldo & Melquiond, "Emulation of FMA and
    correctly rounded sums: proved algorithms using rounding to odd", IEEE TC 2008 (needs
    53 >= 24 + 2). The float64 -> fp32 conversion is IEEE's round-half-even, overflow to ±Inf
    included (2**128·(1 − 2**-25) is on the 53-bit grid, so an odd rounding never crosses it).
    s = ±0 only for an exact zero: −0.0 (hi = lo = −0.0) is written as +0.0."""
    s, e = two_sum(words[0], words[1])
    bits = s.contiguous().view(torch.int64)
    toward = torch.where((bits ^ e.contiguous().view(torch.int64)) < 0, -1, 1)
    bits = bits + torch.where((e != 0) & ((bits & 1) == 0), toward, 0)
    bits = torch.where(bits == _F64_NEG_ZERO, 0, bits)
    return bits.view(torch.float64).to(torch.float32)


_F64_NEG_ZERO = -(1 << 63)   # −0.0 as int64 bits


def exact_sum_fp32(x: torch.Tensor) -> torch.Tensor:
    """fp32 [n, *S] -> fp32 [*S]: the exact sum over dim 0, rounded once (see module doc)."""
    return round_fp32(accumulate_(zeros(x.shape[1:], x.device), x))
