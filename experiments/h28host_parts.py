"""The pieces of one planned call on the CPU stand-in (issue 26, branch h28host; PERF_NOTES,
"Host cost of every kernel"): per kernel, after the call's plan is made, each piece of the
replay timed alone (this thread's CPU time, the smallest of 7 windows of 2000 calls): the full
entry, the op's kernel (``op._impl``), the plan key, the replay guard (``op._replayable``),
``Replay.valid``, the split partials (made, or taken and kept), the launches (``Replay``), a
forced kernel's spec, and the wrapper (entry minus the op's kernel).

Kernels are compiled for sm90 here and Triton's driver is ``scripts/host_cost.py``'s stand-in
(its C launch a no-op). Runs on the tree it is imported from, so the same file times an older
checkout: ``PYTHONPATH=<tree> python experiments/h28host_parts.py``.

    SHAPES=64x4,16x16384 KERNELS=default,gluon_ws python experiments/h28host_parts.py
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import host_cost

from sparse_mla import dispatch, op, prefill
from sparse_mla.prefill import sparse_mla_prefill


def timed(fn, n: int = 2000, windows: int = 7) -> float:
    for _ in range(50):
        fn()
    best = float("inf")
    for _ in range(windows):
        t0 = time.thread_time()
        for _ in range(n):
            fn()
        best = min(best, (time.thread_time() - t0) / n * 1e6)
    return best


def main() -> None:
    host_cost._fake_sm90()
    prefill._arch_of = lambda q: "sm90"
    for name, k in list(dispatch.KERNELS.items()):
        if name != "triton":
            dispatch.KERNELS[name] = replace(k, unavailable=lambda call: None)
    shapes = [
        tuple(int(x) for x in s.split("x")) for s in os.environ.get("SHAPES", "64x4").split(",")
    ]
    names = os.environ.get(
        "KERNELS", "default,triton,gluon_mma,gluon_wgmma,gluon_ws,gluon_ws_small"
    ).split(",")
    for H, T in shapes:
        q, kv, idx, ptr, scale, sink = host_cost.workload(H, T, "cpu")
        out = torch.empty_like(q)
        for name in names:
            print(f"H{H} T{T} {name:<15} {parts(name, q, kv, idx, ptr, scale, sink, out)}",
                  flush=True)  # fmt: skip


def parts(name, q, kv, idx, ptr, scale, sink, out) -> str:
    cfg = None if name == "default" else dispatch.Choice(name)
    spec = None if cfg is None else op.config_spec(cfg)

    def full():
        sparse_mla_prefill(q, kv, idx, ptr, scale, attn_sink=sink, out=out, config=cfg,
                           validate=False)  # fmt: skip

    for _ in range(10):
        full()
    p = op._PLANS.get(op._plan_key(q, kv, idx, ptr, scale, sink, out, spec))
    if type(p) is not op._Plan:
        return f"no plan ({p})"
    inputs = (q, kv, idx, ptr, sink, out)
    kept = getattr(p.scratch, "take", None)  # this branch: a fastlaunch.Scratch

    def scratch():
        if kept is None:  # main: made per call
            return tuple(f() for f in p.scratch)
        key, bufs = kept(0)
        p.scratch.keep(key, bufs)

    made = p.scratch if kept is not None else tuple(f() for f in p.scratch)
    r = {
        "full": timed(full),
        "impl": timed(lambda: op._impl(q, kv, idx, ptr, scale, sink, out, spec, False)),
        "key": timed(lambda: op._plan_key(q, kv, idx, ptr, scale, sink, out, spec)),
        "guard": timed(lambda: op._replayable(p, q, kv, idx, ptr, sink, out, False)),
        "valid": timed(p.replay.valid),
        "scratch": timed(scratch),
        "launches": timed(lambda: p.replay(inputs, made)),
        "spec": timed(lambda: op.spec_of(cfg)) if cfg is not None else 0.0,
    }
    r["wrapper"] = r["full"] - r["impl"]
    return f"launches={p.replay.launches} " + " ".join(f"{k} {v:.2f}" for k, v in r.items())


if __name__ == "__main__":
    main()
