"""GPU probe for the sm90 prefill kernels: correctness edge cases, then same-run timing.

Run on an H200 from the repository root (FlashMLA's stand-in on PYTHONPATH when present):
    PYTHONPATH=.:.peers python3 experiments/ws_probe.py --out $OUT/probe.csv
Checks every Gluon prefill kernel against the fp32 reference on small edge-case inputs
(ragged lists, absent slots of every kind, duplicates, empty tokens, NaN-poisoned unused rows,
int32/int64 ids, sink on/off, H 64 and 128), then times them, the Triton kernel and FlashMLA
(when importable) on DSv4 CSA at T=16384 with the bf16 matmul ceiling measured in the same run.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import sys
import time

import torch
import triton

from sparse_mla import sparse_mla_prefill, workloads
from sparse_mla.gluon import mla_gluon
from sparse_mla.reference import check_against_reference

KERNELS = ("gluon_ws", "gluon_wgmma")  # registry names, each at its default launch
# --small: the H <= 16 kernel (heads on wgmma's N) against the Triton kernel and FlashMLA with
# q zero-padded to 64 heads.
KERNELS_SMALL = ("gluon_ws_small",)


def gluon_call(kernel):
    """The Gluon kernel ``kernel`` (a registry name) at its default launch."""

    def call(w, out=None):
        return mla_gluon(
            w.q, None, w.kv, None, w.kv_indices, w.kv_indptr, w.softmax_scale,
            has_pe=False, attn_sink=w.attn_sink, out=out, kernel=kernel,
        )  # fmt: skip

    return call


def triton_call(w, out=None):
    return sparse_mla_prefill(*w.args(), attn_sink=w.attn_sink, out=out)


def logger(path):
    """say(msg): print ``msg`` and append it to the log at ``path``."""

    def say(msg):
        print(msg, flush=True)
        with open(path, "a") as log:
            log.write(msg + "\n")

    return say


def edge_workload(H, index_dtype, sink, seed):
    """Ragged CSR over a NaN-poisoned pool: absent slots of every kind, duplicates, empty rows."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    T, N, D = 37, 700, 512
    buf = torch.full((N + 4096, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    kv = buf[2048 : 2048 + N]
    used = torch.randperm(N, generator=g, device="cuda")[: N // 2]
    kv[used] = torch.randn(used.numel(), D, generator=g, device="cuda").to(torch.bfloat16)
    lens = torch.randint(0, 300, (T,), generator=g, device="cuda")
    lens[3] = 0
    lens[10] = 0
    lens[11] = 64
    lens[12] = 65
    lens[13] = 128
    lens[14] = 1
    ptr = torch.zeros(T + 1, dtype=torch.int64, device="cuda")
    ptr[1:] = lens.cumsum(0)
    nnz = int(ptr[-1])
    idx = used[torch.randint(0, used.numel(), (nnz,), generator=g, device="cuda")].to(torch.int64)
    bad = torch.rand(nnz, generator=g, device="cuda") < 0.1
    sentinels = torch.tensor([-1, N, 2**31 - 1, -(2**40), 2**33], device="cuda")
    pick = sentinels[torch.randint(0, 5 if index_dtype == torch.int64 else 3, (nnz,), generator=g,
                                   device="cuda")]  # fmt: skip
    idx = torch.where(bad, pick, idx)
    s, e = int(ptr[20]), int(ptr[21])
    if e - s > 4:
        idx[s + 1 : e : 2] = idx[s]  # duplicates
    # Token 30: nothing valid at all.
    s, e = int(ptr[30]), int(ptr[31])
    idx[s:e] = -1
    q = torch.randn(T, H, D, generator=g, device="cuda").to(torch.bfloat16)
    snk = torch.randn(H, generator=g, device="cuda") if sink else None
    return workloads.Workload(
        "edge", q, kv, idx.to(index_dtype), ptr.to(index_dtype), D**-0.5, snk, {"T": T, "H": H}
    )


def check_edges(say, calls, heads):
    """Every ``calls`` entry (name -> call(w, out=)) on the edge workloads at ``heads``."""
    ok_all = True
    for name, call in calls.items():
        for H in heads:
            for index_dtype in (torch.int32, torch.int64):
                for sink in (True, False):
                    w = edge_workload(H, index_dtype, sink, seed=H + sink)
                    out = torch.full_like(w.q, float("nan"))
                    call(w, out=out)
                    torch.cuda.synchronize()
                    rep = check_against_reference(out, *w.args(), attn_sink=w.attn_sink)
                    empty = (w.kv_indptr[1:] == w.kv_indptr[:-1]).nonzero().flatten()
                    zero_ok = bool((out[empty] == 0).all()) and bool((out[30] == 0).all())
                    out2 = torch.full_like(w.q, float("nan"))
                    call(w, out=out2)
                    same = torch.equal(out, out2)
                    ok = rep.ok and zero_ok and same
                    ok_all &= ok
                    say(f"check {name} H{H} {index_dtype} sink={sink}: {rep} zeros={zero_ok} "
                        f"repeat_bitwise={same}")  # fmt: skip
    return ok_all


def dense_for_flashmla(w):
    lens = (w.kv_indptr[1:] - w.kv_indptr[:-1]).to(torch.int64)
    width = int(-(-int(lens.max()) // 128) * 128)
    T = lens.numel()
    col = torch.arange(width, device="cuda")[None]
    pos = w.kv_indptr[:-1].to(torch.int64)[:, None] + col
    m = col < lens[:, None]
    idx = torch.where(m, w.kv_indices.to(torch.int64)[pos.clamp(max=w.kv_indices.numel() - 1)], -1)
    return idx.to(torch.int32).view(T, 1, width), lens.to(torch.int32)


def flashmla_call(w):
    """FlashMLA's sparse prefill on workload ``w`` (q zero-padded to 64 heads when H < 64): a
    call(w, out=) like the package's providers; its dense [T, 1, width] ids are built once."""
    import flash_mla

    H = w.q.shape[1]
    idx3, tl = dense_for_flashmla(w)
    kv3 = w.kv.view(-1, 1, 512)
    pad = max(64, H)
    qp = torch.zeros(w.q.shape[0], pad, 512, dtype=w.q.dtype, device="cuda")
    qp[:, :H] = w.q
    sp = torch.zeros(pad, dtype=torch.float32, device="cuda")
    sp[:H] = w.attn_sink

    def call(w, out=None):
        o = flash_mla.flash_mla_sparse_fwd(
            qp, kv3, idx3, w.softmax_scale, d_v=512, attn_sink=sp, topk_length=tl
        )[0][:, :H]
        if out is not None:
            out.copy_(o)
        return o

    return call


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--small", action="store_true", help="the H <= 16 kernel and workloads")
    args = ap.parse_args()
    log_path = os.path.splitext(args.out)[0] + ".log"

    say = logger(log_path)
    dev = torch.cuda.get_device_name()
    say(f"{dev} torch {torch.__version__} triton {triton.__version__} {datetime.datetime.now()}")
    kernels = KERNELS_SMALL if args.small else KERNELS
    if not args.skip_checks:
        heads = (1, 8, 16) if args.small else (64, 128)
        calls = {n: gluon_call(n) for n in kernels}
        say(f"edge checks: {'ALL OK' if check_edges(say, calls, heads) else 'FAILURES'}")

    try:
        import flash_mla

        have_fm = hasattr(flash_mla, "flash_mla_sparse_fwd")
    except ImportError as e:
        say(f"flashmla: not importable ({e})")
        have_fm = False

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda a=a, b=b: a @ b, return_mode="median")
    mm = 2 * 8192**3 / ms / 1e9
    say(f"matmul ceiling {mm:.0f} TFLOP/s")
    del a, b

    rows = []
    if args.small:
        cases = [("csa", 16, 512), ("csa", 8, 512), ("glm", 16, 2048)]
    else:
        cases = [("csa", 64, 512), ("csa", 128, 1024)]
    for kind, H, topk in cases:
        if kind == "glm":
            w = workloads.glm_full_topk(
                args.tokens, H, topk=topk, device="cuda", big_buffer=True, seed=1, sink=True
            )
        else:
            w = workloads.dsv4_csa(
                args.tokens, H, topk=topk, device="cuda", big_buffer=True, seed=1
            )
        w.kv.normal_()
        flops = w.flops()
        provs = {n: gluon_call(n) for n in kernels}
        provs["triton"] = triton_call
        if have_fm:
            provs["flashmla" if H >= 64 else "flashmla_pad64"] = flashmla_call(w)
        for name, call in provs.items():
            try:
                out = torch.full_like(w.q, float("nan"))
                t0 = time.time()
                call(w, out=out)
                torch.cuda.synchronize()
                first = time.time() - t0
                sl = slice(0, args.tokens, max(1, args.tokens // 512))
                rep = check_against_reference(
                    out[sl].contiguous(), w.q[sl].contiguous(), w.kv, *_csr_rows(w, sl),
                    w.softmax_scale, attn_sink=w.attn_sink,
                )  # fmt: skip
                ms = triton.testing.do_bench(lambda call=call, w=w: call(w), return_mode="median")
                tf = flops / ms / 1e9
                say(f"{kind} H{H} topk{topk} {name}: {ms:.3f} ms {tf:.0f} TFLOP/s "
                    f"({tf / mm:.2f} of matmul) check {rep} first call {first:.1f}s")  # fmt: skip
                rows.append(dict(workload=f"{kind}_H{H}_topk{topk}", T=args.tokens, H=H,
                                 provider=name, ms=round(ms, 4), tflops=round(tf, 1),
                                 matmul_tflops=round(mm, 1), check=str(rep.ok), device=dev,
                                 torch=torch.__version__, triton=triton.__version__))  # fmt: skip
            except Exception as e:  # a failing provider must not end the run
                say(f"H{H} {name}: FAILED {type(e).__name__}: {e}")
        del w
        torch.cuda.empty_cache()
    with open(args.out, "a", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        if f.tell() == 0:
            wr.writeheader()
        wr.writerows(rows)
    return 0


def _csr_rows(w, sl):
    ptr = w.kv_indptr.to(torch.int64)
    toks = torch.arange(w.q.shape[0], device=ptr.device)[sl]
    lens = ptr[toks + 1] - ptr[toks]
    new_ptr = torch.zeros(toks.numel() + 1, dtype=torch.int64, device=ptr.device)
    new_ptr[1:] = lens.cumsum(0)
    pieces = [w.kv_indices[int(ptr[t]) : int(ptr[t + 1])] for t in toks.tolist()]
    return torch.cat(pieces), new_ptr.to(w.kv_indptr.dtype)


if __name__ == "__main__":
    sys.exit(main())
