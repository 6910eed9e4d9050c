"""``gluon_ws_fp8`` writing O by TMA against by its consumers' own 16-byte stores, in turns.

Step 46 (PERF_NOTES "No cliffs") moved ``gluon_ws``'s output from a TMA store a [64, 64] block
(each waiting for the engine's read of the previous one) to the consumers' own stores: 1-2%
at small T, 1% at T = 16384 H64. ``gluon_ws_fp8`` shares those consumers but kept TMA.
With ``experiments/patches/ws_fp8_out_direct.diff`` applied, its launcher reads
``SPARSE_MLA_FP8_OUT`` at each call (``tma``: as before; anything else: the consumers' stores,
``OUT_DIRECT``); here both, on the same FP8 cache (MODEL1, quantized from the bench's pool),
each checked against the fp32 reference over the dequantized rows first (``turns.add_checked``:
NaN-poisoned output),
then timed in turns (:func:`sparse_mla.bench.time_interleaved`, 8 rounds; plans off, so every
call goes through the launcher). On an H200, ~1 minute:

    git apply experiments/patches/ws_fp8_out_direct.diff
    PYTHONPATH=$PWD python experiments/fp8_out_ab.py --repeat 2
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import torch
from turns import add_checked
from ws_bars_ab import parse_point

from sparse_mla import bench, dispatch, fp8, op
from sparse_mla.prefill import sparse_mla_prefill

POINTS = ("64:128:1024", "64:64:512", "256:64:512", "ctx65536:64:128:1024", "16384:64:512",
          "16384:128:1024")  # fmt: skip
MODES = ("tma", "direct")


def point(kind, T, H, topk, context, dev) -> str:
    w = bench.GridPoint(kind, T, H, topk, context).build(dev, seed=0, sink=True, big_buffer=False)
    cache = fp8.quantize(w.kv, 64)
    wd = dataclasses.replace(w, kv=fp8.dequantize(cache))  # the rows the kernel reads
    q, _, idx, indptr, scale = w.args()
    fns, names = [], []
    for mode in MODES:

        def run(o, mode=mode):
            os.environ["SPARSE_MLA_FP8_OUT"] = mode
            return sparse_mla_prefill(q, cache, idx, indptr, scale, attn_sink=w.attn_sink,
                                      out=o, config=dispatch.Choice("gluon_ws_fp8"))  # fmt: skip

        wrong = add_checked(mode, run, wd.args(), w.attn_sink, fns, names)
        if wrong:
            raise SystemExit(f"{mode} at {kind} T={T} H={H}: wrong ({wrong})")
    tma, direct = bench.time_interleaved(fns, 400.0, rounds=8)
    where = f" context {context}" if context else ""
    return (f"{kind} T={T} H={H} top-k {topk}{where}: TMA {tma * 1e3:.2f} us, own stores "
            f"{direct * 1e3:.2f} us, own / TMA {direct / tma:.4f}")  # fmt: skip


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
        os.environ.pop("SPARSE_MLA_FP8_OUT", None)


if __name__ == "__main__":
    main()
