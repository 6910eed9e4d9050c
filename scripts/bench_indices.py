"""Index packing vs the prefill kernel it feeds, on one DSv4-Pro CSA prefill request.

On a CUDA GPU (defaults): a 16k-token request (seq_len = q_len = 16384), ratio 4, topk 1024,
window 128, H=128, D=512, bf16, with sink. Packing must take well under 5% of the prefill
kernel's time for the same call (issue 3). Timings are ``triton.testing.do_bench`` medians.

    PYTHONPATH=. python3 scripts/bench_indices.py --out $OUT/bench_indices.csv

``--cpu`` runs tiny sizes through Triton's interpreter (timed with perf_counter medians), only
to check that the script works::

    .venv/bin/python scripts/bench_indices.py --cpu --out /tmp/bench_indices.csv

Correctness gates before any timing: the torch and Triton packings are identical, and the
prefill on the packed lists passes the fp32 reference check on the last tokens of the request
(the longest lists). The CSV gets one row per run (header written when the file is new).

Rows: ``combined_*`` is :func:`sparse_mla.indices.dsv4_combined_indices` from the engine's
top-k; ``dense_*`` is :func:`sparse_mla.indices.dense_to_csr` on the same lists laid out dense
[T, topk + window] with lengths. ``*_triton`` passes ``total`` (no host sync, no value checks);
``combined_triton_validated`` does not (it syncs to size the output and checks values).
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import os
import statistics
import sys
import time

import torch
import triton

from sparse_mla import indices as ix
from sparse_mla import runtime
from sparse_mla.prefill import sparse_mla_prefill
from sparse_mla.reference import check_against_reference

GPU_DEFAULTS = dict(tokens=16384, heads=128, head_dim=512, topk=1024, window=128, check_tokens=128)
CPU_DEFAULTS = dict(tokens=48, heads=16, head_dim=64, topk=16, window=8, check_tokens=16)


def build_request(T, ratio, topk, window, device, gen):
    """One prefill request from position 0: per-token top-k over the causal compressed rows."""
    C = T // ratio  # compressed rows of the whole request
    M = C + window + T  # pool block: compressed rows, then the linear window rows
    qsl = torch.tensor([0, T], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([T], dtype=torch.int32, device=device)
    pos = torch.arange(T, device=device)
    n_avail = torch.div(pos + 1, ratio, rounding_mode="floor")  # [T] causal compressed rows
    width = max(C, topk)
    scores = torch.rand(T, width, generator=gen, device=device)
    col = torch.arange(width, device=device)
    scores = scores.masked_fill(col[None, :] >= n_avail[:, None], -1.0)
    ids = scores.topk(topk, dim=1).indices.to(torch.int32)  # [T, topk], engine order
    ids = ids.masked_fill(torch.arange(topk, device=device)[None, :] >= n_avail[:, None], -1)
    return ids, qsl, seq_lens, C, M


def dense_form(kv_indices, kv_indptr, width):
    """The same lists as a dense [T, width] layout with -1 padding, plus lengths."""
    T = kv_indptr.numel() - 1
    lengths = (kv_indptr[1:] - kv_indptr[:-1]).long()
    col = torch.arange(width, device=kv_indices.device)
    keep = col[None, :] < lengths[:, None]
    dense = torch.full((T, width), -1, dtype=kv_indices.dtype, device=kv_indices.device)
    dense[keep] = kv_indices
    return dense, lengths


def make_timer(cpu, reps):
    if not cpu:
        return lambda fn: triton.testing.do_bench(fn, return_mode="median")

    def timer(fn):
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return timer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="tiny sizes in Triton's interpreter")
    p.add_argument("--out", help="CSV file to append one row to")
    p.add_argument("--tokens", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--topk", type=int)
    p.add_argument("--window", type=int)
    p.add_argument("--ratio", type=int, default=4)
    p.add_argument("--check-tokens", type=int, help="last tokens checked against fp32")
    p.add_argument("--reps", type=int, default=3, help="timed runs per item with --cpu")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        p.error("no CUDA GPU: pass --cpu for the tiny interpreter run")
    for k, v in (CPU_DEFAULTS if args.cpu else GPU_DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)

    device = "cpu" if args.cpu else "cuda"
    dtype = torch.float16 if args.cpu else torch.bfloat16
    T, H, D, ratio, topk, window = (
        args.tokens, args.heads, args.head_dim, args.ratio, args.topk, args.window,
    )  # fmt: skip
    gen = torch.Generator(device=device).manual_seed(args.seed)
    ids, qsl, seq_lens, C, M = build_request(T, ratio, topk, window, device, gen)
    layout = dict(ratio=ratio, topk=topk, window=window, pool_block_rows=M, num_compressed=C)

    # Packing: correctness gate, then the dense form of the same lists.
    idx_t, ptr_t = ix.dsv4_combined_indices(ids, qsl, seq_lens, **layout, impl="torch")
    idx_k, ptr_k = ix.dsv4_combined_indices(ids, qsl, seq_lens, **layout, impl="triton")
    nnz = idx_t.numel()
    assert torch.equal(idx_t, idx_k) and torch.equal(ptr_t, ptr_k), "torch != triton (combined)"
    dense, lengths = dense_form(idx_t, ptr_t, topk + window)
    d_idx_t, d_ptr_t = ix.dense_to_csr(dense, lengths, impl="torch")
    d_idx_k, d_ptr_k = ix.dense_to_csr(dense, lengths, total=nnz, impl="triton")
    assert torch.equal(d_idx_t, idx_t) and torch.equal(d_ptr_t.long(), ptr_t.long())
    assert torch.equal(d_idx_k, d_idx_t) and torch.equal(d_ptr_k, d_ptr_t), "torch != triton"

    # Prefill inputs; on a GPU the pool lives past 2 GiB inside a larger buffer, as in an engine.
    N = M
    if args.cpu:
        kv = torch.randn(N, D, generator=gen, device=device).to(dtype)
    else:
        skip = (2**31) // (D * dtype.itemsize) + 1
        buf = torch.empty(skip + N, D, dtype=dtype, device=device)
        kv = buf[skip:]
        kv.copy_(torch.randn(N, D, generator=gen, device=device))
    q = torch.randn(T, H, D, generator=gen, device=device).to(dtype)
    sink = torch.randn(H, generator=gen, device=device)
    scale = D**-0.5
    out = torch.full_like(q, float("nan"))

    t0 = T - min(args.check_tokens, T)
    s0 = int(ptr_k[t0])
    sl = slice(t0, T)
    ptr_s = ptr_k[t0:] - s0
    o_s = sparse_mla_prefill(q[sl], kv, idx_k[s0:], ptr_s, scale, attn_sink=sink)
    report = check_against_reference(o_s, q[sl], kv, idx_k[s0:], ptr_s, scale, attn_sink=sink)
    print(f"prefill check on the last {T - t0} tokens: {report}")
    if not report.ok:
        return 1

    timer = make_timer(args.cpu, args.reps)
    times = {
        "prefill": timer(
            lambda: sparse_mla_prefill(q, kv, idx_k, ptr_k, scale, attn_sink=sink, out=out)
        ),
        "combined_torch": timer(
            lambda: ix.dsv4_combined_indices(ids, qsl, seq_lens, **layout, impl="torch")
        ),
        "combined_triton": timer(
            lambda: ix.dsv4_combined_indices(ids, qsl, seq_lens, **layout, impl="triton", total=nnz)
        ),
        "combined_triton_validated": timer(
            lambda: ix.dsv4_combined_indices(ids, qsl, seq_lens, **layout, impl="triton")
        ),
        "dense_torch": timer(lambda: ix.dense_to_csr(dense, lengths, impl="torch")),
        "dense_triton": timer(lambda: ix.dense_to_csr(dense, lengths, total=nnz, impl="triton")),
    }
    prefill_ms = times["prefill"]
    ratio_pack = times["combined_triton"] / prefill_ms

    dev = runtime.device_name() if not args.cpu else "cpu (Triton interpreter)"
    print(f"device: {dev}; torch {torch.__version__}, triton {triton.__version__}")
    print(
        f"T={T} H={H} D={D} {str(dtype).replace('torch.', '')} ratio={ratio} topk={topk} "
        f"window={window} nnz={nnz} pool rows={N}"
    )
    print(f"{'item':<24}{'ms':>12}{'% of prefill':>16}")
    for name, ms in times.items():
        print(f"{name:<24}{ms:>12.4f}{100 * ms / prefill_ms:>15.2f}%")
    verdict = "ok" if ratio_pack < 0.05 else "OVER 5%"
    print(f"packing (Triton, total given) / prefill = {100 * ratio_pack:.3f}% ({verdict})")

    if args.out:
        row = {
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "device": dev,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "tokens": T,
            "heads": H,
            "head_dim": D,
            "dtype": str(dtype).replace("torch.", ""),
            "ratio": ratio,
            "topk": topk,
            "window": window,
            "nnz": nnz,
            **{f"{k}_ms": f"{v:.5f}" for k, v in times.items()},
            "packing_over_prefill": f"{ratio_pack:.5f}",
        }
        new = not os.path.exists(args.out) or os.path.getsize(args.out) == 0
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(row))
            if new:
                w.writeheader()
            w.writerow(row)
        print(f"wrote a row to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
