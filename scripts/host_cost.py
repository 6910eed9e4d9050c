"""Host time per call of ``sparse_mla_prefill`` and where it goes (a benchmark, not a test).

Per shape (H, T) and kernel (``default`` = config=None, then each registered kernel forced by
``dispatch.Choice(name)``): 200 back-to-back calls with ``out=`` given and no sync between,
after a warm-up; wall time / 200. With ``--parts`` also the pieces of one call, each timed the
same way: the argument checks (validate_inputs), the cached dispatch, the op's real kernel
without the op dispatcher, the registered kernel's launch alone (its Python and Triton's or
Gluon's launcher), and a cProfile of the full call (--profile).

On a CPU machine the kernels run in Triton's interpreter, so only the host work around the
launch is measured: the kernel's run is replaced by a no-op (``--cpu``; arch faked as sm90 so
the Gluon dispatch path is taken).

``--cpu-launch``: CPU tensors, but the real launch path: every kernel is compiled for sm90
(cross-compiled, as on a machine without the GPU), and Triton's driver is a stand-in whose C
launch is a no-op (its Python wrapper, ``CudaLauncher.__call__`` and the TMA descriptor
wrapper, is Triton's own): the package's Python, ``JITFunction.run`` or the direct path, all
but the driver call.

``--plans off|on|both``: the op's plan replays and the eager bypass of the op dispatcher
(:mod:`sparse_mla.op`) off (every call through ``torch.ops.sparse_mla.prefill`` and the full
``_prefill_impl``) or on (the default). ``--clock cpu``: this thread's CPU time in place of
wall time (on a shared machine).

``--fp8``: the FP8-cache entry (``sparse_mla_prefill(q, FP8Cache, ...)`` ->
``torch.ops.sparse_mla.prefill_fp8``): the same workload's pool quantized into a MODEL1 cache
of 64-token blocks (:func:`sparse_mla.fp8.quantize`), kernels ``default`` (config=None) and
each registered FP8 kernel (``triton_fp8``, ``gluon_ws_small_fp8``, ``gluon_ws_fp8``);
``--parts`` then times the op, the op's kernel (a plan's replay when plans are on), the full FP8
entry and the launch.

``--pointers ints|tensors|both``: a replay's tensor arguments as addresses (the default) or as
the tensors, whose every launch Triton's launcher then asks the driver about
(``cuPointerGetAttribute``); both: a row of each (the plans made anew for each).

``--fast off|on|both``: launches through ``kernel[grid]`` every call (off), or directly after
the first (on, the package's default: :mod:`sparse_mla.fastlaunch`); ``both`` prints a row of
each per kernel, before/after in one run.

``--turns R``: the providers of a shape timed in turns instead of one after another: R rounds
(at least one full set of ``bench.balanced_orders``, rounded up to whole sets), each round one
window of 200 calls per provider in that round's order, so a drift of the host's speed over the
run (clocks, other processes) falls on every provider alike; a row per provider with the min,
median and max of its windows. Plans, direct launch and address pointers as the defaults.

``--kernels ...,flashmla``: also FlashMLA's ``flash_mla_sparse_fwd`` at the same shapes (heads
padded to 64/128), the peer's host time in the same process (GPU; needs ``flash_mla``).

    python scripts/host_cost.py [--parts] [--profile] [--cpu] [--fast both] [--plans both]
        [--clock cpu] [--shapes 16x4,64x4] [--fp8] [--turns 8]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import pstats
import statistics
import sys
import time
from dataclasses import replace

import torch

WINDOWS = 5


CLOCK = time.perf_counter
STAT = statistics.median


def host_us(fn, sync, reps: int = 200, warmup: int = 20, windows: int | None = None) -> float:
    """As ``sparse_mla.bench.host_time_us``: the median of ``windows`` windows of ``reps``
    back-to-back calls (wall time / reps, or this thread's CPU time with ``--clock cpu``),
    each after a sync."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(windows or WINDOWS):
        sync()
        t0 = CLOCK()
        for _ in range(reps):
            fn()
        times.append((CLOCK() - t0) / reps * 1e6)
    sync()
    return STAT(times)


def host_turns(fns, sync, rounds: int, reps: int = 200, warmup: int = 20) -> list[list[float]]:
    """Host time per call (us) of each of ``fns`` in turns: every fn warmed up, then ``rounds``
    rounds (rounded up to whole sets of ``bench.balanced_orders(len(fns))``), each timing one
    window of ``reps`` back-to-back calls of every fn in that round's order, a sync before each
    window. Returns each fn's window times."""
    from sparse_mla.bench import balanced_orders

    for fn in fns:
        for _ in range(warmup):
            fn()
    orders = balanced_orders(len(fns))
    rounds = -(-max(rounds, 1) // len(orders)) * len(orders)
    times: list[list[float]] = [[] for _ in fns]
    for r in range(rounds):
        for i in orders[r % len(orders)]:
            fn = fns[i]
            sync()
            t0 = CLOCK()
            for _ in range(reps):
                fn()
            times[i].append((CLOCK() - t0) / reps * 1e6)
    sync()
    return times


def workload(H: int, T: int, device: str, topk: int = 512, N: int = 65536, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, 512, generator=g).to(torch.bfloat16).to(device)
    kv = torch.randn(N, 512, generator=g).to(torch.bfloat16).to(device)
    idx = torch.randint(0, N, (T * topk,), generator=g, dtype=torch.int32).to(device)
    indptr = torch.arange(0, T * topk + 1, topk, dtype=torch.int32).to(device)
    sink = torch.randn(H, generator=g).to(device)
    return q, kv, idx, indptr, 512**-0.5, sink


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="16x4,64x4,64x16384,16x16384", help="HxT,...")
    ap.add_argument("--parts", action="store_true", help="time the pieces of a call too")
    ap.add_argument("--profile", action="store_true", help="cProfile of 200 full calls")
    ap.add_argument(
        "--cpu", action="store_true", help="CPU tensors, kernel runs replaced by a no-op"
    )
    ap.add_argument(
        "--cpu-launch",
        action="store_true",
        help="CPU tensors, kernels compiled for sm90, a stand-in driver whose launch is a no-op",
    )
    ap.add_argument("--kernels", default=None, help="comma list (default: default + all)")
    ap.add_argument(
        "--validate",
        choices=("none", "true", "false"),
        default="none",
        help="the entry's validate= (none: its default; on CPU that checks values)",
    )
    ap.add_argument(
        "--ids",
        choices=("csr", "dense"),
        default="csr",
        help="the slot lists as CSR (kv_indices [T x 512] + kv_indptr) or dense [T, 512] ids "
        "with kv_indptr=None (an engine's top-k as it is)",
    )
    ap.add_argument("--windows", type=int, default=5, help="windows of 200 calls (median)")
    ap.add_argument(
        "--turns",
        type=int,
        default=0,
        help="time a shape's providers in turns over this many rounds (balanced orders, one "
        "window each a round): min / median / max of each provider's windows",
    )
    ap.add_argument(
        "--fast",
        choices=("off", "on", "both"),
        default="on",
        help="the direct launch path (sparse_mla.fastlaunch): off = kernel[grid] every call",
    )
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall time (default), or this thread's CPU time (a shared CPU machine: other "
        "processes' time left out)",
    )
    ap.add_argument(
        "--stat",
        choices=("median", "min"),
        default="median",
        help="of the windows: median (default, as the bench) or min (a noisy shared machine)",
    )
    ap.add_argument(
        "--plans",
        choices=("off", "on", "both"),
        default="on",
        help="plan replays and the eager bypass of the op dispatcher (sparse_mla.op): off = "
        "every call through torch.ops.sparse_mla.prefill and the full _prefill_impl",
    )
    ap.add_argument(
        "--pointers",
        choices=("ints", "tensors", "both"),
        default="ints",
        help="how a plan's replay hands tensor arguments to Triton's launcher: as addresses "
        "(ints, the package's default) or the tensors (the launcher then calls data_ptr() and "
        "asks the driver about each); both: a row of each, one after the other",
    )
    ap.add_argument(
        "--fp8",
        action="store_true",
        help="the FP8-cache entry (an FP8Cache of the pool, 64-token blocks) and its kernels",
    )
    args = ap.parse_args(argv)
    global WINDOWS, CLOCK, STAT
    WINDOWS = args.windows
    CLOCK = time.thread_time if args.clock == "cpu" else time.perf_counter
    STAT = min if args.stat == "min" else statistics.median
    validate = {"none": None, "true": True, "false": False}[args.validate]

    from sparse_mla import dispatch, fastlaunch, runtime
    from sparse_mla import op as op_mod

    if args.cpu_launch:
        _fake_sm90()
    device = "cpu" if args.cpu or args.cpu_launch else "cuda"
    if device == "cuda":
        dev = torch.device("cuda")

        def sync():
            torch.cuda.synchronize(dev)

        print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton "
              f"{runtime.triton_version()} python {sys.version.split()[0]}")  # fmt: skip
    else:
        from sparse_mla import prefill

        def sync():
            return None

        prefill._arch_of = lambda q: "sm90"  # the sm90 dispatch path, on CPU tensors
        for name, k in list(dispatch.KERNELS.items()):
            run = k.run if args.cpu_launch else (lambda *a: None)
            dispatch.KERNELS[name] = replace(k, run=run, unavailable=(
                k.unavailable if name == "triton" else (lambda call: None)))  # fmt: skip
        what = "a no-op driver launch" if args.cpu_launch else "kernel runs are no-ops"
        print(f"# CPU host work only ({what}) torch {torch.__version__}")
    fmt = "fp8_model1" if args.fp8 else "dense"
    mine = [n for n, k in dispatch.KERNELS.items() if k.kv_format == fmt]
    names = ["default", *mine] if args.kernels is None else args.kernels.split(",")
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.fast]
    plan_modes = {"off": [False], "on": [True], "both": [False, True]}[args.plans]
    ptr_modes = {"ints": [True], "tensors": [False], "both": [False, True]}[args.pointers]
    if not hasattr(fastlaunch, "_POINTER_INTS"):  # older commits: tensors
        ptr_modes = [None]
    has_plans = hasattr(op_mod, "set_plans_enabled")  # older commits: no plans
    if not has_plans:
        plan_modes = [False]
    if args.turns:
        print(f"# clock: {args.clock}, ids {args.ids}, providers in turns: >= {args.turns} "
              "rounds of one window of 200 calls each (balanced orders); us a call")  # fmt: skip
    else:
        print(f"# clock: {args.clock}, ids {args.ids}, {args.stat} of {args.windows} windows of "
              "200 calls")  # fmt: skip
        print(f"{'shape':<12} {'kernel':<16} {'fast':<5} {'plan':<5} {'ptr':<5} {'host_us':>8}  "
              "parts")  # fmt: skip
    for shape in args.shapes.split(","):
        H, T = (int(x) for x in shape.split("x"))
        q, kv, idx, indptr, scale, sink = workload(H, T, device)
        if args.ids == "dense":  # the same uniform lists as [T, 512] ids
            idx, indptr = idx.view(T, -1), None
        if args.fp8:
            from sparse_mla.fp8 import quantize

            kv = quantize(kv, 64)  # an FP8Cache: the entry takes the FP8 op
        out = torch.empty_like(q)
        if args.turns:
            _turns_rows(H, T, names, q, kv, idx, indptr, scale, sink, out, fmt, validate,
                        device, sync, args.turns)  # fmt: skip
            continue
        for name in names:
            if name == "flashmla":  # the peer, in the same process (not a registered kernel)
                if not args.fp8 and device == "cuda":
                    _peer_row(H, T, q, kv, idx, scale, sink, sync)
                continue
            full = _entry_call(name, q, kv, idx, indptr, scale, sink, out, fmt, validate, device)
            if full is None:
                continue
            cfg = None if name == "default" else dispatch.Choice(name)

            for fast, plans, ints in itertools.product(modes, plan_modes, ptr_modes):
                fastlaunch.set_enabled(fast)
                if has_plans:
                    op_mod.set_plans_enabled(plans)
                if ints is not None:
                    fastlaunch._POINTER_INTS[0] = ints
                    op_mod._PLANS.clear()  # replays built anew with this setting
                us = host_us(full, sync)
                parts = ""
                if args.parts and args.fp8:
                    parts = _parts_fp8(q, kv, idx, indptr, scale, sink, out, cfg, validate,
                                       sync)  # fmt: skip
                elif args.parts:
                    parts = _parts(q, kv, idx, indptr, scale, sink, out, cfg, validate, sync)
                if plans and has_plans and hasattr(op_mod, "_IMPL"):
                    parts = f"{_replays(op_mod, full, args.fp8)} {parts}".rstrip()
                fl, pl = ("on" if fast else "off"), ("on" if plans else "off")
                pt = {None: "-", True: "ints", False: "tens"}[ints]
                print(f"H{H} T{T:<7} {name:<16} {fl:<5} {pl:<5} {pt:<5} {us:8.1f}  {parts}",
                      flush=True)  # fmt: skip
                if args.profile:
                    _profile(full, sync)
    fastlaunch.set_enabled(True)
    if ptr_modes != [None]:
        fastlaunch._POINTER_INTS[0] = True
    if has_plans:
        op_mod.set_plans_enabled(True)
    return 0


def _entry_call(name, q, kv, idx, indptr, scale, sink, out, fmt, validate, device):
    """The entry's call as timed: ``config=None`` for ``default``, else the kernel forced by
    name; None where the GPU's kernel cannot take the call."""
    from sparse_mla import dispatch, runtime
    from sparse_mla.prefill import sparse_mla_prefill

    cfg = None if name == "default" else dispatch.Choice(name)
    if cfg is not None and device == "cuda":
        T, H = q.shape[0], q.shape[1]
        call = dispatch.Call(runtime.arch(), H, 512, q.dtype, kv, T, kv_format=fmt)
        if dispatch.kernel(name).unavailable(call):
            return None

    def full():
        sparse_mla_prefill(q, kv, idx, indptr, scale, attn_sink=sink, out=out, config=cfg,
                           validate=validate)  # fmt: skip

    return full


def _peer_row(H, T, q, kv, idx, scale, sink, sync) -> None:
    """FlashMLA's host time per call at the same shape (:func:`_peer_call`); a row saying why
    not when ``flash_mla`` is not importable."""
    try:
        name, call = _peer_call(H, q, kv, idx, scale, sink)
    except ImportError as e:
        print(f"H{H} T{T:<7} {'flashmla':<16} -     -     -     {'-':>8}  not importable: {e}")
        return
    us = host_us(call, sync)
    print(f"H{H} T{T:<7} {name:<16} -     -     -     {us:8.1f}  the peer, same process",
          flush=True)  # fmt: skip


def _peer_call(H, q, kv, idx, scale, sink):
    """(provider name, call) of FlashMLA as an engine calls it at this shape: q and the sink
    zero-padded to 64 (or 128) heads and the [T, 1, top-k] index matrix made once, outside the
    timing; each call allocates its outputs (FlashMLA takes no ``out=``). Needs ``flash_mla``
    importable (the peers' stand-in, ../shared/peers/README.md)."""
    import flash_mla

    heads = 64 if H <= 64 else 128
    T = q.shape[0]
    qp = torch.zeros(T, heads, 512, dtype=q.dtype, device=q.device)
    qp[:, :H] = q
    sp = torch.zeros(heads, dtype=torch.float32, device=q.device)
    sp[:H] = sink
    ind = idx.view(T, 1, -1)  # the workload's uniform lists: top-k 512, a multiple of 128
    kv3 = kv.view(kv.shape[0], 1, 512)

    def call():
        flash_mla.flash_mla_sparse_fwd(qp, kv3, ind, scale, 512, sp)

    return ("flashmla" if heads == H else f"flashmla_pad{heads}"), call


def _turns_rows(H, T, names, q, kv, idx, indptr, scale, sink, out, fmt, validate, device, sync,
                rounds) -> None:  # fmt: skip
    """``--turns``: one shape's providers (``default``, forced kernels the GPU can run, FlashMLA
    when asked and importable) timed in turns (:func:`host_turns`); a row each with the min,
    median and max of its windows, and how many of 200 more calls replayed a plan."""
    from sparse_mla import op as op_mod

    labels, fns, notes = [], [], []
    for name in names:
        if name == "flashmla":
            if fmt != "dense" or device != "cuda":
                continue
            try:
                label, fn = _peer_call(H, q, kv, idx, scale, sink)
            except ImportError as e:
                print(f"H{H} T{T:<7} {'flashmla':<16} not importable: {e}")
                continue
            labels.append(label)
            fns.append(fn)
            notes.append(lambda: "the peer, same process")
            continue
        full = _entry_call(name, q, kv, idx, indptr, scale, sink, out, fmt, validate, device)
        if full is None:
            continue
        labels.append(name)
        fns.append(full)
        notes.append(lambda f=full: _replays(op_mod, f, fmt != "dense"))
    times = host_turns(fns, sync, rounds)
    for label, ts, note in zip(labels, times, notes, strict=True):
        med = statistics.median(ts)
        print(f"H{H} T{T:<7} {label:<16} min {min(ts):6.1f}  median {med:6.1f}  max "
              f"{max(ts):6.1f}  ({len(ts)} windows)  {note()}", flush=True)  # fmt: skip


def _replays(op_mod, fn, fp8: bool, n: int = 200) -> str:
    """``replayed k/n``: of ``n`` more calls, how many replayed a plan (the others ran the
    op's full path once each, recording a plan or not: the dense op's ``_IMPL``, the FP8 op's
    ``_fp8_full`` or ``_record_fp8``); counted after the timing, which it does not touch."""
    seen = [0]
    names = ("_record_fp8", "_fp8_full") if fp8 else ()
    saved = {name: getattr(op_mod, name) for name in names}
    impl = op_mod._IMPL[0]

    def counted(f):
        def g(*a, **k):
            seen[0] += 1
            return f(*a, **k)

        return g

    try:
        for name, f in saved.items():
            setattr(op_mod, name, counted(f))
        if not fp8:
            op_mod._IMPL[0] = counted(impl)
        for _ in range(n):
            fn()
    finally:
        for name, f in saved.items():
            setattr(op_mod, name, f)
        op_mod._IMPL[0] = impl
    return f"replayed {n - seen[0]}/{n}"


def _fake_sm90() -> None:
    """Triton's active driver replaced by :func:`sparse_mla.standin.sm90_driver`, whose launch
    does nothing (``--cpu-launch``): compiles target sm90; the launcher is ``CudaLauncher``'s
    Python around a no-op instead of the compiled C module."""
    from triton.runtime import driver

    from sparse_mla import standin

    driver.set_active(standin.sm90_driver())
    for owner, name, value in standin.sm90_patches():
        setattr(owner, name, value)


def _parts(q, kv, idx, indptr, scale, sink, out, cfg, validate, sync) -> str:
    from sparse_mla import dispatch, op, prefill
    from sparse_mla.validation import validate_inputs

    spec = None if cfg is None else op.config_spec(cfg)
    got = {}
    got["op"] = host_us(lambda: op.prefill_op(q, kv, idx, indptr, scale, sink, out, spec, validate),
                        sync)  # fmt: skip
    if hasattr(op, "_impl") and op.plans_enabled():  # the op's kernel: a plan's replay
        got["plan"] = host_us(
            lambda: op._impl(q, kv, idx, indptr, scale, sink, out, spec, validate), sync
        )
    got["impl"] = host_us(
        lambda: prefill._prefill_impl(q, kv, idx, indptr, scale, sink, out, spec, validate), sync
    )
    got["validate"] = host_us(
        lambda: validate_inputs(
            q, kv, idx, indptr, scale, attn_sink=sink, out=out, validate=validate
        ),
        sync,
    )
    conf = None if spec is None else op.config_object(spec)
    key = None if spec is None else (spec, id(conf))
    arch = prefill._arch_of(q)
    T, H, D = q.shape
    choice = dispatch.choose_cached(arch, H, D, q.dtype, kv, T, idx.numel(), config=conf,
                                    config_key=key)  # fmt: skip
    got["choose"] = host_us(
        lambda: dispatch.choose_cached(arch, H, D, q.dtype, kv, T, idx.numel(), config=conf,
                                       config_key=key), sync)  # fmt: skip
    run = dispatch.kernel(choice.kernel).run
    got["launch"] = host_us(lambda: run(q, kv, idx, indptr, scale, sink, out, choice.launch), sync)
    return f"[{choice.kernel}] " + " ".join(f"{k} {v:.1f}" for k, v in got.items())


def _parts_fp8(q, cache, idx, indptr, scale, sink, out, cfg, validate, sync) -> str:
    from sparse_mla import dispatch, op
    from sparse_mla.fp8_prefill import sparse_mla_prefill_fp8

    spec = None if cfg is None else op.config_spec(cfg)
    data, bs = cache.data, cache.block_size
    got = {}
    got["op"] = host_us(lambda: op.prefill_fp8_op(q, data, bs, idx, indptr, scale, sink, out,
                                                  spec, validate), sync)  # fmt: skip
    if op.plans_enabled():  # the op's kernel: a plan's replay where the call has one
        got["plan"] = host_us(
            lambda: op._fp8_impl(q, data, bs, idx, indptr, scale, sink, out, spec, validate), sync
        )
    got["entry"] = host_us(
        lambda: sparse_mla_prefill_fp8(q, cache, idx, indptr, scale, attn_sink=sink, out=out,
                                       config=cfg, validate=validate), sync)  # fmt: skip
    arch = "sm90" if q.device.type == "cpu" else None
    from sparse_mla import runtime

    arch = arch or runtime.arch(q.device.index or 0)
    T, H, D = q.shape
    call = dispatch.Call(arch, H, D, q.dtype, cache, T, idx.numel(), kv_format="fp8_model1")
    choice = dispatch.choose(call, config=cfg)
    got["choose"] = host_us(lambda: dispatch.choose(call, config=cfg), sync)
    run = dispatch.kernel(choice.kernel).run
    got["launch"] = host_us(lambda: run(q, cache, idx, indptr, scale, sink, out, choice.launch),
                            sync)  # fmt: skip
    return f"[{choice.kernel}] " + " ".join(f"{k} {v:.1f}" for k, v in got.items())


def _profile(fn, sync) -> None:
    for _ in range(20):
        fn()
    sync()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(200):
        fn()
    pr.disable()
    sync()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
    print("\n".join("    " + line for line in s.getvalue().splitlines()[6:]))


if __name__ == "__main__":
    raise SystemExit(main())
