"""Invariant Triton attention (fixed 64-key blocks at absolute positions) vs stock SDPA.

Qwen3-8B heads: 32 query / 8 KV heads, head_dim 128, bf16. Prefill: one causal sequence of 2k and
8k tokens. Decode: batch 64, one new token against a 2k / 4k / 8k KV cache. Ratio = SDPA time /
ours (>= 1: ours faster). SDPA gets GQA natively (enable_gqa) when its flash path accepts it,
otherwise K/V expanded beforehand (outside the timing). Also one fp32 row (the model's path).
Backward (kernels/triton_attention_bwd.py), one causal sequence of 1k / 4k / 8k tokens: ours in
fp32 (the model's path) and bf16, given the forward's out/lse, vs SDPA flash's bf16 backward
(autograd.grad of its output, forward outside the timing); the same for Qwen3-0.6B heads (16 / 8)
at 1k and 4k with the previous torch-op backward (kernels/attention.attention_backward on the GPU)
where it fits; a dQ-tile / dK-dV-tile sweep at 4k bf16 (time, and bytes against the tables'
tiles); the time of the dQ and delta kernels alone. Rows
"backward ..." carry ratio = SDPA bf16 backward / ours and TFLOP/s at 2.5x the causal forward's
FLOPs (FlashAttention-2's count: 5 matmuls to the forward's 2) for both.
--fp32-sweep: only the model's fp32 forward at qwen3-0.6b heads (rollout prefill pieces, a
training batch, a decode step) for every tile of _FP32_SWEEP: time and bytes against the table's.
Run: PYTHONPATH=. python3 benchmarks/bench_attention.py [--out FILE.json] [--only-backward]
     [--fp32-sweep]
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.common import dump, env, median_ms, require_cuda

HQ, HKV, D = 32, 8, 128


def _sdpa(q, k, v, causal, backend=SDPBackend.FLASH_ATTENTION):
    """A timed SDPA closure and how GQA was handled."""
    try:
        with sdpa_kernel(backend):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

        def f():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        return f, "enable_gqa"
    except RuntimeError:
        g = q.shape[1] // k.shape[1]
        kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)

        def f():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, kr, vr, is_causal=causal)
        return f, "expanded"


def _sdpa_bwd(q, k, v, d_out):
    """A timed closure of SDPA flash's backward (bf16, causal) on a retained graph, and how GQA
    was handled."""
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        try:
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            out, how = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True,
                                                      enable_gqa=True), "enable_gqa"
            torch.autograd.grad(out, (qq, kk, vv), d_out, retain_graph=True)
        except RuntimeError:
            g = q.shape[1] // k.shape[1]
            qq, kk, vv = (t.detach().requires_grad_() for t in
                          (q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)))
            out, how = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True), "expanded"

    def f():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.autograd.grad(out, (qq, kk, vv), d_out, retain_graph=True)
    return f, how


def _bwd_case(hq, hkv, t, dtype):
    """Inputs of one causal sequence and the forward's out/lse: (q, k, v, pos, lens, out, lse, dO)."""
    from rlkernel.kernels.triton_attention import attention_forward
    q = torch.randn(1, hq, t, D, device="cuda").to(dtype)
    k = torch.randn(1, hkv, t, D, device="cuda").to(dtype)
    v = torch.randn(1, hkv, t, D, device="cuda").to(dtype)
    pos = torch.arange(t, device="cuda")[None]
    lens = torch.tensor([t], device="cuda")
    out, lse = attention_forward(q, k, v, pos, lens, 1 / math.sqrt(D))
    return q, k, v, pos, lens, out, lse, torch.randn(out.shape, device="cuda").to(dtype)


def _timed(fn, rep_ms=200):
    """median ms of fn, or None (and the error printed) when it fails (e.g. out of memory)."""
    try:
        return median_ms(fn, rep_ms=rep_ms)
    except Exception as e:  # noqa: BLE001 - a benchmark row, reported
        print(f"   error {repr(e)[:150]}", flush=True)
        torch.cuda.empty_cache()
        return None


def _first_pass_flagged(tb, q, k, v, out, lse, dout, pos, lens, sc) -> float:
    """Fraction of dK/dV programs whose first-pass word was inexact (they pay the checked retry
    on top): a property of the data, so the rows say what the timed case cost."""
    seen, real = [], tb._launch_dkv

    def spy(*a, **kw):
        real(*a, **kw)
        if not a[12] and not (a[14] if len(a) > 14 else kw.get("retry", False)):
            seen.append((int(a[2].sum()), a[2].numel()))

    tb._launch_dkv = spy
    try:
        tb.attention_backward(q, k, v, out, lse, dout, pos, lens, sc)
    finally:
        tb._launch_dkv = real
    return sum(f for f, _ in seen) / max(1, sum(n for _, n in seen))


def backward_rows(dtypes=("fp32", "bf16"), sweep: bool = True) -> list[dict]:
    """The backward rows (module doc): ours fp32/bf16 vs SDPA flash bf16, old torch backward."""
    from rlkernel.distributed.tokensum import TokenSum
    from rlkernel.kernels import attention as ref_attention
    from rlkernel.kernels import triton_attention_bwd as tb
    sc = 1 / math.sqrt(D)
    rows = []
    for hq, hkv, lengths in ((HQ, HKV, (1024, 4096, 8192)), (16, 8, (1024, 4096))):
        for t in lengths:
            flops = 2.5 * 4.0 * hq * D * t * (t + 1) / 2
            bf = _bwd_case(hq, hkv, t, torch.bfloat16)
            f_ref, how = _sdpa_bwd(bf[0], bf[1], bf[2], bf[7])
            t_ref = _timed(f_ref)
            row = {"case": f"backward {t} heads {hq}/{hkv}", "sdpa_bf16_ms": t_ref, "sdpa": how}
            for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
                if name not in dtypes:
                    continue
                q, k, v, pos, lens, out, lse, dout = bf if dtype == torch.bfloat16 else \
                    _bwd_case(hq, hkv, t, dtype)
                ms = _timed(lambda: tb.attention_backward(q, k, v, out, lse, dout, pos, lens, sc))
                row[f"ours_{name}_ms"] = ms
                if ms and t_ref:
                    row[f"ratio_{name}"] = t_ref / ms
                    row[f"ours_{name}_tflops"] = flops / ms / 1e9
                row[f"first_pass_flagged_{name}"] = _first_pass_flagged(
                    tb, q, k, v, out, lse, dout, pos, lens, sc)
                row[f"dq_and_delta_{name}_ms"] = _timed(lambda: tb._dq(
                    q, k, v, dout, lse.reshape(1, hq, t), tb._delta(out, dout, pos), pos,
                    lens, sc, None))
                if name == "fp32":
                    if hq == 16:   # the CUDA path before this kernel (qwen3-0.6b's heads)
                        tok = TokenSum.single()
                        row["old_torch_fp32_ms"] = _timed(lambda: ref_attention.attention_backward(
                            q, k, v, out, lse, dout, pos, lens, sc, tok, None), rep_ms=1)
                    del q, k, v, out, lse, dout
                    torch.cuda.empty_cache()
            if t_ref:
                row["sdpa_bf16_tflops"] = flops / t_ref / 1e9
            rows.append(row)
            print(row, flush=True)
    if not sweep:
        return rows
    q, k, v, pos, lens, out, lse, dout = _bwd_case(HQ, HKV, 4096, torch.bfloat16)
    ref = tb.attention_backward(q, k, v, out, lse, dout, pos, lens, sc)
    for kw in [{"dq_tile": c} for c in ((64, 4, 1), (64, 8, 1), (128, 8, 1), (64, 8, 2))] + \
              [{"kv_tile": c} for c in ((64, 128, 4, 1), (64, 128, 4, 2), (64, 128, 8, 1),
                                        (128, 128, 8, 1), (128, 128, 8, 2), (128, 64, 4, 1),
                                        (128, 64, 8, 1), (128, 128, 4, 1), (128, 128, 16, 1),
                                        # spill-free as launched at D = 128 (ptxas, CPU):
                                        (32, 128, 4, 1), (64, 64, 4, 1))]:
        try:
            got = tb.attention_backward(q, k, v, out, lse, dout, pos, lens, sc, **kw)
            same = all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                       for a, b in zip(got, ref))
            ms = _timed(lambda: tb.attention_backward(q, k, v, out, lse, dout, pos, lens, sc,
                                                      **kw), rep_ms=100)
        except Exception as e:  # noqa: BLE001  (a tile that does not compile or fit)
            rows.append({"case": f"backward sweep 4096 bf16 {kw}", "error": repr(e)[:200]})
            continue
        rows.append({"case": f"backward sweep 4096 bf16 {kw}", "ours_bf16_ms": ms,
                     "same_bytes": same})
        print(f"   {kw}: {ms} ms same bytes {same}", flush=True)
    return rows


_FP32_SWEEP = [(bm, w, st) for bm in (16, 32, 64, 128) for w in (4, 8) for st in (1, 2, 3)]


def _fp32_case(s: int, tq: int, ctx: int, hq: int = 16, hkv: int = 8):
    """fp32 q [s, hq, tq, D] at the last tq positions of ctx keys per sample (qwen3-0.6b heads:
    a rollout prefill piece, a training sample or a decode step)."""
    q = torch.randn(s, hq, tq, D, device="cuda")
    k = torch.randn(s, hkv, ctx, D, device="cuda")
    v = torch.randn(s, hkv, ctx, D, device="cuda")
    pos = torch.arange(ctx - tq, ctx, device="cuda")[None].expand(s, tq).contiguous()
    lens = torch.full((s,), ctx, device="cuda")
    return q, k, v, pos, lens


def fp32_tile_sweep() -> list[dict]:
    """The model's fp32 forward (fma dots) at three shapes, for every tile of _FP32_SWEEP: time
    and whether out and lse are byte-identical to the table's tile (they must be: the fp32 dot
    is one fma chain per element in key order, whatever the tile)."""
    from rlkernel.kernels.triton_attention import attention_forward
    sc = 1 / math.sqrt(D)
    rows = []
    for name, shape in (("prefill pieces 128 x 64 q, ctx 512", (128, 64, 512)),
                        ("training 16 x 1024 causal", (16, 1024, 1024)),
                        ("decode 256 x 1 q, ctx 1024", (256, 1, 1024))):
        q, k, v, pos, lens = _fp32_case(*shape)
        ref_out, ref_lse = attention_forward(q, k, v, pos, lens, sc)
        t_ref = median_ms(lambda: attention_forward(q, k, v, pos, lens, sc), rep_ms=100)
        print(f"{name}: table tile {t_ref:.3f} ms", flush=True)
        for cfg in _FP32_SWEEP:
            try:
                out, lse = attention_forward(q, k, v, pos, lens, sc, tile=cfg)
                same = bool(torch.equal(out.view(torch.int32), ref_out.view(torch.int32))
                            and torch.equal(lse.view(torch.int32), ref_lse.view(torch.int32)))
                ms = median_ms(lambda: attention_forward(q, k, v, pos, lens, sc, tile=cfg),
                               rep_ms=60)
            except Exception as e:  # noqa: BLE001  (a tile that does not compile or fit)
                rows.append({"case": name, "tile": cfg, "error": repr(e)[:200]})
                continue
            rows.append({"case": name, "tile": cfg, "ms": ms, "table_ms": t_ref,
                         "speedup": t_ref / ms, "same_bytes": same})
            print(f"   tile {cfg}: {ms:.3f} ms x{t_ref / ms:.2f} same bytes {same}", flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--only-backward", action="store_true")
    ap.add_argument("--fp32-sweep", action="store_true",
                    help="only the fp32 forward tile sweep at the model's shapes")
    ap.add_argument("--dtypes", default="fp32,bf16", help="backward: which of ours to time")
    ap.add_argument("--no-sweep", action="store_true", help="backward: skip the tile sweep")
    args = ap.parse_args()
    require_cuda()
    from rlkernel.kernels.triton_attention import attention_forward
    torch.manual_seed(0)
    if args.fp32_sweep:
        dump(args.out, {"env": env(), "rows": fp32_tile_sweep()})
        return
    if args.only_backward:
        dump(args.out, {"env": env(), "rows": backward_rows(args.dtypes.split(","),
                                                            not args.no_sweep)})
        return
    rows = []
    sc = 1 / math.sqrt(D)
    for t in (2048, 8192):
        q = torch.randn(1, HQ, t, D, device="cuda").bfloat16()
        k = torch.randn(1, HKV, t, D, device="cuda").bfloat16()
        v = torch.randn(1, HKV, t, D, device="cuda").bfloat16()
        pos = torch.arange(t, device="cuda")[None]
        lens = torch.tensor([t], device="cuda")
        f_ref, how = _sdpa(q, k, v, True)
        t_ref = median_ms(f_ref)
        t_inv = median_ms(lambda: attention_forward(q, k, v, pos, lens, sc))
        flops = 4.0 * HQ * D * t * (t + 1) / 2
        for cfg in ((128, 8, 3), (64, 4, 2), (64, 4, 3), (128, 4, 2)):
            try:
                tv = median_ms(lambda: attention_forward(q, k, v, pos, lens, sc, tile=cfg), rep_ms=100)
                print(f"   tile {cfg}: {tv:.3f} ms x{t_ref / tv:.3f}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"   tile {cfg}: error {repr(e)[:150]}", flush=True)
        rows.append({"case": f"prefill {t}", "sdpa_ms": t_ref, "ours_ms": t_inv, "sdpa": how,
                     "ratio": t_ref / t_inv, "ours_tflops": flops / t_inv / 1e9,
                     "sdpa_tflops": flops / t_ref / 1e9})
        print(f"prefill T={t}: SDPA flash ({how}) {t_ref:.3f} ms | ours {t_inv:.3f} ms "
              f"x{t_ref / t_inv:.3f} ({flops / t_inv / 1e9:.0f} TFLOP/s)", flush=True)
    for ctx in (2048, 4096, 8192):
        b = 64
        q = torch.randn(b, HQ, 1, D, device="cuda").bfloat16()
        k = torch.randn(b, HKV, ctx, D, device="cuda").bfloat16()
        v = torch.randn(b, HKV, ctx, D, device="cuda").bfloat16()
        pos = torch.full((b, 1), ctx - 1, device="cuda")
        lens = torch.full((b,), ctx, device="cuda")
        f_ref, how = _sdpa(q, k, v, False)
        t_ref = median_ms(f_ref)
        t_inv = median_ms(lambda: attention_forward(q, k, v, pos, lens, sc))
        gb = 2.0 * b * HKV * ctx * D * 2 / 1e9
        rows.append({"case": f"decode b64 ctx{ctx}", "sdpa_ms": t_ref, "ours_ms": t_inv,
                     "sdpa": how, "ratio": t_ref / t_inv, "ours_TBps": gb / t_inv})
        print(f"decode b=64 ctx={ctx}: SDPA flash ({how}) {t_ref:.3f} ms | ours {t_inv:.3f} ms "
              f"x{t_ref / t_inv:.3f} (KV read {gb / t_inv:.2f} TB/s)", flush=True)
    # fp32 (the model's invariant path) vs SDPA's fp32 memory-efficient kernel, prefill 2k
    t = 2048
    q = torch.randn(1, HQ, t, D, device="cuda")
    k = torch.randn(1, HKV, t, D, device="cuda")
    v = torch.randn(1, HKV, t, D, device="cuda")
    f_ref, how = _sdpa(q, k, v, True, SDPBackend.EFFICIENT_ATTENTION)
    t_ref = median_ms(f_ref)
    t_inv = median_ms(lambda: attention_forward(q, k, v, torch.arange(t, device="cuda")[None],
                                                torch.tensor([t], device="cuda"), sc))
    rows.append({"case": "prefill 2048 fp32", "sdpa_ms": t_ref, "ours_ms": t_inv, "sdpa": how,
                 "ratio": t_ref / t_inv})
    print(f"prefill fp32 T=2048: SDPA efficient ({how}) {t_ref:.3f} ms | ours {t_inv:.3f} ms "
          f"x{t_ref / t_inv:.3f}", flush=True)
    rows += backward_rows()
    dump(args.out, {"env": env(), "rows": rows})


if __name__ == "__main__":
    main()
