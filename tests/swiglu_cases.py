"""Adversarial inputs for the SwiGLU kernels (kernels/triton_activation.py) and the comparison
they are held to; used by tests/activation_triton_checks.py (interpreter) and
tests/test_cuda_backward.py (GPU).

`gate_values()`: fp32 gates that stress every step of elementwise.sigmoid32: ±0, subnormals,
the σ underflow region (|g| ≈ 87..104), the exp64 clamp edges (x = −g at ±709 / −745 and up to
three ulps either side), values far past them up to ±fp32 max, ±Inf, NaNs with payloads and
signs (signalling too), gates where x·log2 e + 0.5 crosses an integer (n·ln2 − ln2/2, where the
range reduction picks the other n) and where r ≈ 0 (n·ln2), each with its fp32 neighbours,
hard-to-round gates (`_HARD_BITS`), random normals of scales 1e-3 … 300 and random bit patterns.
The hard gates are what make a float64 slip visible: σ is rounded to fp32 from float64, so an
error of a few float64 ulps changes fp32 bits only near a midpoint (dropping the + 0.5 of the
range reduction changes 13 elements of σ with them, none without them).
`cases(n_min)`: (gate, up, dh) of one length ≥ n_min, the gates above tiled, up and dh random
with specials (±0, ±Inf, NaN, subnormals, ±3e38) at strided positions, dh over 2**±40.
`same_bits(a, b)`: equal bits, where any NaN equals any NaN in the same place: which payload
NaN·NaN returns is the hardware's choice (x86 returns one operand's, and which one the compiler
picks for torch's vectorised mul differs from numpy's; NVIDIA returns the canonical NaN), so
payloads are not part of the contract; every non-NaN bit, −0.0 included, is.
Does not: run anything (no triton import).
"""

from __future__ import annotations

import math

import torch

_FP32_MAX = 3.4028234663852886e38
_SPECIAL_BITS = (0x7FC00000, 0xFFC00000, 0x7FC00001, 0x7F800001, 0xFF812345)   # NaNs
# Hard-to-round gates (fp32 bits): the torch path's float64 σ(g), before its rounding to fp32,
# lies within HARD_ULPS float64 ulps of a midpoint between two fp32 numbers (nine exactly on
# one), so a change of that float64 value by a few ulps can change σ's fp32 bits. Found by
# a search over 10**8 random gates in [-87, 17] and log-uniform |g| in [2**-24, 2**6.4],
# keeping the closest three per sign and binade (`hard_gate_distances` re-checks them).
HARD_ULPS = 2048
_HARD_BITS = (
    0x33FFFFF2, 0x33FFFFFB, 0x33FFFFFF, 0x3400000D, 0x3400000F, 0x34000024, 0x34BFFFEC,
    0x34C00009, 0x34C0001B, 0x35200005, 0x355FFFFA, 0x35600002, 0x358FFFFD, 0x35AFFFFD,
    0x35CFFFFD, 0x3627FFFF, 0x36380000, 0x36380001, 0x36BBFFFF, 0x36BC0000, 0x36DBFFFF,
    0x370A0000, 0x3711FFFF, 0x37760001, 0x37830000, 0x37AD0000, 0x37C90000, 0x38028000,
    0x38178000, 0x381F8000, 0x3881C000, 0x3883C000, 0x3887C000, 0x3904A000, 0x3907A000,
    0x3908E000, 0x3A67B801, 0x3A689801, 0x3A695801, 0x3A92B401, 0x3A92DC01, 0x3AE8AC04,
    0x3B128A04, 0x3B27BE06, 0x3B3FFE09, 0x3BD0592E, 0x3C0998B5, 0x3C22EED8, 0x3C7761B4,
    0x3CD43DCA, 0x3CE5AF1A, 0x3CF8521E, 0x3D0C9E29, 0x3D22B59A, 0x3D58D716, 0x3DC94EA4,
    0x3DE673DC, 0x3DFFBA7E, 0x3E22121D, 0x3E40E458, 0x3E4F1240, 0x3EA47905, 0x3EB2C9B8,
    0x3ED8565A, 0x3F0482E8, 0x3F30A369, 0x3F3E750E, 0x3F93C016, 0x3F9C1686, 0x3FF53D39,
    0x400B0EE9, 0x4011507F, 0x4018AA0B, 0x40A3C2E2, 0x40ACE472, 0x40D22551, 0x411B3D96,
    0x411E9895, 0x413937B2, 0x4181D72D, 0xB3800007, 0xB3800008, 0xB380000A, 0xB4400004,
    0xB4400009, 0xB440000D, 0xB4A00000, 0xB4A00003, 0xB4A0000E, 0xB50FFFFD, 0xB50FFFFE,
    0xB5100000, 0xB5880000, 0xB597FFFE, 0xB5D80004, 0xB61C0000, 0xB62C0000, 0xB6740000,
    0xB69A0001, 0xB6B20001, 0xB6D5FFFF, 0xB7030000, 0xB70D0000, 0xB70F0000, 0xB78F8000,
    0xB7988000, 0xB7AE8000, 0xB802C000, 0xB8054000, 0xB80AC000, 0xB8826000, 0xB882A000,
    0xB882E000, 0xB9031000, 0xB9035000, 0xB9037000, 0xBA682C01, 0xBA687C01, 0xBA68D401,
    0xBA929201, 0xBAD35A03, 0xBAD36203, 0xBB389B08, 0xBB59090D, 0xBB63A50F, 0xBB986392,
    0xBBC6DCA8, 0xBBDA6BB5, 0xBC07D7F3, 0xBC19CA0A, 0xBC72BE63, 0xBC84E51F, 0xBCC6739C,
    0xBCDD8E95, 0xBD106664, 0xBD107F86, 0xBD668DA4, 0xBD833935, 0xBD85BF92, 0xBDA7C629,
    0xBE1D6CDC, 0xBE374573, 0xBE4D2D5B, 0xBE9C534F, 0xBEBDC61F, 0xBEF11F06, 0xBF0BF0CF,
    0xBF0F2996, 0xBF11E8EE, 0xBFE7F92D, 0xBFF0E0F2, 0xBFF2FDF3, 0xC0150B71, 0xC0413023,
    0xC07EFBDA, 0xC08C6E34, 0xC0A99032, 0xC0F24CD2, 0xC124339A, 0xC14E1B83, 0xC156DEFC,
    0xC197AEC8, 0xC1B6A216, 0xC1E14A11, 0xC233E0F0, 0xC236E4B4, 0xC27D58D9, 0xC2910CEF,
    0xC2ABB454, 0xC2AC0052
)


def _f32_bits(vals: list[int]) -> torch.Tensor:
    return torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in vals],
                        dtype=torch.int32).view(torch.float32)


def _with_neighbours(x: torch.Tensor, ulps: int = 2) -> torch.Tensor:
    """x and its fp32 neighbours up to `ulps` away on each side (as bit patterns)."""
    b = x.view(torch.int32)
    return torch.cat([(b + d).view(torch.float32) for d in range(-ulps, ulps + 1)])


def gate_values(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    plain = [0.0, -0.0, 2.0**-149, -(2.0**-149), 1e-40, -1e-40, 2.0**-126, -(2.0**-126),
             1e-30, -1e-30, 1e-8, -1e-8, 0.5, -0.5, 1.0, -1.0, 15.9, -15.9, 17.0, -17.0,
             87.3, -87.3, 88.72, -88.72, 103.97, -103.97, 104.0, -104.0, 150.0, -150.0,
             1e4, -1e4, 3e38, -3e38, _FP32_MAX, -_FP32_MAX, math.inf, -math.inf, math.nan]
    edges = torch.tensor([709.0, -709.0, 745.0, -745.0, 708.0, -744.0])   # x = −g clamp edges
    ln2 = math.log(2.0)
    k_small = torch.arange(-160, 161, dtype=torch.float64)
    k_wide = torch.arange(-1080, 1031, 9, dtype=torch.float64)
    boundary = torch.cat([-(k_small - 0.5) * ln2, -k_small * ln2,
                          -(k_wide - 0.5) * ln2]).float()
    normals = torch.cat([torch.randn(300, generator=g) * s
                         for s in (1e-3, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0)])
    random_bits = torch.randint(-2**31, 2**31, (600,), generator=g).to(torch.int32)
    return torch.cat([torch.tensor(plain), _f32_bits(list(_SPECIAL_BITS)), hard_gates(),
                      _with_neighbours(edges, 3), _with_neighbours(boundary), normals,
                      random_bits.view(torch.float32)])


def hard_gates() -> torch.Tensor:
    return _f32_bits(list(_HARD_BITS))


def hard_gate_distances() -> torch.Tensor:
    """For each hard gate: |float64 σ − nearest fp32 midpoint| in float64 ulps (int64), from the
    torch path's float64 σ (normal fp32 results: the 29 bits that fp32 drops, vs 2**28)."""
    from rlkernel.kernels.elementwise import exp64
    s64 = 1.0 / (1.0 + exp64(-hard_gates().double()))
    low = s64.view(torch.int64) & ((1 << 29) - 1)
    return (low - (1 << 28)).abs()


def _sprinkle(x: torch.Tensor, step: int, offset: int) -> torch.Tensor:
    """x with specials written at every step-th position from offset (cycled)."""
    sp = torch.cat([torch.tensor([0.0, -0.0, math.inf, -math.inf, 2.0**-149, -1e-40, 3e38,
                                  -3e38]), _f32_bits([0x7FC00000, 0xFFC00001])])
    x = x.clone()
    idx = torch.arange(offset, x.numel(), step)
    x[idx] = sp[torch.arange(idx.numel()) % sp.numel()]
    return x


def cases(n_min: int = 0, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate, up, dh), fp32 1-D of one length >= n_min (gate_values() tiled)."""
    gv = gate_values(seed)
    gate = gv.repeat(max(1, -(-n_min // gv.numel())))
    g = torch.Generator().manual_seed(seed + 100)
    n = gate.numel()
    up = _sprinkle(torch.randn(n, generator=g) * 2.0, 17, 3)
    scale = torch.exp2(torch.randint(-40, 41, (n,), generator=g).float())
    dh = _sprinkle(torch.randn(n, generator=g) * scale, 13, 5)
    return gate, up, dh


def nan_as_one(t: torch.Tensor) -> torch.Tensor:
    """The integer bits of fp32 (bf16) t, every NaN written as 0x7FC00000 (0x7FC0)."""
    t = t.detach().contiguous()
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype]
    return torch.where(torch.isnan(t), torch.full_like(t, math.nan), t).view(ints)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and dtype, equal bits; NaN == NaN whatever the payload (see above)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(nan_as_one(a), nan_as_one(b))


def describe_diff(a: torch.Tensor, b: torch.Tensor, *inputs: torch.Tensor) -> str:
    """The count of differing elements and the first few, with the inputs that made them."""
    bad = torch.nonzero((nan_as_one(a) != nan_as_one(b)).reshape(-1)).flatten()
    first = bad[:4].tolist()
    rows = [[float(t.reshape(-1)[i]) for t in (a, b, *inputs)] for i in first]
    return f"{bad.numel()} of {a.numel()} differ; (got, want, inputs...) at {first}: {rows}"
