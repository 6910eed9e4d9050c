"""``gluon_ws`` (or ``--kernel gluon_ws_small``) against another version of its kernel file
(``--before``), in turns.

Written for step 11 (below: mbarriers by role) and used again for steps 12-13 (consumer 1's
mask under its S; the softmax scale folded into the exponent: seventeenth session,
data/bench/ws_mask_fold_ab_h200.log) and 14 (the tiles' slot ids published by the producer:
``pending_gpu_checks.sh STEP=ids``).

Triton 3.6's shared-memory hazard analysis (membar) takes an mbarrier arrive for a write and a
wait for a read of the whole allocation, so with the ten mbarriers in one [10, 1] array a wait
behind an arrive on another slot cost the warpgroup a ``bar.sync``. With READY, FREE, Q_READY
and Q_FREE in four allocations (fifteenth session) the sm90 SASS has 7 fewer in consumer 0
(31 -> 24) and 5 fewer in the producer (12 -> 7, none now before a gather's cp.async); consumer
1 keeps its 27. Prediction: T = 64 H128 (one pair an item, the call its latency) -0.02..-0.1 us;
T = 16384 0..-1%.

The change was experiments/patches/ws_bars_by_role.diff until its GPU tests and this
comparison ran (sixteenth session, data/bench/ws_bars_ab_h200.log); it is in the package since.
Here, in one process and in turns (:func:`sparse_mla.bench.time_interleaved`): ``gluon_ws``
forced as the package has it, and the same launch with the kernel of ``--before`` (the file
before the change, loaded as a sibling module) swapped into the launcher; plans off for both
(a replay keeps the kernel it recorded). Each is checked against the fp32 reference first
(NaN-poisoned output). ``--after-launch`` / ``--before-launch``: each side's launch as JSON
(default: the kernel's default launch, the same for both), e.g. the register split a change
needs against the one the file before ran at (step 43). On an H200, ~90 s; a Triton cache of
its own, since the copy's kernels share the package's cache keys (Triton's key ignores the
file) and would stand in for them:

    git show ce5f459:sparse_mla/gluon/hopper_ws.py > /tmp/hopper_ws_before.py
    TRITON_CACHE_DIR=/tmp/ab python experiments/ws_bars_ab.py --before /tmp/hopper_ws_before.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys

import torch

from sparse_mla import bench, dispatch, fastlaunch, op
from sparse_mla.gluon import launch
from sparse_mla.prefill import sparse_mla_prefill

FROZEN = fastlaunch.frozen
POINTS = (("dsv4_csa", 64, 128, 1024, 0), ("dsv4_csa", 16384, 128, 1024, 0))


def parse_point(p: str) -> tuple[str, int, int, int, int]:
    """``[glm:|ctx<N>:]T:H:TOPK`` as (kind, T, H, top-k, context)."""
    if p.startswith("glm:"):
        return ("glm_full_topk", *map(int, p[4:].split(":")), 0)
    context = 0
    if p.startswith("ctx"):
        head, p = p.split(":", 1)
        context = int(head[3:])
    parts = p.split(":")
    if len(parts) != 3:
        raise SystemExit(f"point {p!r}: want [glm:|ctx<N>:]T:H:TOPK")
    return ("dsv4_csa", *map(int, parts), context)


# Each kernel's jitted function, by the name its file defines it under
KERNEL_FN = {"gluon_ws": "_prefill_ws_kernel", "gluon_ws_small": "_prefill_ws_small_kernel"}


def load_before(path: str):
    """The file at ``path`` as module ``sparse_mla.gluon.hopper_ws_before`` (its relative
    imports resolve in the package)."""
    name = "sparse_mla.gluon.hopper_ws_before"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def only_known(kernel):
    """A stand-in for :func:`fastlaunch.frozen` that drops the keyword arguments ``kernel`` does
    not take (a constexpr the launcher added after ``--before``'s file, e.g. step 13's
    ``POS_SCALE``: the older kernel runs as it did)."""
    known = {*kernel.arg_names, "num_warps", "num_stages"}
    return lambda **kw: FROZEN(**{k: v for k, v in kw.items() if k in known})


def point(kind, T, H, topk, context, before, dev, kernel="gluon_ws", launches=(None, None)) -> str:
    """One point in turns; ``launches``: (after's, before's) launch dicts (None: the default)."""
    w = bench.GridPoint(kind, T, H, topk, context).build(dev, seed=0, sink=True, big_buffer=True)
    q, kv, idx, indptr, scale = w.args()
    refs = bench._References(w, 256)
    after_entry = launch._WS[kernel]
    before_entry = (getattr(before, KERNEL_FN[kernel]), after_entry[1])
    fns = []
    for label, entry, launch_ in (("after", after_entry, launches[0]),
                                  ("before", before_entry, launches[1])):  # fmt: skip
        frozen = FROZEN if label == "after" else only_known(entry[0])
        choice = dispatch.Choice(kernel, launch_)

        def run(o, entry=entry, frozen=frozen, choice=choice):
            launch._WS[kernel], fastlaunch.frozen = entry, frozen
            try:
                return sparse_mla_prefill(q, kv, idx, indptr, scale, attn_sink=w.attn_sink,
                                          out=o, config=choice)  # fmt: skip
            finally:
                launch._WS[kernel], fastlaunch.frozen = after_entry, FROZEN

        ok, _rel, note = bench._check(run, w, 256, refs)
        if not ok:
            raise SystemExit(f"{label} at T={T} H={H}: wrong ({note})")
        out = torch.empty_like(q)
        fns.append(lambda run=run, out=out: run(out))
    ms = bench.time_interleaved(fns, 300.0 if T <= 1024 else 600.0, rounds=8)
    where = f" context {context}" if context else ""
    return (f"{kind} T={T} H={H} top-k {topk}{where}: after {ms[0] * 1e3:.2f} us, before "
            f"{ms[1] * 1e3:.2f} us, after / before {ms[0] / ms[1]:.4f}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the kernel's file before the change")
    ap.add_argument("--kernel", default="gluon_ws", choices=sorted(KERNEL_FN))
    ap.add_argument(
        "--points",
        nargs="*",
        default=None,
        metavar="[glm:|ctx<N>:]T:H:TOPK",
        help="dsv4_csa points, glm_full_topk ones with the glm: prefix, CSA steps of a long "
        "request (N tokens cached before the call: whole lists) with ctx<N>: (default: T = 64 "
        "and 16384 at H128, top-k 1024)",
    )
    ap.add_argument("--repeat", type=int, default=1, help="measure each point this many times")
    for side in ("after", "before"):
        ap.add_argument(f"--{side}-launch", default=None, metavar="JSON",
                        help=f"the {side} side's launch, e.g. '{{\"PRODUCER_REGS\": 48}}' "
                        "(default: the kernel's default launch)")  # fmt: skip
    args = ap.parse_args()
    launches = tuple(json.loads(x) if x else None for x in (args.after_launch, args.before_launch))
    points = POINTS
    if args.points:
        points = tuple(parse_point(p) for p in args.points)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}, {args.kernel}", flush=True)
    run_points(points, load_before(args.before), args.repeat, args.kernel, launches)


def run_points(points, before, repeat: int = 1, kernel: str = "gluon_ws",
               launches=(None, None)) -> None:  # fmt: skip
    """:func:`point` at each of ``points`` ((kind, T, H, top-k, context)), ``repeat`` times,
    with the module ``before``'s kernel as the other side; plans off meanwhile."""
    dev = torch.device("cuda")
    op.set_plans_enabled(False)
    for kind, T, H, topk, context in points:
        for _ in range(repeat):
            print(point(kind, T, H, topk, context, before, dev, kernel, launches), flush=True)
        torch.cuda.empty_cache()
    op.set_plans_enabled(True)


if __name__ == "__main__":
    main()
