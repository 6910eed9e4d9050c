"""Hopper benchmark of the Gluon kernel's prefill against the Triton prefill (GPU only).

``python -m sparse_mla.gluon.benchmark`` checks both against the fp32 reference on a small
call, then times DSv4 CSA-like workloads (T tokens, top-k compressed rows + 128 window rows,
pool of T/4 compressed + T window rows inside a >2 GiB buffer) with
``triton.testing.do_bench(return_mode="median")`` and prints one CSV row per (kernel, shape).
"""

from __future__ import annotations

import sys

import torch
import triton

from ..prefill import sparse_mla_prefill
from ..reference import check_against_reference
from .launch import mla_gluon


def csa_workload(T: int, H: int, topk: int, *, window: int = 128, seed: int = 0):
    """q [T, H, 512], kv [T//4 + T, 512] inside a >2 GiB buffer, CSR slots per token."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n_comp = T // 4
    N = n_comp + T
    buf = torch.empty((2**31 // 1024 + N + 1024, 512), dtype=torch.bfloat16, device="cuda")
    kv = buf[1024 : 1024 + N]
    kv.normal_(generator=g)
    q = torch.randn(T, H, 512, device="cuda", generator=g).to(torch.bfloat16)
    pos = torch.arange(T, device="cuda")
    n_c = torch.clamp((pos + 1) // 4, max=topk)
    n_w = torch.clamp(pos + 1, max=window)
    lengths = n_c + n_w
    indptr = torch.zeros(T + 1, dtype=torch.int32, device="cuda")
    indptr[1:] = torch.cumsum(lengths, 0)
    nnz = int(indptr[-1])
    tok = torch.repeat_interleave(pos, lengths)
    j = torch.arange(nnz, device="cuda") - indptr[:-1].long()[tok]
    comp = (torch.rand(nnz, device="cuda", generator=g) * ((pos[tok] + 1) // 4).clamp(min=1)).long()
    win = n_comp + pos[tok] - (j - n_c[tok])
    idx = torch.where(j < n_c[tok], comp, win).to(torch.int32)
    return q, kv, idx, indptr


def _gluon_call(args, sink):
    q, kv, idx, indptr, scale = args
    return lambda: mla_gluon(
        q, None, kv, None, idx, indptr, scale, has_pe=False, attn_sink=sink, num_kv_splits=1
    )


def _triton_call(args, sink):
    return lambda: sparse_mla_prefill(*args, attn_sink=sink)


def main(argv=None) -> int:
    print("kernel,device,triton,T,H,topk,ms,tflops,check")
    dev = torch.cuda.get_device_name()
    for H, topk in ((64, 512), (128, 1024), (64, 1024), (128, 512)):
        T = 4096
        q, kv, idx, indptr = csa_workload(T, H, topk)
        sink = torch.randn(H, device="cuda")
        scale = 512**-0.5
        nnz = idx.numel()
        flop = 4.0 * nnz * H * 512
        args = (q, kv, idx, indptr, scale)
        fns = {"gluon": _gluon_call(args, sink), "triton": _triton_call(args, sink)}
        for name, fn in fns.items():
            out = fn()
            rep = check_against_reference(out[:256].float(), q[:256], kv, idx[: int(indptr[256])],
                                          indptr[:257], scale, attn_sink=sink)  # fmt: skip
            ms = triton.testing.do_bench(fn, return_mode="median")
            print(f"{name},{dev},{triton.__version__},{T},{H},{topk},{ms:.3f},"
                  f"{flop / ms / 1e9:.1f},{'ok' if rep.ok else 'FAIL ' + str(rep)}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
