"""Is a back-to-back host-time window bound by the host or by the GPU's launch queue? (issue 26)

``scripts/host_cost.py`` and ``bench --host`` time windows of 200 calls with no sync between
and call (wall time / 200) the host time of a call. That holds while the launch queue has room:
once it is full, each launch waits for the GPU to retire one, and a window then times the
GPU's throughput instead. Per case (provider, H, T; plans on, the package's defaults):

1. ``queue``: the GPU held busy for 300 ms by a spin kernel, then 1500 calls timed one by one:
   how many calls went in before a call took over 1 ms (the queue's depth for this call's
   launches), and the median time of the calls before that (host time with the GPU busy).
2. ``gpu_us``: GPU time per call (events around 100 calls, median of 3).
3. ``host_us`` at 25, 50, 100 and 200 calls a window (9 windows each; median and min).

If host_us at 200 equals gpu_us and exceeds host_us at 25, the window was queue-bound.

    PYTHONPATH=. python experiments/host_window.py [--cases default:16x4,gluon_wgmma:16x4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from host_cost import workload

from sparse_mla import dispatch, runtime
from sparse_mla.bench import _hold_gpu
from sparse_mla.prefill import sparse_mla_prefill

CASES = ("default:16x4,gluon_mma:16x4,gluon_wgmma:16x4,gluon_wgmma:64x4,default:64x4,"
         "gluon_ws:64x16384,fp8:default:16x4,fp8:triton_fp8:16x4,fp8:gluon_ws_fp8:16x4,"
         "fp8:default:16x16384")  # fmt: skip


def windows(fn, reps: int, n: int = 9) -> tuple[float, float]:
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        out.append((time.perf_counter() - t0) / reps * 1e6)
    torch.cuda.synchronize()
    return statistics.median(out), min(out)


def gpu_us(fn, calls: int = 100) -> float:
    got = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        got.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(got)


def queue(fn, n: int = 1500) -> tuple[int | None, float]:
    torch.cuda.synchronize()
    _hold_gpu(300)
    dts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        dts.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    first = next((i for i, d in enumerate(dts) if d > 1000), None)
    before = dts[: first or n][50:] or dts
    return first, statistics.median(before)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=CASES, help="[fp8:]provider:HxT,...")
    args = ap.parse_args(argv)
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton "
          f"{runtime.triton_version()}")  # fmt: skip
    print(
        "case                      queue_depth  busy_us  gpu_us  host_us@25 @50 @100 @200 "
        "(median/min)"
    )
    for case in args.cases.split(","):
        parts = case.split(":")
        fp8 = parts[0] == "fp8"
        name, shape = parts[-2], parts[-1]
        H, T = (int(x) for x in shape.split("x"))
        q, kv, idx, ptr, scale, sink = workload(H, T, "cuda")
        if fp8:
            from sparse_mla.fp8 import quantize

            kv = quantize(kv, 64)
        out = torch.empty_like(q)
        cfg = None if name == "default" else dispatch.Choice(name)

        def fn(cfg=cfg, kv=kv, q=q, idx=idx, ptr=ptr, sink=sink, out=out, scale=scale):
            sparse_mla_prefill(q, kv, idx, ptr, scale, attn_sink=sink, out=out, config=cfg)

        for _ in range(30):
            fn()
        depth, busy = queue(fn)
        g = gpu_us(fn)
        cols = []
        for reps in (25, 50, 100, 200):
            med, lo = windows(fn, reps)
            cols.append(f"{med:.1f}/{lo:.1f}")
        print(f"{case:<25} {depth!s:>11} {busy:8.1f} {g:7.1f}  {' '.join(cols)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
