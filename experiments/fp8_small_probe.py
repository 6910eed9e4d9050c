"""Same-process timing of gluon_ws_small_fp8's launches against the bf16 default on the
dequantized pool (DSv4 CSA, H200). Run from the repository root on the GPU:
``PYTHONPATH=$PWD python3 experiments/fp8_small_probe.py``.

What it showed (data/bench/fp8_small_probe_h200.log): the FP8 kernel is correct at every
launch but 1.3-1.4x slower than the bf16 kernel (T=16384 H16: 2.34-2.40 ms against 1.74), and
neither a second or third producer warpgroup, nor loading the next tile's ids early, nor
ld.global.cg moved it more than 7%: the limit is not the bytes a program has in flight.
"""

import functools

import triton

from sparse_mla import dispatch, sparse_mla_prefill
from sparse_mla import fp8 as F
from sparse_mla import workloads as W
from sparse_mla.gluon.launch_fp8 import FP8SmallConfig
from sparse_mla.reference import check_against_reference


def bench(fn, ms=200):
    return triton.testing.do_bench(fn, warmup=25, rep=ms)


def variants(H):
    hg = 1 if H <= 16 else 2
    out = [("p2r128", FP8SmallConfig(HEAD_GROUPS=hg, PRODUCERS=2, PRODUCER_REGS=128))]
    if hg == 1:
        out += [
            ("p1pipe", FP8SmallConfig(PRODUCERS=1, PRODUCER_REGS=256, PIPELINE=True)),
            ("p3r112", FP8SmallConfig(PRODUCERS=3, PRODUCER_REGS=112)),
        ]
    return out


def main():
    for T, H in [(16384, 16), (16384, 32), (1024, 16), (64, 16)]:
        w = W.dsv4_csa(T, H, topk=512, device="cuda", seed=1)
        q, idx, ptr, sc, sink = w.q, w.kv_indices, w.kv_indptr, w.softmax_scale, w.attn_sink
        cache = F.quantize(w.kv.reshape(w.kv.shape[0], -1), 64)
        deq = F.dequantize(cache)
        call = functools.partial(sparse_mla_prefill, q, kv_indices=idx, kv_indptr=ptr,
                                 softmax_scale=sc, attn_sink=sink)  # fmt: skip
        res = {"bf16_default_on_deq": bench(lambda: call(kv=deq))}  # noqa: B023
        for name, cfg in variants(H):
            f = functools.partial(call, kv=cache, config=cfg)
            rep = check_against_reference(f(), q, deq, idx, ptr, sc, attn_sink=sink)
            res[name] = bench(f)
            res[name + "_ok"] = rep.ok
        if T <= 1024:
            res["triton_fp8"] = bench(
                functools.partial(call, kv=cache, config=dispatch.Choice("triton_fp8"))
            )
        shown = " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                         for k, v in res.items())  # fmt: skip
        print(f"T={T} H={H} nnz={idx.numel()} {shown}", flush=True)


if __name__ == "__main__":
    main()
