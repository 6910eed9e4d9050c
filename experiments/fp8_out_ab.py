"""``gluon_ws_fp8`` writing O by TMA against by its consumers' own 16-byte stores, in turns.

Step 46 (PERF_NOTES "No cliffs") moved ``gluon_ws``'s output from a TMA store a [64, 64] block (each
waiting for the engine's read of the previous one) to the consumers' own stores: 1-2% at small T, 1%
at T = 16384 H64. ``gluon_ws_fp8`` shares those consumers. The first measurement
(``experiments/patches/ws_fp8_out_direct.diff``, every call by the consumers' stores,
``data/bench/fp8_out_ab_h200_c4e9b62.log``) gained 2-3% at T = 64 and lost 2-2.7% at T = 16384, and
a second, own stores in small calls, lost 2% at T = 1024 H64 (a small call of eight items a program,
``fp8_out_small_ab_h200_19d0616.log``), so the package stores O itself only where each program runs
one item (step 47: ``_launch_persistent(single_direct=True)``, ``launch.single_item``). Modes:
``tma``, every call by TMA (the launch with ``single_direct`` forced off), and ``package``, the
launch as shipped; both on the same FP8 cache (MODEL1, quantized from the bench's pool), each
checked against the fp32 reference over the dequantized rows first (``turns.add_checked``:
NaN-poisoned output), then timed in turns (:func:`sparse_mla.bench.time_interleaved`, 8 rounds;
plans off, so every call goes through the launcher). On an H200, ~1 minute:

    PYTHONPATH=$PWD python experiments/fp8_out_ab.py --repeat 2
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from turns import add_checked
from ws_bars_ab import parse_point

from sparse_mla import bench, dispatch, fp8, op
from sparse_mla.gluon import hopper_ws, launch
from sparse_mla.prefill import sparse_mla_prefill

POINTS = ("64:128:1024", "64:64:512", "256:64:512", "ctx65536:64:128:1024", "1024:64:512",
          "4096:128:1024", "16384:64:512", "16384:128:1024")  # fmt: skip
MODES = ("tma", "package")
_SHIPPED = launch._launch_persistent


def _tma_only(*args, **kwargs):
    """The persistent launch with O by TMA in every call (no ``single_direct``)."""
    return _SHIPPED(*args, **{**kwargs, "single_direct": False})


def point(kind, T, H, topk, context, dev) -> str:
    w = bench.GridPoint(kind, T, H, topk, context).build(dev, seed=0, sink=True, big_buffer=False)
    cache = fp8.quantize(w.kv, 64)
    wd = dataclasses.replace(w, kv=fp8.dequantize(cache))  # the rows the kernel reads
    q, _, idx, indptr, scale = w.args()
    fns, names = [], []
    for mode in MODES:

        def run(o, mode=mode):
            launch._launch_persistent = _tma_only if mode == "tma" else _SHIPPED
            return sparse_mla_prefill(q, cache, idx, indptr, scale, attn_sink=w.attn_sink,
                                      out=o, config=dispatch.Choice("gluon_ws_fp8"))  # fmt: skip

        wrong = add_checked(mode, run, wd.args(), w.attn_sink, fns, names)
        if wrong:
            raise SystemExit(f"{mode} at {kind} T={T} H={H}: wrong ({wrong})")
    tma, shipped = bench.time_interleaved(fns, 400.0, rounds=8)
    where = f" context {context}" if context else ""
    items = T * -(-H // 64)
    programs = min(items, torch.cuda.get_device_properties(dev).multi_processor_count)
    small = "small" if hopper_ws.small_call(idx.numel(), programs) else "large"
    one = "one item a program" if launch.single_item(items, programs) else "items follow"
    return (f"{kind} T={T} H={H} top-k {topk}{where} ({small} call, {one}): "
            f"TMA {tma * 1e3:.2f} us, package {shipped * 1e3:.2f} us, "
            f"package / TMA {shipped / tma:.4f}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--points", nargs="+", metavar="[ctx<N>:]T:H:TOPK", default=list(POINTS))
    p.add_argument("--repeat", type=int, default=1)
    a = p.parse_args()
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}, gluon_ws_fp8", flush=True)
    op.set_plans_enabled(False)
    try:
        for spec in a.points:
            for _ in range(a.repeat):
                print(point(*parse_point(spec), dev), flush=True)
            torch.cuda.empty_cache()
    finally:
        op.set_plans_enabled(True)
        launch._launch_persistent = _SHIPPED


if __name__ == "__main__":
    main()
