"""Exact, order-independent sum of squares and L2 norm of fp32/bf16/fp16 tensors.

What it does: every element's square is computed *exactly* as an integer multiple of 2**-298 and
added as an integer, so the accumulated value is the exact mathematical sum of squares, whatever
the order of the elements, the split of a tensor into pieces, or the set of ranks that held them.
The exact total is rounded once (round-half-even) to float64 by `sum_of_squares`, and `norm` is
`math.sqrt` of that float64, so two runs with the same multiset of gradient values give the same
bits (DESIGN.md §1 "Optimizer step"). NaN/+Inf/-Inf are counted and named, never dropped; as in
IEEE arithmetic, a NaN element makes the sum and the norm NaN, and otherwise an ±Inf element makes
them +Inf (the square of ±Inf is +Inf), so an infinite gradient is recorded as inf, not nan.

Why it is exact: an fp32 value is s * 2**E with an integer significand s < 2**24 and
E in [-149, 104]; its square s*s * 2**(2E) has s*s < 2**48 and 2E in [-298, 208], so it is an
integer below 2**554 in units of 2**-298. bf16 and fp16 upcast to fp32 exactly.

Algorithm (after ReproBLAS binned summation: Demmel, Nguyen, Ahrens, "Algorithms for Efficient
Reproducible Floating Point Summation", ACM TOMS 46(3), 2020). ReproBLAS must bin inexact
summands and keep several folds; our variant is simpler because every square is exact:
  1. per element, vectorised int ops split s*s into two 24-bit halves and add them, with
     `index_add_` (integer adds: exact, associative), into one bin per fp32 exponent field
     (256 bins x 2 halves, int64). Bins stay far from overflow: at most 2**38 elements are pending
     (each half is < 2**24) before the bins are folded.
  2. folding shifts each bin to its bit position (2*e - 2, e the clamped exponent field) and adds
     it to a Python int: the exact running total in units of 2**-298.
  3. `to_tensor` cuts that total into 32-bit limbs held in an int64 tensor of fixed length, so
     an elementwise integer SUM across ranks (all_reduce SUM; fewer than 2**31 ranks cannot
     overflow a limb) followed by `from_tensor` equals `merge_`.

CUDA tensors take the Triton kernel of rlkernel/kernels/triton_exact.py (one pass, the same exact
integer, so the same to_tensor() bytes); its int64 limbs stay on the device until a result is asked.

Does not: communicate (the caller all-reduces `to_tensor()`), clip, or handle float64 inputs (a
float64 square is not exact in float64; such inputs are rejected). Tensor names of non-finite
elements are local: `to_tensor` carries only the counts.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Iterable

import torch

__all__ = ["ExactSumOfSquares", "exact_l2_norm", "exact_sum", "float_hex"]

# Exact squares are < 2**554 in units of 2**-298; 20 limbs (640 bits) leave 86 bits of headroom
# for the element count, far beyond any model.
_LIMB_BITS = 32
_N_LIMBS = 20
_LIMB_MASK = (1 << _LIMB_BITS) - 1
_N_COUNTERS = 3  # nan, posinf, neginf
TENSOR_LEN = _N_LIMBS + _N_COUNTERS
# Elements per vectorised pass: bounds the int64 temporaries (~8 bytes x a few per element).
_CHUNK = 1 << 22
# Each half-square is < 2**24, so a bin overflows int64 only after 2**39 adds; fold well before.
_MAX_PENDING = 1 << 38
# CUDA limbs gain < 2**32 per fold per 4096-element tile: fold to Python well before int64 overflow.
_MAX_PENDING_CUDA = 1 << 34


def _triton_exact():
    """kernels/triton_exact, or None where Triton is not installed (then the torch path runs)."""
    try:
        from rlkernel.kernels import triton_exact
    except ImportError:
        return None
    return triton_exact
_ACCEPTED = (torch.float32, torch.bfloat16, torch.float16)
_FP32_EXP_INF = 255
_FP32_POSINF_BITS = 0x7F800000
_FP32_NEGINF_BITS = -0x00800000  # 0xFF800000 as a signed int32
# Units of the exact total: 2**-298 is the square of the smallest fp32 subnormal.
_UNIT_EXP = 298


class ExactSumOfSquares:
    """Exact accumulator of sum(x**2) over any number of float tensors.

    Inputs: tensors of dtype float32, bfloat16 or float16, any shape (including 0-d and empty),
    any device; all elements are consumed. State: an exact non-negative integer total (units of
    2**-298), three non-finite counters and the names of tensors that held non-finite values.
    Result bits depend only on the multiset of element values added, never on order or split.
    """

    def __init__(self) -> None:
        self._total = 0  # exact sum of finite squares, in units of 2**-298
        self._counts = [0, 0, 0]  # nan, posinf, neginf
        self._names: list[str] = []
        self._n_added = 0  # add_ calls, to name unnamed tensors
        # Device-side pending state, folded lazily so that add_ never waits on the device.
        self._bins: torch.Tensor | None = None  # int64 [2, 256]: low / high 24-bit halves
        self._pending = 0
        self._pending_nf: list[tuple[str, torch.Tensor]] = []
        self._limbs: torch.Tensor | None = None  # CUDA: int64 limbs of kernels/triton_exact
        self._limbs_pending = 0

    # ------------------------------------------------------------------ accumulation
    def add_(self, t: torch.Tensor, name: str | None = None) -> None:
        """Add the squares of every element of `t`.

        `t`: float32 / bfloat16 / float16 tensor of any shape (bf16 and fp16 upcast exactly).
        `name`: recorded in `nonfinite_names` if `t` holds a NaN or Inf; unnamed tensors are
        recorded as "#k", k the index of this add_ call on this accumulator.
        Raises TypeError for non-tensors, float64 (its square is not exact in float64), and
        integer, bool or complex dtypes.
        """
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"ExactSumOfSquares.add_ expects a torch.Tensor, got {type(t).__name__}"
            )
        if t.dtype == torch.float64:
            raise TypeError(
                "ExactSumOfSquares.add_: float64 is not supported: the square of a float64 is not "
                "exact in float64; pass float32, bfloat16 or float16"
            )
        if t.dtype not in _ACCEPTED:
            raise TypeError(
                f"ExactSumOfSquares.add_: dtype {t.dtype} is not supported; "
                "pass float32, bfloat16 or float16"
            )
        label = name if name is not None else f"#{self._n_added}"
        self._n_added += 1
        flat = t.detach().reshape(-1)
        if flat.dtype != torch.float32:
            flat = flat.to(torch.float32)  # exact: bf16/fp16 values are a subset of fp32
        n = flat.numel()
        if n == 0:
            return
        if flat.is_cuda and _triton_exact() is not None:
            self._add_cuda(flat, label)
            return
        if self._bins is not None and self._bins.device != flat.device:
            self._fold()
        if self._bins is None:
            self._bins = torch.zeros(2, 256, dtype=torch.int64, device=flat.device)
        nf = torch.zeros(_N_COUNTERS, dtype=torch.int64, device=flat.device)
        for start in range(0, n, _CHUNK):
            piece = flat[start : start + _CHUNK]
            if self._pending + piece.numel() > _MAX_PENDING:
                self._fold_bins()
            self._add_chunk(piece, nf)
            self._pending += piece.numel()
        self._pending_nf.append((label, nf))

    def _add_chunk(self, x: torch.Tensor, nf: torch.Tensor) -> None:
        bits = x.contiguous().view(torch.int32)
        mag = bits & 0x7FFFFFFF
        exp = mag >> 23
        # The implicit leading 1 exists only for normals; subnormals and zeros share the exponent
        # of exponent field 1, which the fold applies to bin 0 as well.
        sig = (mag & 0x7FFFFF) | (exp.clamp(max=1) << 23)
        sig = sig.to(torch.int64)
        sq = sig * sig  # < 2**48: exact
        idx = exp.to(torch.int64)
        # Two 24-bit halves let 2**39 adds accumulate per bin without int64 overflow. Inf/NaN
        # land in bin 255, which the fold ignores: no masking pass needed.
        self._bins[0].index_add_(0, idx, sq & 0xFFFFFF)
        self._bins[1].index_add_(0, idx, sq >> 24)
        nf[0] += (mag > _FP32_POSINF_BITS).sum()
        nf[1] += (bits == _FP32_POSINF_BITS).sum()
        nf[2] += (bits == _FP32_NEGINF_BITS).sum()

    def _fold_bins(self) -> None:
        if self._bins is None or self._pending == 0:
            return
        lo, hi = self._bins.cpu().tolist()
        total = 0
        for e in range(_FP32_EXP_INF):
            if lo[e] or hi[e]:
                shift = 2 * e - 2 if e > 0 else 0  # bit position of s*s * 2**(2E) in 2**-298 units
                total += (lo[e] + (hi[e] << 24)) << shift
        self._total += total
        self._bins.zero_()
        self._pending = 0

    def _add_cuda(self, flat: torch.Tensor, label: str) -> None:
        te = _triton_exact()
        if self._limbs is not None and (self._limbs.device != flat.device
                                        or self._limbs_pending + flat.numel() > _MAX_PENDING_CUDA):
            self._fold_limbs()
        limbs, nf = te.sum_squares_limbs(flat)
        self._limbs = limbs if self._limbs is None else self._limbs + limbs
        self._limbs_pending += flat.numel()
        self._pending_nf.append((label, nf))

    def _fold_limbs(self) -> None:
        if self._limbs is not None:
            self._total += _triton_exact().limbs_to_int(self._limbs)
            self._limbs = None
            self._limbs_pending = 0

    def _fold(self) -> None:
        """Bring all device-side state into the exact Python-side state."""
        self._fold_limbs()
        self._fold_bins()
        if self._pending_nf:
            counts = torch.stack([c for _, c in self._pending_nf]).cpu().tolist()
            for (label, _), row in zip(self._pending_nf, counts):
                for i in range(_N_COUNTERS):
                    self._counts[i] += row[i]
                if any(row):
                    self._names.append(label)
            self._pending_nf = []
        self._bins = None

    def merge_(self, other: "ExactSumOfSquares") -> None:
        """Add `other`'s exact total, counters and names into self (integer add; `other` kept)."""
        if not isinstance(other, ExactSumOfSquares):
            raise TypeError(f"merge_ expects an ExactSumOfSquares, got {type(other).__name__}")
        other._fold()
        self._fold()
        self._total += other._total
        for i in range(_N_COUNTERS):
            self._counts[i] += other._counts[i]
        self._names.extend(other._names)

    # ------------------------------------------------------------------ transport
    def to_tensor(self) -> torch.Tensor:
        """Fixed-length int64 CPU tensor [TENSOR_LEN]: 20 limbs of 32 bits (least significant
        first), then the nan, +inf and -inf counts.

        Every limb is < 2**32, so an elementwise SUM over fewer than 2**31 ranks cannot overflow
        int64; `from_tensor` of such a sum equals merging the accumulators. Move it to the
        collective's device with `.to(...)`. Raises OverflowError if the total needs more than
        640 bits (over 2**86 maximal fp32 squares; unreachable in practice).
        """
        self._fold()
        if self._total >> (_LIMB_BITS * _N_LIMBS):
            raise OverflowError("exact sum of squares exceeds the fixed limb width (640 bits)")
        limbs = [(self._total >> (_LIMB_BITS * k)) & _LIMB_MASK for k in range(_N_LIMBS)]
        return torch.tensor(limbs + list(self._counts), dtype=torch.int64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "ExactSumOfSquares":
        """Inverse of `to_tensor`, also accepting elementwise sums of such tensors.

        `t`: 1-D int64 tensor of length TENSOR_LEN (any device) with non-negative entries; limbs
        need not be normalised (carries are re-propagated). Names are not transported: the
        result's `nonfinite_names` is empty. Raises TypeError / ValueError on a wrong dtype,
        shape or a negative entry.
        """
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64:
            raise TypeError("from_tensor expects an int64 torch.Tensor made by to_tensor()")
        if t.dim() != 1 or t.numel() != TENSOR_LEN:
            raise ValueError(f"from_tensor expects shape [{TENSOR_LEN}], got {list(t.shape)}")
        vals = t.cpu().tolist()
        if any(v < 0 for v in vals):
            raise ValueError("from_tensor: negative entry (not a sum of to_tensor() outputs)")
        acc = cls()
        acc._total = sum(v << (_LIMB_BITS * k) for k, v in enumerate(vals[:_N_LIMBS]))
        acc._counts = vals[_N_LIMBS:]
        return acc

    # ------------------------------------------------------------------ results
    def sum_of_squares(self) -> float:
        """Correctly rounded (round-half-even) float64 of the exact sum of squares.

        What IEEE arithmetic gives: NaN if any NaN element was seen, else +inf if any +/-Inf
        element was seen (its square is +inf) or if the exact finite sum exceeds the float64 range
        (needs ~2**512 maximal fp32 squares).
        """
        self._fold()
        if self._counts[0]:
            return math.nan
        if self._counts[1] or self._counts[2]:
            return math.inf
        try:
            # int / int is correctly rounded in CPython; the quotient is never subnormal
            # (it is 0 or >= 2**-298), so this is the only rounding.
            return self._total / (1 << _UNIT_EXP)
        except OverflowError:
            return math.inf

    def norm(self) -> float:
        """math.sqrt(sum_of_squares()): the L2 norm as float64 (NaN if a NaN was seen, else +inf
        if an Inf was)."""
        return math.sqrt(self.sum_of_squares())

    @property
    def nonfinite(self) -> dict[str, int]:
        """Counts of non-finite elements seen: {"nan": int, "posinf": int, "neginf": int}."""
        self._fold()
        return {"nan": self._counts[0], "posinf": self._counts[1], "neginf": self._counts[2]}

    @property
    def nonfinite_names(self) -> list[str]:
        """Names (in add_ order) of locally added tensors holding a NaN or Inf; a copy."""
        self._fold()
        return list(self._names)


def exact_l2_norm(tensors: Iterable[torch.Tensor] | dict[str, torch.Tensor]) -> float:
    """Exact-then-rounded L2 norm over all elements of `tensors` (a dict is keyed by name).

    Same dtype rules and errors as `ExactSumOfSquares.add_`; NaN if any element is NaN, else +inf
    if any is infinite.
    """
    acc = ExactSumOfSquares()
    if isinstance(tensors, dict):
        for name, t in tensors.items():
            acc.add_(t, name=name)
    else:
        for t in tensors:
            acc.add_(t)
    return acc.norm()


def exact_sum(values: Iterable[float]) -> float:
    """Correctly rounded float64 sum of Python floats, independent of order.

    Non-finite inputs follow IEEE rules (inf + -inf = nan). A finite sum beyond the float64 range
    returns +/-inf instead of raising.
    """
    vals = [float(v) for v in values]
    # fsum raises on inf + -inf and on some sums holding an inf: apply the IEEE rules first.
    if any(math.isnan(v) for v in vals):
        return math.nan
    has_pos, has_neg = math.inf in vals, -math.inf in vals
    if has_pos or has_neg:
        return math.nan if has_pos and has_neg else (math.inf if has_pos else -math.inf)
    try:
        return math.fsum(vals)
    except OverflowError:
        # fsum gives up when a partial overflows even if the exact sum does not; redo exactly.
        exact = sum((Fraction(v) for v in vals), Fraction(0))
        try:
            return float(exact)  # Fraction -> float is correctly rounded
        except OverflowError:
            return math.inf if exact > 0 else -math.inf


def float_hex(x: float) -> str:
    """float.hex of `x` as a float64: its exact bits, for evidence files."""
    return float(x).hex()
