"""Ad-hoc probe (not a benchmark of record): paged decode attention time at qwen3-0.6b heads."""
import json, os, sys, time
import torch
from rlkernel.kernels import triton_attention as ta

def med(f, n=20):
    for _ in range(3): f()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); f(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    ts.sort(); return ts[len(ts)//2]

out = []
dev = "cuda"
for S, ctx in ((256, 32), (256, 1024), (128, 2048), (16, 1024)):
    hq, hkv, d, B = 16, 8, 128, ta.KV_BLOCK
    nb = -(-ctx // B)
    pool = S * nb + 1
    kp = torch.randn(pool, B, hkv, d, device=dev, dtype=torch.bfloat16)
    vp = torch.randn_like(kp)
    table = torch.randperm(pool - 1, device=dev)[:S * nb].view(S, nb)
    q = torch.randn(S, hq, 1, d, device=dev, dtype=torch.bfloat16)
    qpos = torch.full((S, 1), ctx - 1, device=dev, dtype=torch.long)
    kvl = torch.full((S,), ctx, device=dev, dtype=torch.long)
    t_paged = med(lambda: ta.paged_attention_forward(q, kp, vp, table, qpos, kvl, 0.088))
    row = dict(S=S, ctx=ctx, paged_ms=t_paged, kv_gb=S*ctx*hkv*d*2*2/1e9)
    for tile in ((16, 1, 1), (16, 2, 1), (16, 2, 2), (16, 4, 2), (16, 4, 3), (16, 8, 2), (32, 4, 2), (32, 4, 3), (32, 8, 3), (64, 4, 2)):
        try:
            t = med(lambda: ta.paged_attention_forward(q, kp, vp, table, qpos, kvl, 0.088, tile=tile))
            o1 = ta.paged_attention_forward(q, kp, vp, table, qpos, kvl, 0.088)[0]
            o2 = ta.paged_attention_forward(q, kp, vp, table, qpos, kvl, 0.088, tile=tile)[0]
            row[f"tile{tile}"] = (t, bool(torch.equal(o1.view(torch.int16), o2.view(torch.int16))))
        except Exception as e:
            row[f"tile{tile}"] = repr(e)[:200]
    k = kp[table].flatten(1, 2).transpose(1, 2).contiguous(); v = vp[table].flatten(1, 2).transpose(1, 2).contiguous()
    import torch.nn.functional as F
    row["sdpa_dense_ms"] = med(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    print(json.dumps(row), flush=True)
    out.append(row)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "probe_decode.json"), "w"), indent=1)
