"""Where a replayed call's host time goes, piece by piece, on the GPU machine (issue 26).

For each shape and kernel (``default`` = config=None, or a kernel forced by name), after the
call's plan is recorded, these are timed in turns (``scripts/host_cost.py``'s ``host_turns``:
rounds of one 200-call window each, balanced orders), with FlashMLA's call in the same turns:

- ``full``: ``sparse_mla_prefill(..., out=out)`` as a user calls it;
- ``op``: the op's real kernel (``op._impl``): the plan key, the replay's checks and the replay;
- ``checks``: the plan key, the lookup and ``op._replayable`` alone (no launch): a call that
  misses the last plan (since the fourteenth session);
- ``last``: ``op._last`` (the last plan's guard, head and alignment, no key) and
  ``op._replayable``: what a call of the last plan's layout checks (where the package has it);
- ``replay``: ``Replay.__call__`` (the stream, the lent scratch, the launches);
- ``fire``: the generated launch function alone, stream and scratch taken once outside;
- ``stream``: ``driver.get_current_stream`` alone;
- ``flashmla``: ``flash_mla_sparse_fwd`` at the same shape, heads padded, outputs allocated;
- ``empty3``: three ``torch.empty`` of FlashMLA's outputs' sizes (what its call allocates).

``fire`` is the C launcher and the driver's launch with the arguments already in hand: what
no Python on our side can remove.

    PYTHONPATH=.:.peers python experiments/host_split.py [--shapes 16x4,64x4] [--rounds 8]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def _host_cost():
    spec = importlib.util.spec_from_file_location("host_cost", ROOT / "scripts" / "host_cost.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="16x4,64x4,128x4", help="HxT,...")
    ap.add_argument("--kernels", default="default,gluon_ws_small,gluon_ws,gluon_mma")
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args(argv)

    from sparse_mla import runtime

    hc = _host_cost()
    dev = torch.device("cuda")

    def sync():
        torch.cuda.synchronize(dev)

    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton "
          f"{runtime.triton_version()} python {sys.version.split()[0]}; us a call, min / "
          f"median of >= {args.rounds} windows of 200 calls, in turns")  # fmt: skip
    for shape in args.shapes.split(","):
        H, T = (int(x) for x in shape.split("x"))
        _shape_rows(hc, H, T, args.kernels.split(","), args.rounds, dev, sync)
    return 0


def _shape_rows(hc, H, T, kernels, rounds, dev, sync) -> None:
    """One shape's rows (module docstring)."""
    from sparse_mla import dispatch, fastlaunch, op, runtime
    from sparse_mla.prefill import sparse_mla_prefill

    q, kv, idx, indptr, scale, sink = hc.workload(H, T, "cuda")
    out = torch.empty_like(q)
    inputs = (q, kv, idx, indptr, sink, out)
    heads = 64 if H <= 64 else 128
    sizes = ((T, heads, 512), (T, heads), (T, heads))
    labels, fns = [], []
    for name in kernels:
        cfg = None if name == "default" else dispatch.Choice(name)
        if cfg is not None:
            call = dispatch.Call(runtime.arch(), H, 512, q.dtype, kv, T)
            if dispatch.kernel(name).unavailable(call):
                continue
        spec = None if cfg is None else op.spec_of(cfg)

        def full(cfg=cfg):
            sparse_mla_prefill(q, kv, idx, indptr, scale, attn_sink=sink, out=out,
                               config=cfg, validate=False)  # fmt: skip

        for _ in range(5):
            full()
        key = op._plan_key(q, kv, idx, indptr, scale, sink, out, spec)
        p = op._PLANS.get(key)
        if type(p) is not op._Plan:
            print(f"H{H} T{T} {name}: no plan ({p!r})")
            continue
        replay = p.replay
        stream = replay.driver.get_current_stream(replay.device)
        scratch = p.scratch
        bufs = scratch.take(stream)[1] if type(scratch) is fastlaunch.Scratch else scratch

        def opk(spec=spec):
            op._impl(q, kv, idx, indptr, scale, sink, out, spec, False)

        def checks(spec=spec, p=p):
            k = op._plan_key(q, kv, idx, indptr, scale, sink, out, spec)
            op._PLANS.get(k)
            op._replayable(p, q, kv, idx, indptr, sink, out, False)

        def last(spec=spec, p=p):
            head = (scale, spec, None, sink is None, indptr is None)
            op._last(op._LAST, q, kv, idx, indptr, sink, out, head)
            op._replayable(p, q, kv, idx, indptr, sink, out, False)

        def rep(p=p):
            p.replay(inputs, p.scratch)

        def fire(replay=replay, stream=stream, bufs=bufs):
            replay._fire(stream, *inputs, *bufs)

        def strm(replay=replay):
            replay.driver.get_current_stream(replay.device)

        parts = [("full", full), ("op", opk), ("checks", checks), ("replay", rep),
                 ("fire", fire), ("stream", strm)]  # fmt: skip
        if hasattr(op, "_last"):
            if op._PLANS.get(op._LAST, (None,))[0] is not p:
                print(f"H{H} T{T} {name}: the plan is not the last plan")
            parts.insert(3, ("last", last))
        for part, fn in parts:
            labels.append(f"{name}:{part}")
            fns.append(fn)
    try:
        peer, call = hc._peer_call(H, q, kv, idx, scale, sink)
        labels.append(peer)
        fns.append(call)
    except ImportError as e:
        print(f"# FlashMLA not importable: {e}")

    def empty3():
        torch.empty(sizes[0], dtype=torch.bfloat16, device=dev)
        torch.empty(sizes[1], dtype=torch.float32, device=dev)
        torch.empty(sizes[2], dtype=torch.float32, device=dev)

    labels.append("empty3")
    fns.append(empty3)
    times = hc.host_turns(fns, sync, rounds)
    for label, ts in zip(labels, times, strict=True):
        print(f"H{H} T{T:<6} {label:<24} min {min(ts):6.1f}  median "
              f"{statistics.median(ts):6.1f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
