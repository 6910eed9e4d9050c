"""Same-process timing of gluon_ws_fp8 (the heads-on-M kernel fed by an FP8 producer) against
gluon_ws_small_fp8 on the same MODEL1 cache and the bf16 gluon_ws on the dequantized pool (DSv4
CSA: top-k 512 at H64, 1024 at H128, window 128; T = 16384 and 1024), H200. Run from the
repository root on the GPU: ``PYTHONPATH=$PWD python3 experiments/ws_fp8_probe.py`` (1-2
minutes; ``experiments/h28ws8_gpu_check.sh`` runs it before the GPU tests).

The cache and the bf16 pool each live past byte 2**31 of one 3 GiB buffer, as an engine's do.
Every launch is checked against the fp32 reference over the dequantized rows before it is
timed (``triton.testing.do_bench``, median). Besides the default launch of gluon_ws_fp8 it
times, at T = 16384, other producer windows (``AHEAD`` 1, 2, 3, 5: if the time moves with
it, the producer's loads in flight are the limit); the default (192 / 88, 4 chunks ahead) is
the largest window that cross-compiles without spills for int32 ids. The prediction is in
docs/PERF_NOTES.md ("The FP8 cache on Hopper at 33-128 heads: gluon_ws_fp8").
"""

from __future__ import annotations

import functools
import sys

import torch
import triton

from sparse_mla import dispatch, sparse_mla_prefill
from sparse_mla import fp8 as F
from sparse_mla import workloads as W
from sparse_mla.gluon.launch_fp8 import FP8WSConfig
from sparse_mla.reference import check_against_reference

GIB = 2**30
POINTS = [(16384, 64, 512), (16384, 128, 1024), (1024, 64, 512), (1024, 128, 1024)]
WS_FP8 = [
    ("ws_fp8", None),  # the default: FP8WSConfig(192, 88, AHEAD=4), no spills
    ("ws_fp8_a1", FP8WSConfig(AHEAD=1)),
    ("ws_fp8_a2", FP8WSConfig(AHEAD=2)),
    ("ws_fp8_a3", FP8WSConfig(AHEAD=3)),
    # 96 producer registers (consumer 0: 216): 16 bytes of producer spills, 8 in consumer 0's
    # prologue
    ("ws_fp8_a5p96", FP8WSConfig(PRODUCER_REGS=96, AHEAD=5)),
]
SMALL = dispatch.Choice("gluon_ws_small_fp8")


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def placed(buf: torch.Tensor, offset: int, src: torch.Tensor) -> torch.Tensor:
    """``src`` copied into ``buf`` (uint8) at byte ``offset`` (16-byte aligned), same shape
    and strides (its storage's span)."""
    span = (sum((n - 1) * st for n, st in zip(src.shape, src.stride(), strict=True)) + 1) * (
        src.element_size()
    )
    dst = torch.as_strided(buf[offset : offset + span].view(src.dtype), src.shape, src.stride())
    dst.copy_(src)
    return dst


def main() -> int:
    buf = torch.empty(3 * GIB, dtype=torch.uint8, device="cuda")
    failed = 0
    for T, H, topk in POINTS:
        w = W.dsv4_csa(T, H, topk=topk, device="cuda", seed=1)
        q, idx, ptr, sc, sink = w.q, w.kv_indices, w.kv_indptr, w.softmax_scale, w.attn_sink
        cache0 = F.quantize(w.kv.reshape(w.kv.shape[0], -1), 64)
        cache = F.FP8Cache(placed(buf, 2 * GIB + 4096, cache0.data), 64)
        deq = placed(buf, 2 * GIB + GIB // 2, F.dequantize(cache0))
        assert cache.data.data_ptr() - buf.data_ptr() > 2**31
        call = functools.partial(sparse_mla_prefill, q, kv_indices=idx, kv_indptr=ptr,
                                 softmax_scale=sc, attn_sink=sink)  # fmt: skip
        runs = [
            ("bf16_gluon_ws", functools.partial(call, kv=deq, config=dispatch.Choice("gluon_ws"))),
            ("small_fp8", functools.partial(call, kv=cache, config=SMALL)),
        ]
        # The other windows at T = 16384 only (T = 1024 runs the small-call order: each launch
        # would compile once more).
        for name, cfg in WS_FP8 if T >= 16384 else WS_FP8[:1]:
            f = functools.partial(call, kv=cache, config=dispatch.Choice("gluon_ws_fp8", cfg))
            runs.append((name, f))
        runs.append(("fp8_default", functools.partial(call, kv=cache)))
        res, oks = {}, {}
        for name, f in runs:
            out = f()
            torch.cuda.synchronize()
            rep = check_against_reference(out, q, deq, idx, ptr, sc, attn_sink=sink)
            oks[name] = rep.ok
            if not rep.ok:
                failed += 1
                print(f"  T={T} H={H} {name}: WRONG {rep}", flush=True)
                continue
            res[name] = bench(f)
        chosen = dispatch.choose(
            dispatch.Call(
                "sm90", H, 512, torch.bfloat16, cache, T, idx.numel(), kv_format=F.KV_FORMAT
            )
        ).kernel
        base = res.get("bf16_gluon_ws")
        shown = " ".join(
            f"{k}={v:.4f}" + (f"({v / base:.2f}x)" if base and k != "bf16_gluon_ws" else "")
            for k, v in res.items()
        )
        print(f"T={T} H={H} topk={topk} nnz={idx.numel()} default={chosen} ms: {shown}",
              flush=True)  # fmt: skip
        del w, cache0, cache, deq
    print("all launches match the fp32 reference" if not failed else f"{failed} WRONG")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
