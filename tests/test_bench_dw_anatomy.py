"""benchmarks/bench_dw_anatomy.py's `check_asm_tma` variant, compiled for sm_90 on the CPU: its
exactness test written as one PTX block joins the two comparisons by `setp`'s `.or` and selects
once, so the leaf loop's SASS has half the FSELs of `check_tma` (Triton's tl.where(a | b, ...)),
the same DADDs and conversion, and no more registers. Whether that is faster, and that its
words equal the production pass's (checked before timing), needs the GPU (docs/BENCHMARKS.md,
thirty-fifth session)."""

from __future__ import annotations

import collections
import re

import torch

from kernel_helpers import (NEEDS_TRITON, FakeTensor, _sm90_compiled, fake_descriptor,
                            sm90_registers)

pytestmark = NEEDS_TRITON


def _sass_ops(mode: str) -> tuple[collections.Counter, tuple[int, int]]:
    """(opcode counts of the whole SASS, (registers, spill bytes)) of `mode` at qwen3-1.7b's
    down_proj (16,384 tokens, 64 x 64 tile, 4 warps, 3 stages, bf16 by TMA)."""
    from triton.tools.disasm import get_sass

    from benchmarks import bench_dw_anatomy as b
    t, n, k = 16384, 6144, 2048
    bf = torch.bfloat16
    args = [FakeTensor(bf), FakeTensor(bf), fake_descriptor(bf, [t, n], [128, 64]),
            fake_descriptor(bf, [t, k], [128, 64]), FakeTensor(torch.float64), t, n, k, n, 1,
            k, 1, n * k]
    kw = dict(BLOCK_N=64, BLOCK_K=64, MODE=b.MODES[mode], LEAF_T=128, num_warps=4,
              num_stages=3, enable_fp_fusion=False)
    compiled, _ = _sm90_compiled(b._anatomy_kernel, args, kw)
    # Triton's get_sass: one "control-bits<TAB>[@P] OPCODE operands;" line an instruction
    ops = re.findall(r"^[^\t\n]*\t(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)",
                     get_sass(compiled.asm["cubin"]), re.M)
    return collections.Counter(ops), sm90_registers(b._anatomy_kernel, args, kw)


def test_the_asm_check_selects_once_with_the_same_float64_work():
    stock, stock_regs = _sass_ops("check_tma")
    asm, asm_regs = _sass_ops("check_asm_tma")
    assert asm["DSETP.NEU.OR"] > 0 and stock["DSETP.NEU.OR"] == 0
    assert asm["DADD"] == stock["DADD"] > 0
    assert asm["F2F.F64.F32"] == stock["F2F.F64.F32"] > 0
    assert 2 * asm["FSEL"] <= stock["FSEL"], (asm["FSEL"], stock["FSEL"])
    assert asm_regs[1] == 0 and asm_regs[0] <= stock_regs[0], (asm_regs, stock_regs)
