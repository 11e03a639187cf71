"""Qwen3's SwiGLU MLP, down(silu(gate(x))·up(x)), as one autograd node.

Computes exactly what the three separate ops compute — `matmul.column_parallel_linear` for gate
and up, `activation.swiglu`, `matmul.row_parallel_linear` for down — with the same rounding
points, in the same order, so the same bytes on every device and topology. Why one node: in a
bf16 run the activation and the gradients of gate and up each meet a rounding point (down's
input, gate/up's dY) right after SwiGLU produces them. As separate autograd nodes they must be
fp32 tensors, written, read back and cast (autograd hands a tensor's gradient back in that
tensor's dtype, so SwiGLU's output cannot be bf16 while down's dX reaching it stays fp32); here
the SwiGLU kernels store them rounded (on CUDA: 2.4 GB less traffic per layer at qwen3-1.7b's
16k-token step) and down's dX reaches SwiGLU's backward in fp32 as before.

Forward: xr = round(x); g, u = xr·W_gateᵀ, xr·W_upᵀ (fp32); a = round(silu(g)·u); this rank's
row-parallel partial of a·W_downᵀ. Backward: d a = (round(dy)·W_down) in fp32 and W_down's dW;
(d g, d u) = round(SwiGLU backward(d a)) with σ recomputed; then the column-parallel dX subtree
and W_gate, W_up's dW — each step the separate ops' own code (matmul.column_grads,
matmul.row_grads, activation.swiglu_grads_rounded). Saved between the passes: xr, g, u (fp32)
and a — no fp32 activation and no σ.
Source: Shazeer, "GLU Variants Improve Transformer" (2020); Megatron-LM's column-/row-parallel
MLP (Shoeybi et al. 2019, §3). Does not: communicate (model/ops.py wraps it in
parallel.enter_tp / exit_row, as it does the separate linears).
"""

from __future__ import annotations

import torch

from rlkernel.distributed.tokensum import TokenSum
from rlkernel.kernels.activation import swiglu_grads_rounded, swiglu_rounded
from rlkernel.kernels.matmul import (check_compute_dtype, column_grads, linear_nt,
                                     row_grads, row_parallel_nt, rounding_point,
                                     virtual_shard_rows, weight_point)
from rlkernel.spec import VIRTUAL_TP


class _SwiGLUMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, local_shards, tok, cd, w_gate, w_up, w_down):
        xr = rounding_point(x, cd)
        g, u = (linear_nt(xr, weight_point(w, cd, tok)) for w in (w_gate, w_up))
        a = swiglu_rounded(g, u, cd)
        ctx.save_for_backward(xr, g, u, a)
        # The parameters key the gradient sink (see matmul._ColumnParallelLinear).
        ctx.tok, ctx.cd, ctx.params = tok, cd, (w_gate, w_up, w_down)
        ctx.shard_rows = tuple(virtual_shard_rows(w.shape[0], local_shards)
                               for w in (w_gate, w_up))
        return row_parallel_nt(a, weight_point(w_down, cd, tok), local_shards)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        xr, g, u, a = ctx.saved_tensors
        need = ctx.needs_input_grad
        d_a, dw_down = row_grads(a, dy, ctx.params[2], ctx.cd, ctx.tok, True, need[6])
        d_g, d_u = swiglu_grads_rounded(d_a, g, u, ctx.cd)
        del d_a
        dx, (dw_gate, dw_up) = column_grads(xr, (d_g, d_u), ctx.params[:2], ctx.shard_rows,
                                            ctx.cd, ctx.tok, need[0], need[4:6])
        return dx, None, None, None, dw_gate, dw_up, dw_down


def swiglu_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
               *, local_shards: int = VIRTUAL_TP, tok: TokenSum | None = None,
               compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """This rank's row-parallel partial of down(silu(gate(x))·up(x)) (module doc).

    x [M, H] fp32 (or already in the compute dtype), w_gate / w_up [I_local, H] (this rank's
    rows), w_down [H, I_local] -> [M, H] fp32 partial, which `parallel.exit_row` finishes across
    TP. local_shards: this rank's virtual-TP shards of I (VIRTUAL_TP / TP). Backward: dX fp32,
    this rank's local subtree (`parallel.enter_tp` finishes it); dW of the three weights through
    `tok`. ValueError for a compute dtype outside COMPUTE_DTYPES, an x that is not 2-D, or
    weights whose shapes do not form an MLP.
    """
    check_compute_dtype(compute_dtype)
    if x.dim() != 2:   # a [B, T, H] x failed deep inside the matmuls with unrelated shapes
        raise ValueError(f"swiglu_mlp: x {tuple(x.shape)} is {x.dim()}-D; expected x [M, H] "
                         "(flatten the leading dimensions into M)")
    inter, hidden = w_gate.shape
    if (w_up.shape != w_gate.shape or tuple(w_down.shape) != (hidden, inter)
            or x.shape[-1] != hidden):
        raise ValueError(f"swiglu_mlp: x {tuple(x.shape)}, w_gate {tuple(w_gate.shape)}, w_up "
                         f"{tuple(w_up.shape)}, w_down {tuple(w_down.shape)}: expected gate and "
                         f"up [I, H], down [H, I], x [M, H]")
    return _SwiGLUMLP.apply(x, local_shards, tok, compute_dtype, w_gate, w_up, w_down)
