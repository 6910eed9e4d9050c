"""Hopper benchmark of the Gluon kernel's prefill against the tuned Triton prefill (GPU only).

``python -m sparse_mla.gluon.benchmark [--T 16384] [--workloads csa_h64_topk512,...]`` builds
each named standard workload (``sparse_mla.workloads.by_name``, pool inside a >2 GiB buffer),
runs every provider once and checks its last 64 tokens (the longest slot lists) against the
fp32 reference, then times it with ``triton.testing.do_bench(return_mode="median")`` and
prints one CSV row per (provider, workload). Providers: the Triton prefill with its configs/
launch (``config=None``), the Gluon shared algorithm (mma.sync, ``wgmma=False``), the sm90
wgmma prefill kernel at a few ring shapes (BLOCK_K x stages) and ``gluon_default``
(``config=None``: what ``mla_gluon`` picks).
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton

from ..prefill import sparse_mla_prefill
from ..reference import check_against_reference
from ..workloads import by_name
from .launch import GluonConfig, mla_gluon

WORKLOADS = ("csa_h64_topk512", "csa_h128_topk1024")
GLUON_CONFIGS = {
    "gluon_default": None,
    "gluon_mma": GluonConfig(BLOCK_H=64, BLOCK_K=32, num_warps=8, wgmma=False),
    "gluon_wgmma_k32_s4": GluonConfig(BLOCK_H=64, BLOCK_K=32, num_warps=8, wgmma=True),
    "gluon_wgmma_k32_s3": GluonConfig(64, 32, 8, wgmma=True, num_stages=3),
    "gluon_wgmma_k64_s2": GluonConfig(64, 64, 8, wgmma=True, num_stages=2),  # the default
}


def _providers(w, names):
    q, kv, idx, indptr, scale = w.args()
    sink = w.attn_sink
    fns = {"triton": lambda: sparse_mla_prefill(q, kv, idx, indptr, scale, attn_sink=sink)}
    for name in names:
        cfg = GLUON_CONFIGS.get(name)
        fns[name] = lambda cfg=cfg: mla_gluon(
            q, None, kv, None, idx, indptr, scale, has_pe=False, attn_sink=sink,
            num_kv_splits=1, config=cfg,
        )  # fmt: skip
    return fns


def _check_tail(out, w, tail=64):
    """Error report of the last ``tail`` tokens (CSR rebased) against the fp32 reference."""
    q, kv, idx, indptr, scale = w.args()
    T = q.shape[0]
    a = T - tail
    lo, hi = int(indptr[a]), int(indptr[T])
    return check_against_reference(
        out[a:].float(), q[a:], kv, idx[lo:hi], indptr[a:] - indptr[a], scale,
        attn_sink=w.attn_sink,
    )  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sparse_mla.gluon.benchmark")
    ap.add_argument("--T", type=int, default=16384, help="tokens per call")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="standard workload names")
    ap.add_argument("--providers", default=",".join(GLUON_CONFIGS), help="Gluon variants")
    args = ap.parse_args(argv)
    names = [n for n in args.providers.split(",") if n]
    unknown = sorted(set(names) - set(GLUON_CONFIGS))
    if unknown:
        ap.error(f"unknown provider(s) {unknown}; known: {sorted(GLUON_CONFIGS)}")
    dev = torch.cuda.get_device_name()
    print("provider,device,triton,workload,T,H,ms,tflops,check", flush=True)
    for wname in args.workloads.split(","):
        w = by_name(wname, T=args.T, device="cuda", big_buffer=True)
        flop = w.flops()
        for name, fn in _providers(w, names).items():
            try:
                rep = _check_tail(fn(), w)
                ms = triton.testing.do_bench(fn, return_mode="median")
            except Exception as e:  # a variant that fails to compile or launch: report, go on
                print(f"{name},{dev},{triton.__version__},{wname},{args.T},{w.q.shape[1]},"
                      f"nan,nan,ERROR {type(e).__name__}: {e}", flush=True)  # fmt: skip
                continue
            check = "ok" if rep.ok else f"FAIL {rep}"
            print(f"{name},{dev},{triton.__version__},{wname},{args.T},{w.q.shape[1]},{ms:.3f},"
                  f"{flop / ms / 1e9:.1f},{check}", flush=True)  # fmt: skip
        del w
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
