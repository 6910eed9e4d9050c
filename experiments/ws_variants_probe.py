"""GPU probe of H >= 64 kernel variants against the package kernel and FlashMLA, same process.

Each variant is a copy of ``sparse_mla/gluon/hopper_ws.py`` in a file of its own (the kernel
``_prefill_ws_kernel``), run through ``mla_gluon`` with the package's kernel object swapped:

    PYTHONPATH=.:.peers python3 experiments/ws_variants_probe.py pkg base=/tmp/ws_base.py ...
    PYTHONPATH=.:.peers python3 experiments/ws_variants_probe.py --points 64:64,64:128,256:64 \
        --rounds 9 pkg a=/tmp/a.py

where each NAME=FILE is a variant file, e.g. one rebuilt from its diff in
``experiments/patches/ws_variants/`` (``patch -o /tmp/rdv.py FILE_IT_GREW_FROM < rdv.patch``).

``pkg`` is the package's kernel as it stands; names starting ``abl_`` are ablations whose
output is not the operator's (not checked). Edge checks first (every variant, H 64 and 128;
``--skip-edges``), then DSv4 CSA at each ``--points`` T:H (top-k 512 up to 80 heads, 1024
above, as the grid bench), every variant and FlashMLA timed in interleaved rounds (the order
rotated each round), the median of the rounds reported. Before timing, every checked variant's
output at each point is compared with the fp32 reference (all tokens up to T = 1024, every
32nd above).

Timing (``--timer``): ``budget`` (default) is ``sparse_mla.bench.time_budget``, the grid bench's
timer: the L2 flushed before each call and the timed calls queued behind a GPU sleep, so that
at small T (a few us of kernel, ~300 us of host work per call) the events time the GPU alone;
``do_bench`` is ``triton.testing.do_bench``'s median (the earlier runs' timer; at small T it
times the host). ``empty`` is a one-program no-op Triton kernel timed the same way once per
point after the rounds, outside them: the floor of launch and events under any kernel. (Inside
the rotation it left the GPU idle for a moment before whichever provider came next, which then
ran at T = 16384 up to 10% faster than in any other place: the clocks after idle.) The log
goes to $OUT/ws_variants.log (default /tmp; ``--log``), every round also to ``--csv`` when
given.

``--warm-only``: compile each variant (the edge checks' two specialisations and the timing
points') and exit, so that several processes can fill Triton's cache in parallel first.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ws_probe as wp

from sparse_mla import bench, workloads
from sparse_mla.gluon import launch as L
from sparse_mla.gluon.hopper_ws import _prefill_ws_kernel
from sparse_mla.reference import check_against_reference

WS = "gluon_ws"
OUT = os.environ.get("OUT", "/tmp")


def load_variant(name, path):
    spec = importlib.util.spec_from_file_location("ws_variant_" + name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


PACKAGE_LAUNCH = L._launch_persistent


def package_launch(out_tma):
    """The package's launcher, told how the variant writes O (a pointer, or TMA) whatever the
    package's kernel module says."""

    def launch(*args, **kw):
        kw["out_tma"] = out_tma
        return PACKAGE_LAUNCH(*args, **kw)

    return launch


def variant_call(kernel, launch=PACKAGE_LAUNCH):
    """A provider running ``kernel`` through ``mla_gluon``, launched by ``launch`` (a variant
    whose kernel takes other arguments brings its own)."""

    def call(w, out=None):
        L._WS[WS] = (kernel, L._WS[WS][1])  # the launcher runs what the registry table names
        L._launch_persistent = launch
        return wp.gluon_call(WS)(w, out=out)

    return call


@triton.jit
def _noop(x_ptr):
    if tl.program_id(0) < 0:  # never: nothing is written
        tl.store(x_ptr, 0)


def empty_call():
    x = torch.empty(1, device="cuda")

    def call(w, out=None):
        _noop[(1,)](x)

    return call


def make_calls(specs):
    calls = {}
    for spec in specs:
        name, _, path = spec.partition("=")
        if name == "pkg":
            calls[name] = variant_call(_prefill_ws_kernel)
        else:
            mod = load_variant(name, path)
            launch = getattr(mod, "launch", None) or package_launch(
                getattr(mod, "OUT_BY_TMA", False)
            )
            calls[name] = variant_call(mod._prefill_ws_kernel, launch)
    return calls


def parse_points(text):
    return [tuple(int(v) for v in p.split(":")) for p in text.split(",") if p]


def point_workload(T, H):
    topk = 512 if H <= 80 else 1024  # as the grid bench: V4-Flash below 96 heads, V4-Pro above
    w = workloads.dsv4_csa(T, H, topk=topk, device="cuda", big_buffer=True, seed=1)
    w.kv.normal_()
    return w, topk


def check_point(say, name, call, w):
    """The variant's output on ``w`` against the fp32 reference (every 32nd token above 1024)."""
    T = w.q.shape[0]
    out = torch.full_like(w.q, float("nan"))
    call(w, out=out)
    torch.cuda.synchronize()
    if T <= 1024:
        rep = check_against_reference(out, *w.args(), attn_sink=w.attn_sink)
    else:
        sl = slice(0, T, 32)
        rep = check_against_reference(
            out[sl].contiguous(), w.q[sl].contiguous(), w.kv, *wp._csr_rows(w, sl),
            w.softmax_scale, attn_sink=w.attn_sink,
        )  # fmt: skip
    say(f"  check {name} T{T} H{w.q.shape[1]}: {rep}")
    return rep.ok


def timer(kind, budget_ms):
    if kind == "budget":
        return lambda fn: bench.time_budget(fn, budget_ms)
    return lambda fn: triton.testing.do_bench(fn, return_mode="median")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="+", help="pkg | name=path/to/variant.py")
    ap.add_argument("--points", default="16384:64,16384:128", help="T:H,T:H,...")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--timer", choices=("budget", "do_bench"), default="budget")
    ap.add_argument("--budget-ms", type=float, default=bench.GRID_BUDGET_MS)
    ap.add_argument("--skip-edges", action="store_true")
    ap.add_argument("--no-flashmla", action="store_true")
    ap.add_argument("--warm-only", action="store_true")
    ap.add_argument("--log", default=os.path.join(OUT, "ws_variants.log"))
    ap.add_argument("--csv", default=None)
    ap.add_argument("--base", default="pkg", help="the variant the others are compared with")
    args = ap.parse_args(argv)
    points = parse_points(args.points)
    calls = make_calls(args.specs)
    checked = {n: c for n, c in calls.items() if not n.startswith("abl_")}  # ablations: no output
    if args.warm_only:  # the specialisations the run compiles: edge lists (int32, int64), points
        for call in calls.values():
            for index_dtype in (torch.int32, torch.int64):
                call(wp.edge_workload(64, index_dtype, True, seed=0))
            call(workloads.dsv4_csa(64, 64, device="cuda", seed=1))
        torch.cuda.synchronize()
        print(f"warm: {list(calls)}", flush=True)
        return 0

    say = wp.logger(args.log)
    say(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    say(f"timer {args.timer} (budget {args.budget_ms} ms), {args.rounds} rounds, points {points}")
    ok = True
    if not args.skip_edges:
        ok = wp.check_edges(say, checked, (64, 128))
        say(f"edge checks {list(checked)} {'ALL OK' if ok else 'FAILURES'}")
    time_fn = timer(args.timer, args.budget_ms)
    rows = []
    summary = []
    for T, H in points:
        w, topk = point_workload(T, H)
        provs = dict(calls)
        if not args.no_flashmla:
            provs["flashmla"] = wp.flashmla_call(w)
        for name, call in provs.items():
            if name in checked:
                ok &= check_point(say, name, call, w)
            else:
                call(w)  # warm-up (compiles nothing new)
        torch.cuda.synchronize()
        names = list(provs)
        times = {n: [] for n in names}
        for r in range(args.rounds):
            k = r % len(names)
            for n in names[k:] + names[:k]:
                ms = time_fn(lambda call=provs[n], w=w: call(w))
                times[n].append(ms)
                rows.append(dict(T=T, H=H, topk=topk, provider=n, round=r, us=round(ms * 1e3, 3)))
                say(f"csa T{T} H{H} topk{topk} {n} round{r}: {ms * 1e3:.2f} us")
        empty = empty_call()
        empty(w)
        ms = time_fn(lambda e=empty, w=w: e(w))
        times["empty"] = [ms]
        rows.append(dict(T=T, H=H, topk=topk, provider="empty", round=0, us=round(ms * 1e3, 3)))
        say(f"csa T{T} H{H} topk{topk} empty: {ms * 1e3:.2f} us")
        med = {n: statistics.median(t) for n, t in times.items()}
        ref = med.get("flashmla")
        base = med.get(args.base)
        parts = []
        for n, t in med.items():
            s = f"{n} {t * 1e3:.2f}"
            if base and n != args.base and n in calls:
                s += f" ({(t - base) * 1e3:+.2f} vs {args.base})"
            if ref and n != "flashmla":
                s += f" [{t / ref:.3f} of FlashMLA]"
            parts.append(s)
        say(f"  T{T} H{H} median of {args.rounds} rounds (us): " + ", ".join(parts))
        summary.append((T, H, med))
        del w
        torch.cuda.empty_cache()
    if args.csv:
        with open(args.csv, "a", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows[0]))
            if f.tell() == 0:
                wr.writeheader()
            wr.writerows(rows)
    names = list(summary[0][2]) if summary else []
    say("summary, median us: point | " + " | ".join(names))
    for T, H, med in summary:
        say(f"T{T} H{H} | " + " | ".join(f"{med[n] * 1e3:.2f}" for n in names))
    say(f"checks {'ALL OK' if ok else 'FAILURES'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
