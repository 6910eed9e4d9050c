"""Quick timing of the Triton prefill over a small launch grid on DSv4 CSA-like inputs (GPU).

Self-contained (no workloads module) so it runs on a bare GPU machine with PYTHONPATH=.
Writes one CSV row per (workload, config) to --out.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import os
import sys
import time

import torch
import triton

from sparse_mla import sparse_mla_prefill
from sparse_mla.reference import check_against_reference


def csa_inputs(T, H, topk, window=128, ratio=4, D=512, seed=0, dtype=torch.bfloat16):
    """One request of T tokens: compressed rows [0, C), window rows [C, C + T) in one pool
    placed inside a >2 GiB buffer; token p sees min((p+1)//ratio, topk) compressed rows
    (random among the visible ones) and its last min(p+1, window) tokens."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    C = T // ratio
    N = C + T
    buf = torch.empty((3 << 30) // (D * 2), D, dtype=dtype, device="cuda")  # 3 GiB
    off = buf.shape[0] - N - 1000
    kv = buf[off : off + N]
    kv.normal_(generator=g)
    q = torch.randn(T, H, D, device="cuda", dtype=dtype, generator=g)
    p = torch.arange(T, device="cuda")
    visible = (p + 1) // ratio
    ncomp = visible.clamp(max=topk)
    scores = torch.rand(T, max(C, 1), device="cuda", generator=g)
    scores = torch.where(torch.arange(C, device="cuda")[None] < visible[:, None], scores, -1.0)
    top = scores.topk(min(topk, C), dim=1).indices
    top = torch.where(torch.arange(top.shape[1], device="cuda")[None] < ncomp[:, None], top, -1)
    wcount = (p + 1).clamp(max=window)
    wcol = torch.arange(window, device="cuda")
    wslot = C + p[:, None] - (wcount[:, None] - 1) + wcol[None]
    wslot = torch.where(wcol[None] < wcount[:, None], wslot, -1)
    dense = torch.cat([top, wslot], dim=1)
    mask = dense >= 0
    lengths = mask.sum(1)
    idx = dense[mask].to(torch.int32)
    ptr = torch.zeros(T + 1, dtype=torch.int32, device="cuda")
    ptr[1:] = lengths.cumsum(0)
    sink = torch.randn(H, device="cuda", generator=g)
    return q, kv, idx, ptr, D**-0.5, sink


def _append_csv(path, row):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(row))
        if new:
            wr.writeheader()
        wr.writerow(row)


def _time(q, kv, idx, ptr, scale, sink, cfg):
    def fn():
        sparse_mla_prefill(q, kv, idx, ptr, scale, attn_sink=sink, config=cfg)

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def glm_inputs(T, H, topk=2048, D=512, seed=0, dtype=torch.bfloat16):
    """GLM-style full top-k over the prompt: token p sees min(p+1, topk) of rows [0, p]."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    buf = torch.empty((3 << 30) // (D * 2), D, dtype=dtype, device="cuda")
    kv = buf[1000 : 1000 + T]
    kv.normal_(generator=g)
    q = torch.randn(T, H, D, device="cuda", dtype=dtype, generator=g)
    p = torch.arange(T, device="cuda")
    lengths = (p + 1).clamp(max=topk)
    ptr = torch.zeros(T + 1, dtype=torch.int64, device="cuda")
    ptr[1:] = lengths.cumsum(0)
    tok = torch.repeat_interleave(p, lengths)
    r = torch.rand(tok.numel(), device="cuda", generator=g)
    # Random distinct-enough rows among [0, p] (duplicates are allowed by the operator).
    idx = (r * (tok + 1)).long().clamp(max=T - 1)
    full = lengths == (p + 1)  # short prefixes see every row exactly once
    pos = torch.arange(tok.numel(), device="cuda") - ptr[:-1][tok]
    idx = torch.where(full[tok], pos, idx).to(torch.int32)
    sink = torch.randn(H, device="cuda", generator=g)
    return q, kv, idx, ptr.to(torch.int32), D**-0.5, sink


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/perf_probe.csv")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    dev = torch.cuda.get_device_name()
    works = [("csa_h16_topk512", 16, 512), ("csa_h8_topk512", 8, 512),
             ("csa_h64_topk512", 64, 512), ("csa_h128_topk1024", 128, 1024),
             ("glm_h16_topk2048", 16, 2048)]  # fmt: skip
    grid = list(itertools.product([16, 32, 64], [16, 32, 64], [4, 8], [2], [False, True]))
    if args.quick:
        grid = [(16, 32, 4, 2, False), (64, 16, 8, 2, False), (64, 32, 8, 2, False)]
    rows = []
    for name, H, topk in works:
        make = glm_inputs if name.startswith("glm") else csa_inputs
        q, kv, idx, ptr, scale, sink = make(args.tokens, H, topk)
        # Correctness gate on a slice of tokens (the reference on 16k tokens x 1152 slots is slow).
        out = sparse_mla_prefill(q, kv, idx, ptr, scale, attn_sink=sink)
        sl = slice(args.tokens - 256, args.tokens)
        sub_ptr = ptr[sl.start : sl.stop + 1] - ptr[sl.start]
        sub_idx = idx[int(ptr[sl.start]) : int(ptr[sl.stop])]
        rep = check_against_reference(out[sl], q[sl], kv, sub_idx, sub_ptr, scale, attn_sink=sink)
        print(name, "default launch:", rep, flush=True)
        nnz = idx.numel()
        for bh, bk, w, s, pf in grid:
            if bh > max(16, triton.next_power_of_2(H)) or (H >= 64 and bh == 16):
                continue
            cfg = dict(BLOCK_H=bh, BLOCK_K=bk, num_warps=w, num_stages=s, PREFETCH_KV=pf)
            t0 = time.time()
            try:
                o2 = sparse_mla_prefill(q, kv, idx, ptr, scale, attn_sink=sink, config=cfg)
                torch.cuda.synchronize()
                ok = torch.allclose(o2.float(), out.float(), atol=3e-2, rtol=3e-2)
                ms = _time(q, kv, idx, ptr, scale, sink, cfg)
            except Exception as e:
                print(name, cfg, "ERROR", repr(e)[:200], flush=True)
                continue
            flops = 4.0 * nnz * H * 512
            row = dict(device=dev, torch=torch.__version__, triton=triton.__version__,
                       workload=name, T=args.tokens, H=H, nnz=nnz, **cfg, ok=ok, ms=round(ms, 4),
                       tflops=round(flops / ms / 1e9, 1),
                       gather_tbs=round(nnz * 1024 * triton.cdiv(H, bh) / ms / 1e9, 2),
                       compile_s=round(time.time() - t0, 1))  # fmt: skip
            rows.append(row)
            print(row, flush=True)
            _append_csv(args.out, row)
        q = kv = None
        torch.cuda.empty_cache()
    best = {}
    for r in rows:
        if r["ok"] and (r["workload"] not in best or r["ms"] < best[r["workload"]]["ms"]):
            best[r["workload"]] = r
    for k, r in best.items():
        print(f"BEST {k}: {r['ms']} ms BLOCK_H={r['BLOCK_H']} BLOCK_K={r['BLOCK_K']} "
              f"warps={r['num_warps']} stages={r['num_stages']} PF={r['PREFETCH_KV']} "
              f"{r['tflops']} TFLOP/s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
