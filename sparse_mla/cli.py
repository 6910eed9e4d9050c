"""The ``sparse-mla`` command. Each subcommand is a thin layer over one package module."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["main"]

# Where outputs go when no --out is given: runs/ under the working directory (ignored by git in
# a checkout), never data/, whose files the tests and notebooks read.
RUNS = Path("runs")


def _cmd_check(args: argparse.Namespace) -> int:
    """Run the prefill kernel on random inputs and compare it with the fp32 reference."""
    import torch

    from . import runtime
    from .prefill import sparse_mla_prefill
    from .reference import check_against_reference

    device = "cuda" if runtime.has_gpu() and not args.cpu else "cpu"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    gen = torch.Generator().manual_seed(args.seed)
    T, H, D, N, K = args.tokens, args.heads, args.head_dim, args.pool, args.slots
    if T * K >= 2**31 or N >= 2**31:
        raise UsageError(f"--tokens x --slots ({T * K}) and --pool ({N}) must stay below 2**31")
    # q, out (and the reference's fp32 out), the pool and the slot ids
    _check_fits(T * H * D * 8 + N * D * 2 + T * K * 4, device, "--tokens/--heads/--head-dim/--pool")
    q = torch.randn(T, H, D, generator=gen).to(device=device, dtype=dtype)
    kv = torch.randn(N, D, generator=gen).to(device=device, dtype=dtype)
    lengths = torch.randint(0, K + 1, (T,), generator=gen)
    indptr = torch.zeros(T + 1, dtype=torch.int32)
    indptr[1:] = lengths.cumsum(0)
    idx = torch.randint(-1, N, (int(indptr[-1]),), generator=gen, dtype=torch.int32)
    sink = torch.randn(H, generator=gen).to(device) if args.sink else None
    indptr, idx = indptr.to(device), idx.to(device)
    out = sparse_mla_prefill(q, kv, idx, indptr, D**-0.5, attn_sink=sink)
    report = check_against_reference(out, q, kv, idx, indptr, D**-0.5, attn_sink=sink)
    print(f"device: {runtime.device_name() if device == 'cuda' else 'cpu (Triton interpreter)'}")
    print(f"T={T} H={H} D={D} N={N} slots<={K} dtype={args.dtype} sink={args.sink}")
    print(report)
    return 0 if report.ok else 1


def _memory_bytes(device: str) -> int | None:
    """The memory of ``device`` ("cpu": physical RAM), or None when it cannot be told."""
    import os

    try:
        if device.startswith("cuda"):
            import torch

            return torch.cuda.get_device_properties(torch.device(device)).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AssertionError, AttributeError, ValueError, OSError, RuntimeError):  # no such GPU
        return None


def _check_fits(nbytes: int, device: str, flags: str) -> None:
    """A UsageError when inputs of ``nbytes`` cannot fit ``device``'s memory."""
    have = _memory_bytes(device)
    if have is not None and nbytes > have:
        raise UsageError(
            f"{flags}: the inputs would take {nbytes:.3g} bytes, more than the {have:.3g} bytes "
            f"of {device} memory here"
        )


def _key_value(flag: str, item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise UsageError(f"{flag}: expected KEY=VALUE, got {item!r}")
    return key.strip(), value


def _int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"expected comma-separated integers such as 8,16, got {text!r}") from None


def _cmd_sweep(args: argparse.Namespace) -> int:
    """Sweep launch configs (compile-only resources or GPU timing); rows saved as CSV."""
    import datetime

    from . import tune

    if args.kernel not in (None, "triton"):
        return _sweep_kernel(args)
    grid = tune.parse_grid(args.grid or [])
    targets = [t for item in args.target or ["local"] for t in item.split(",") if t.strip()]
    heads = [h for item in args.heads or ["16"] for h in _int_list(item)]
    dims = [d for item in args.head_dim or ["512"] for d in _int_list(item)]
    workload: dict = {"name": args.workload}
    for item in args.workload_arg or []:
        key, value = _key_value("--workload-arg", item)
        workload[key] = tune._parse_value(value)
    rows = tune.sweep_kernel(
        "triton",
        grid,
        [(h, d) for h in heads for d in dims],
        targets,
        mode=args.mode,
        workload=workload,
        jobs=args.jobs,
        progress=not args.no_progress,
        sample=args.sample,
        seed=args.seed,
        dtype=args.dtype,
    )
    out = args.out
    if out is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        out = RUNS / "sweeps" / f"{args.mode}_{'-'.join(sorted(set(targets)))}_{stamp}.csv"
    path = tune.save_rows(rows, out)
    timed = args.mode == "time"
    metric = ["time_ms", "rel_l2"] if timed else ["spill_bytes", "occupancy", "registers"]
    cols = ["target", "H", "D", *tune.LAUNCH_PARAMS, "status", *metric]
    shown = [r for r in rows if r["rank"] is not None and r["rank"] <= args.top]
    shown += [r for r in rows if r["status"] in ("error", "fail")][: args.top]
    _print_table(shown, cols)
    statuses = ("ok", "fail", "error", "invalid", "skipped")
    counts = {s: sum(r["status"] == s for r in rows) for s in statuses}
    print(", ".join(f"{n} {s}" for s, n in counts.items() if n) + f"; rows saved to {path}")
    return 0 if counts["ok"] else 1


def _sweep_kernel(args: argparse.Namespace) -> int:
    """``sweep --kernel NAME`` for a kernel other than Triton: its knobs over its launch."""
    import datetime

    from . import dispatch, tune

    name = dispatch.kernel(args.kernel).name
    types = tune.knob_types(name)
    grid: dict[str, list] = {}
    for item in args.grid or []:
        knob, sep, values = item.partition("=")
        knob = knob.strip()
        if not sep or not values.strip():
            raise UsageError(f"--grid: expected KNOB=V1,V2,..., got {item!r}")
        if knob not in types:
            raise UsageError(f"--grid {knob}: {name} has no such knob; its knobs: "
                             f"{', '.join(types) or 'none'}")  # fmt: skip
        parsed = [tune._parse_value(v) for v in values.split(",") if v.strip()]
        grid.setdefault(knob, []).extend(parsed)
    targets = [t for item in args.target or ["local"] for t in item.split(",") if t.strip()]
    heads = [h for item in args.heads or ["16"] for h in _int_list(item)]
    dims = [d for item in args.head_dim or ["512"] for d in _int_list(item)]
    workload: dict = {"name": args.workload}
    for item in args.workload_arg or []:
        key, value = _key_value("--workload-arg", item)
        workload[key] = tune._parse_value(value)
    rows = tune.sweep_kernel(
        name, grid, [(h, d) for h in heads for d in dims], targets, mode=args.mode,
        workload=workload, jobs=args.jobs, progress=not args.no_progress, sample=args.sample,
        seed=args.seed, dtype=args.dtype,
    )  # fmt: skip
    out = args.out
    if out is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        out = RUNS / "sweeps" / f"{args.mode}_{name}_{'-'.join(sorted(set(targets)))}_{stamp}.csv"
    path = tune.save_rows(rows, out)
    metric = (
        ["time_ms", "rel_l2"]
        if args.mode == "time"
        else ["spill_bytes", "occupancy", "registers", "shared_bytes"]
    )
    cols = ["kernel", "target", "H", "D", "launch", "status", *metric, "reason"]
    shown = [r for r in rows if r["rank"] is not None and r["rank"] <= args.top]
    shown += [r for r in rows if r["status"] != "ok"][: args.top]
    _print_table(shown, cols)
    counts = {s: sum(r["status"] == s for r in rows) for s in ("ok", "fail", "error", "invalid")}
    print(", ".join(f"{n} {s}" for s, n in counts.items() if n) + f"; rows saved to {path}")
    return 0 if counts["ok"] else 1


def _cmd_kernels(args: argparse.Namespace) -> int:
    """Every registered kernel: name, targets, knobs (field: allowed values), what it reads,
    summary."""
    import json

    from . import dispatch, tune

    cat = tune.catalog()
    if args.json:
        print(json.dumps(cat, indent=1))
        return 0
    for k in cat:
        knobs = "; ".join(f"{f}={','.join(str(v) for v in vs)}" for f, vs in k["knobs"].items())
        print(f"{k['name']}  [{', '.join(k['targets'])}]")
        print(f"  knobs: {knobs or 'none'}")
        ids = ("CSR, dense ids and dense ids with lengths, as they are" if k["dense_ids"]
               else "CSR (the entry packs dense ids to CSR for it)")  # fmt: skip
        print(f"  reads: {dispatch.FORMATS[k['kv_format']]}; slot lists {ids}")
        print(f"  {k['summary']}")
    return 0


def _isa_kernel(args: argparse.Namespace, target) -> int:
    """``isa --kernel NAME`` for a kernel other than Triton: resources, mix, by-line, ISA, diff."""
    from . import dispatch, tune
    from . import inspect as si

    name = args.kernel
    types = tune.knob_types(name)

    def knobs_of(settings) -> dict:
        out = {}
        for key, value in settings or []:
            if key not in types:
                raise UsageError(f"--set {key}: {name} has no such knob; its knobs: "
                                 f"{', '.join(types) or 'none'}")  # fmt: skip
            want = types[key]
            if want is bool and value in (0, 1) and not isinstance(value, bool):
                value = bool(value)
            if type(value) is not want:
                raise UsageError(f"--set {key}={value!r}: {key} takes "
                                 f"{'true/false' if want is bool else 'an integer'}")  # fmt: skip
            out[key] = value
        return out

    knobs, other_knobs = knobs_of(args.set), knobs_of(args.diff_against)
    base, origin = tune.base_launch(name, target, args.heads, args.head_dim,
                                    num_tokens=args.tokens)  # fmt: skip
    try:
        launch = tune.kernel_launch(name, target, args.heads, args.head_dim, knobs, base=base)
        other = (tune.kernel_launch(name, target, args.heads, args.head_dim,
                                    {**knobs, **other_knobs}, base=base)
                 if args.diff_against else None)  # fmt: skip
    except ValueError as e:
        print(f"sparse-mla isa: {name} refuses this launch: {e}", file=sys.stderr)
        return 1
    kw = dict(num_heads=args.heads, head_dim=args.head_dim, dtype=args.dtype,
              index_dtype=args.index_dtype, dense=args.ids)  # fmt: skip
    try:
        _, res = si.compile_kernel(name, target, config=launch, **kw)
    except ValueError as e:  # e.g. --ids dense for a kernel that reads CSR only
        raise UsageError(str(e)) from None
    except si.CompileFailed as e:
        print(f"sparse-mla isa: {e.summary}", file=sys.stderr)
        return 1
    print(f"target: {target.name} ({target.description})")
    print(f"kernel: {name} ({dispatch.kernel(name).summary})")
    print(
        f"launch: {tune.launch_json(name, launch)} (base: {origin}"
        + (f"; with {' '.join(f'{k}={v}' for k, v in knobs.items())} over it)" if knobs else ")")
    )
    print(res.label)
    print(f"compiled in {res.compile_seconds:.2f} s" if not res.from_cache else
          "from the in-memory cache")  # fmt: skip
    _print_compile(si, res, args)
    if other is not None:
        _, res_b = si.compile_kernel(name, target, config=other, **kw)
        d = si.diff(res_b, res)
        print()
        print("diff: a = the --diff-against variant, b = the variant above")
        print(d.summary())
        lines = d.isa_diff.splitlines()
        shown = lines if args.diff_lines == 0 else lines[: args.diff_lines]
        print()
        print("\n".join(shown) if shown else "(ISA identical after normalising)")
    if res.resources.occupancy == 0:
        r = res.resources
        print(f"sparse-mla isa: this launch compiles but cannot launch on {target.name}: "
              f"{r.next_step} ({r.limits_text()})", file=sys.stderr)  # fmt: skip
        return 1
    return 0


def _cmd_profile(args: argparse.Namespace) -> int:
    """Stall reasons and issue slots per source line of one launch, through Nsight Compute."""
    from . import dispatch, tune
    from . import profile as prof

    why = prof.unavailable()
    if why:
        print(f"sparse-mla profile: {why}", file=sys.stderr)
        return 1
    name = dispatch.kernel(args.kernel).name
    bad = prof.workload_error(args.context, args.topk)
    if bad:
        print(f"sparse-mla profile: --context / --topk: {bad}", file=sys.stderr)
        return 2
    knobs = dict(args.set or [])
    launch = tune.kernel_launch(name, "local", args.heads, args.head_dim, knobs,
                                num_tokens=args.tokens)  # fmt: skip
    p = prof.profile(name, args.heads, args.head_dim, launch=launch, num_tokens=args.tokens,
                     context=args.context, topk=args.topk, out_dir=args.out)  # fmt: skip
    print(prof.profile_table(p, top=args.top))
    return 0


def _print_compile(si, res, args) -> None:
    """``isa``'s report of one compile after its first lines: resources, instruction mix, the
    by-line view and the assembly when asked."""
    print()
    print(res.resources)
    print()
    print(si._table(["instructions", "count"], [[k, v] for k, v in res.mix.items()]))
    if args.by_line:
        print()
        print(si.by_line_table(res, top=args.by_line_top))
    if args.asm:
        print()
        print(res.isa if args.asm == "isa" else res.asm[args.asm])


def _print_table(rows: list[dict], cols: list[str]) -> None:
    def fmt(v) -> str:
        if v is None:
            return "-"
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    cells = [[fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


def _cmd_export(args: argparse.Namespace) -> int:
    """Merge a sweep's best config per shape into <root>/<arch>/.../DEFAULT.json (default root:
    the user root, sparse_mla.configs)."""
    from . import tune
    from .targets import get_target

    arch = get_target(args.arch).name
    texts = {}
    for path in args.csv:
        try:
            with open(path, encoding="utf-8", newline="") as f:
                texts[path] = f.read()
        except UnicodeDecodeError as e:
            msg = f"{path}: not a text CSV file ({e.reason} at byte {e.start})"
            raise UsageError(msg) from None
    if args.kernel_choice:
        import csv
        import io

        bench_rows, runs = [], []
        for path in args.csv:
            mine = list(csv.DictReader(io.StringIO(texts[path], newline="")))
            bench_rows += mine
            stamps = sorted({r["timestamp"] for r in mine if r.get("timestamp")})
            runs += stamps[-1:]  # each file's latest run, unless --run names the runs
            if not args.run and len(stamps) > 1:
                print(f"export: {path} holds {len(stamps)} runs; taking the latest, "
                      f"{stamps[-1]} (name the runs to take with --run)",
                      file=sys.stderr)  # fmt: skip
        try:
            diff = tune.export_kernel_choice(
                bench_rows, arch, run=args.run or runs or None,
                source=args.source or " + ".join(args.csv), root=args.root, dry_run=args.dry_run,
            )  # fmt: skip
        except ValueError as e:
            print(f"export: {e}", file=sys.stderr)
            return 1
        print(diff or "export: no change")
        return 0
    if len(args.csv) > 1 or args.run:
        raise UsageError("several CSV files and --run go with --kernel-choice (a sweep is one)")
    args.csv = args.csv[0]
    rows = [r for r in tune.load_rows(args.csv) if get_target(r["target"]).name == arch]
    winners = tune.best_per_shape(rows)
    if not winners:
        print(f"export: {args.csv} has no ok row for {arch}", file=sys.stderr)
        return 1
    compiled = sorted(f"H{h}_D{d}" for (_, h, d), r in winners.items() if r["mode"] != "time")
    if compiled and not args.allow_compile_only:
        print(
            f"export: {compiled} were ranked by compile-only resources, not timed; run a "
            "--mode time sweep, or pass --allow-compile-only",
            file=sys.stderr,
        )
        return 1
    prov = {k: v for k, v in (("source", args.source), ("notes", args.notes)) if v}
    diff = tune.export(
        winners.values(), arch, root=args.root, provenance=prov, dry_run=args.dry_run,
        allow_compile_only=args.allow_compile_only,
    )  # fmt: skip
    print(diff or "export: no change")
    return 0


def _cmd_capture(args: argparse.Namespace) -> int:
    """Record calls made on a named workload into capture files (sparse_mla.capture)."""
    import json
    from pathlib import Path

    import torch

    from . import capture, runtime, workloads

    device = args.device or ("cuda" if runtime.has_gpu() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    overrides: dict = {"device": device, "dtype": dtype, "seed": args.seed}
    for key, value in (("T", args.tokens), ("H", args.heads), ("D", args.head_dim)):
        if value is not None:
            overrides[key] = value
    if args.num_requests is not None:
        overrides["num_requests"] = args.num_requests
    if args.big_buffer is not None:
        overrides["big_buffer"] = args.big_buffer
    for item in args.arg or []:
        key, value = _key_value("--arg", item)
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    if args.workload in workloads.WORKLOADS:  # q alone, before the generator allocates it
        defaults = workloads.WORKLOADS[args.workload][1]
        T, H = overrides.get("T", defaults.get("T")), overrides.get("H", defaults.get("H"))
        D = overrides.get("D", defaults.get("D", 512))
        if all(isinstance(v, int) for v in (T, H, D)):
            _check_fits(T * H * D * 2, device, "--tokens/--heads/--head-dim")
    w = workloads.by_name(args.workload, **overrides)
    out = Path(args.out)
    if out.suffix == ".safetensors":
        out_dir = out.parent
        pattern = out.name if args.calls == 1 else f"{out.stem}_{{call:05d}}.safetensors"
    else:
        out_dir, pattern = out, f"{w.name}_{{call:05d}}.safetensors"
    target = {"triton": None, "reference": "sparse_mla.reference:sparse_mla_prefill_ref"}[
        args.kernel
    ]
    extra = {"workload": args.workload, **{k: v for k, v in w.meta.items() if k != "dtype"}}
    rec = capture.Recorder(
        out_dir,
        target,
        every=args.every,
        first=args.first,
        max_bytes=args.max_bytes,
        filename=pattern,
        source=f"sparse-mla capture --workload {args.workload} ({w.name})",
        extra=extra,
        strict=True,
        synthetic=True,  # a generated workload, not an engine's inputs
    )
    import sparse_mla
    from sparse_mla import reference

    with rec:
        # Looked up inside the block: the module attributes are the patched, recording ones.
        if args.kernel == "triton":
            fn = sparse_mla.sparse_mla_prefill
        else:
            fn = reference.sparse_mla_prefill_ref
        for _ in range(args.calls):
            fn(*w.args(), **w.kwargs())
    if not rec.files and rec.skipped_for_size:
        raise UsageError(
            f"--max-bytes {args.max_bytes}: nothing written, every recorded call's file "
            f"({rec.skipped_for_size} of {rec.calls}) was over the cap"
        )
    for f in rec.files:
        print(f"wrote {f} ({f.stat().st_size} bytes)")
    print(
        f"{w!r}: {rec.calls} calls, {len(rec.files)} recorded, "
        f"{rec.skipped_for_size} skipped by the {args.max_bytes}-byte cap"
    )
    return 0 if rec.files else 1


def _cmd_replay(args: argparse.Namespace) -> int:
    """Replay capture files through a kernel (unreferenced pool rows NaN) against fp32."""
    import json

    from . import capture, runtime, workloads

    device = args.device or ("cuda" if runtime.has_gpu() else "cpu")
    status = 0
    for path in args.files:
        cap = capture.load_capture(path)
        if args.info:
            print(json.dumps(cap.metadata, indent=2, sort_keys=True))
        pool = cap.num_kv * cap.q.shape[-1] * cap.q.element_size()
        big = args.big_buffer if args.big_buffer is not None else device != "cpu"
        _check_fits(pool + (workloads.BIG_BUFFER_BYTES if big else 0), device,
                    f"{path} (a pool of num_kv={cap.num_kv} rows)")  # fmt: skip
        if args.kernel == "reference":
            from .reference import sparse_mla_prefill_ref as fn
        else:
            from .prefill import sparse_mla_prefill as fn
        report = capture.replay(
            cap, fn, device=args.device, big_buffer=args.big_buffer, time=args.time
        )
        print(report)
        status |= 0 if report.ok else 1
    return status


def _parse_setting(text: str) -> tuple[str, object]:
    """KEY=VAL with VAL an int, a bool (true/false/on/off), none/auto (None) or a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VAL, got {text!r}")
    low = raw.strip().lower()
    value: object
    if low in ("none", "auto"):
        value = None
    elif low in ("true", "on", "yes"):
        value = True
    elif low in ("false", "off", "no"):
        value = False
    else:
        try:
            value = int(raw)
        except ValueError:
            value = raw
    return key.strip(), value


# Compiler options `isa --set` takes besides PrefillConfig fields: name -> type.
_OPTION_TYPES: dict[str, type] = {
    "num_warps": int,
    "num_stages": int,
    "num_ctas": int,
    "kpack": int,
    "waves_per_eu": int,
    "matrix_instr_nonkdim": int,
    "maxnreg": int,
    "enable_fp_fusion": bool,
    "debug": bool,
    "schedule_hint": str,
}


def _typed_settings(
    settings: list[tuple[str, object]], field_types: dict[str, tuple[type, bool]]
) -> tuple[dict[str, object], dict[str, object]]:
    """Split ``--set`` values into PrefillConfig fields and compiler options, checking each
    value's type (``EVEN_HD=maybe`` is refused here, not deep inside Triton)."""
    cfg_kw: dict[str, object] = {}
    opts: dict[str, object] = {}
    for key, value in settings:
        if key in field_types:
            kind, nullable = field_types[key]
        elif key in _OPTION_TYPES:
            kind, nullable = _OPTION_TYPES[key], True
        else:
            known = sorted(set(field_types) | set(_OPTION_TYPES))
            raise ValueError(f"--set {key}: unknown setting; known: {', '.join(known)}")
        if kind is bool and value in (0, 1) and not isinstance(value, bool):
            value = bool(value)
        ok = (
            (value is None and nullable)
            or (kind is bool and isinstance(value, bool))
            or (kind is int and isinstance(value, int) and not isinstance(value, bool))
            or (kind is str and isinstance(value, str))
        )
        if not ok:
            what = {bool: "true/false (or 1/0)", int: "an integer", str: "a string"}[kind]
            none = " or none" if nullable else ""
            raise ValueError(f"--set {key}={value!r}: {key} takes {what}{none}")
        (cfg_kw if key in field_types else opts)[key] = value
    return cfg_kw, opts


def _config_origin(arch: str, num_heads: int, head_dim: int) -> str:
    """Where `isa`'s base config comes from: a tuned entry (with its provenance) or the
    default."""
    from . import configs

    entry = configs.lookup_entry(arch, num_heads, head_dim)
    if entry is None:
        path = " or ".join(str(configs.config_path(arch, r)) for r in configs.roots())
        return (
            f"base config: the default for H={num_heads} D={head_dim} "
            f"(prefill.default_config; no tuned entry {configs.shape_key(num_heads, head_dim)} "
            f"in {path})"
        )
    p = entry.provenance
    when = ", ".join(
        str(v)
        for v in (
            p.get("device"),
            f"triton {p['triton']}" if p.get("triton") else None,
            p.get("date"),
            f"{p['time_ms']:.3f} ms" if isinstance(p.get("time_ms"), (int, float)) else None,
            p.get("mode") and f"{p['mode']} sweep",
        )
        if v
    )
    return f"base config: tuned entry {entry.key} in {entry.source} ({when})"


def _cmd_isa(args: argparse.Namespace) -> int:
    """Cross-compile the prefill kernel for a target; print resources, mix, ISA or a diff."""
    from dataclasses import replace

    from . import configs
    from . import inspect as si
    from .prefill import resolve_config
    from .targets import get_target

    target = get_target(args.target)
    stages = ("isa", "ttir", "ttgir", "llir", "amdgcn" if target.is_amd else "ptx")
    if args.asm and args.asm not in stages:
        raise UsageError(f"--asm {args.asm}: {target.name} has no {args.asm} stage; it has "
                         f"{', '.join(stages)}")  # fmt: skip
    if args.slots is not None and (args.kernel != "default" or args.tokens is None):
        raise UsageError("--slots goes with --kernel default and --tokens (the list length "
                         "of the call whose kernel config=None picks)")  # fmt: skip
    if args.kernel == "default":  # the kernel config=None runs at this shape
        from . import dispatch

        c = dispatch.choose(dispatch.Call.of_shape(target.name, args.heads, args.head_dim,
                                                   num_tokens=args.tokens,
                                                   slots_per_token=args.slots))  # fmt: skip
        print(f"default: {c.kernel} ({c.reason})")
        args.kernel = c.kernel
    if args.kernel not in (None, "triton"):
        from . import tune

        try:
            tune._check_target(args.kernel, target)
        except ValueError as e:
            raise UsageError(str(e)) from None
        return _isa_kernel(args, target)
    field_types = configs.launch_types()
    try:
        cfg_kw, opts = _typed_settings(args.set or [], field_types)
        other_kw, other_opts = _typed_settings(args.diff_against or [], field_types)
    except ValueError as e:  # one line on stderr, exit 2, as for every user mistake
        raise UsageError(str(e)) from None

    base = resolve_config(args.heads, args.head_dim, None, target.name)
    cfg = replace(base, **cfg_kw)
    shape = dict(
        num_heads=args.heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        has_sink=args.sink,
        index_dtype=args.index_dtype,
        dense=args.ids,
    )
    origin = _config_origin(target.name, args.heads, args.head_dim)
    if args.set:
        origin += "; with " + " ".join(f"{k}={v}" for k, v in args.set) + " over it"
    try:
        res = si.compile_prefill(target, cfg, options=opts, **shape)
    except si.CompileFailed as e:
        print(f"sparse-mla isa: {e.summary}", file=sys.stderr)
        if e.log_path:
            print(f"sparse-mla isa: compiler output and reproducer kept in {e.log_path}",
                  file=sys.stderr)  # fmt: skip
        return 1
    print(f"target: {target.name} ({target.description})")
    print(origin)
    print(res.label)
    if res.from_cache:
        print(f"from the in-memory cache (first compile took {res.compile_seconds:.2f} s)")
    else:
        print(f"compiled in {res.compile_seconds:.2f} s")
    _print_compile(si, res, args)
    if args.diff_against:
        other_cfg = replace(cfg, **other_kw)
        other = si.compile_prefill(target, other_cfg, options={**opts, **other_opts}, **shape)
        d = si.diff(other, res)
        print()
        print("diff: a = the --diff-against variant, b = the variant above")
        print(d.summary())
        lines = d.isa_diff.splitlines()
        shown = lines if args.diff_lines == 0 else lines[: args.diff_lines]
        print()
        print("\n".join(shown) if shown else "(ISA identical after normalising)")
        if len(shown) < len(lines):
            print(f"... {len(lines) - len(shown)} more lines (--diff-lines 0 shows all)")
    if res.resources.occupancy == 0:
        print(
            f"sparse-mla isa: this config compiles but cannot launch on {target.name}: "
            f"{res.resources.next_step} ({res.resources.limits_text()})",
            file=sys.stderr,
        )
        return 1
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    """Check then time the providers on named workloads (or the H x T grid) against floors
    measured in the run."""
    from pathlib import Path

    import torch

    from . import bench, runtime

    if not args.cpu and not runtime.has_gpu():
        print(
            "sparse-mla bench: needs a GPU (torch sees no CUDA or ROCm device); "
            "--cpu runs a tiny smoke test through Triton's interpreter instead",
            file=sys.stderr,
        )
        return 2
    device = torch.device("cpu" if args.cpu else "cuda")
    providers = [p.strip() for p in (args.providers or "").split(",") if p.strip()] or None
    tokens = [t for item in args.tokens or [] for t in _int_list(item)]
    heads = [h for item in args.heads or [] for h in _int_list(item)]
    for flag, values in (("--tokens", tokens), ("--heads", heads)):
        if any(v < 1 for v in values):
            raise UsageError(f"{flag} must be >= 1, got {min(values)}")
    if args.budget_ms is not None and not args.budget_ms > 0:
        raise UsageError(f"--budget-ms must be > 0, got {args.budget_ms}")
    if args.fp8:
        return _bench_fp8(args, bench, runtime, device, providers, heads, tokens)
    if args.grid:
        return _bench_grid(args, bench, runtime, device, providers, heads, tokens)
    for flag, given in (("--heads", heads), ("--glm/--no-glm", args.glm is not None),
                        ("--time-limit", args.time_limit is not None),
                        ("--context", args.context is not None)):  # fmt: skip
        if given:
            raise UsageError(f"{flag} goes with --grid (a named workload has its own heads)")
    if len(tokens) > 1:
        raise UsageError("several --tokens go with --grid; a named-workload run takes one T")
    default_names = ["csa_h8_topk512"] if args.cpu else list(bench.DEFAULT_WORKLOADS)
    names = [n.strip() for n in (args.workloads or "").split(",") if n.strip()] or default_names
    T = tokens[0] if tokens else (16 if args.cpu else 16384)
    out = args.out
    if out is None and not args.cpu:  # a smoke run saves rows only when --out is given
        out = Path("data/bench") / f"{bench.device_slug(runtime.device_name())}.csv"
    try:
        rows = bench.run_bench(
            names,
            tokens=T,
            providers=providers,
            device=device,
            ceilings=not args.no_ceilings and not args.cpu,
            quick=args.quick,
            check_tokens=args.check_tokens,
            sink=args.sink,
            seed=args.seed,
            commit=args.commit,
            out_path=out,
            aiter_module=args.aiter_module,
            budget_ms=args.budget_ms,
            host=args.host,
            log=_say,
        )
    except ValueError as e:
        print(f"sparse-mla bench: {e}", file=sys.stderr)
        return 2
    print()
    print(bench.format_table(rows))
    return _bench_done(rows, out)


def _say(msg: str) -> None:
    """A progress line, flushed (a long bench run shows each point as it finishes)."""
    print(msg, flush=True)


# A CPU grid (--cpu --grid) is a smoke run in the interpreter: one small point by default.
_CPU_GRID_HEADS = (8,)
_CPU_GRID_TOKENS = (16,)


def _bench_grid(args, bench, runtime, device, providers, heads, tokens) -> int:
    """``bench --grid``: every provider at every (H, T) point in one run."""
    from pathlib import Path

    if args.workloads:
        raise UsageError("--workloads and --grid exclude each other (the grid has its points)")
    if args.time_limit is not None and not args.time_limit > 0:
        raise UsageError(f"--time-limit must be > 0, got {args.time_limit}")
    if not heads:
        heads = list(_CPU_GRID_HEADS if args.cpu else bench.GRID_HEADS)
    if not tokens:
        tokens = list(_CPU_GRID_TOKENS if args.cpu else bench.GRID_TOKENS)
    context = args.context or 0  # (>= 0: _MIN_VALUES)
    if context and args.glm:
        raise UsageError("--glm does not go with --context (the GLM points have no context)")
    out = args.out
    if out is None and not args.cpu:
        suffix = f"_ctx{context}" if context else ""
        out = Path("data/bench") / f"{bench.device_slug(runtime.device_name())}_grid{suffix}.csv"
    try:
        rows = bench.run_grid(
            heads=heads,
            tokens=tokens,
            glm=args.glm is not False and not context,
            context=context,
            providers=providers,
            device=device,
            ceilings=not args.no_ceilings and not args.cpu,
            quick=args.quick,
            check_tokens=args.check_tokens,
            sink=args.sink,
            seed=args.seed,
            commit=args.commit,
            out_path=out,
            aiter_module=args.aiter_module,
            budget_ms=args.budget_ms if args.budget_ms is not None else bench.GRID_BUDGET_MS,
            host=args.host,
            time_limit_s=args.time_limit,
            log=_say,
        )
    except ValueError as e:
        print(f"sparse-mla bench: {e}", file=sys.stderr)
        return 2
    return _bench_done(rows, out)


def _bench_fp8(args, bench, runtime, device, providers, heads, tokens) -> int:
    """``bench --fp8``: the FP8-cache kernels and their peers at the FP8 points, one run."""
    from pathlib import Path

    for flag, given in (("--grid", args.grid), ("--workloads", args.workloads),
                        ("--glm/--no-glm", args.glm is not None), ("--host", args.host),
                        ("--aiter-module", args.aiter_module),
                        ("--context", args.context is not None)):  # fmt: skip
        if given:
            raise UsageError(f"{flag} does not go with --fp8 (it has its own points and peers)")
    if args.time_limit is not None and not args.time_limit > 0:
        raise UsageError(f"--time-limit must be > 0, got {args.time_limit}")
    if args.cpu and not heads and not tokens:  # a smoke run: one small point
        heads, tokens = list(_CPU_GRID_HEADS), list(_CPU_GRID_TOKENS)
    out = args.out
    if out is None and not args.cpu:
        out = Path("data/bench") / f"{bench.device_slug(runtime.device_name())}_fp8.csv"
    try:
        rows = bench.run_fp8(
            heads=heads or None,
            tokens=tokens or None,
            providers=providers,
            device=device,
            ceilings=not args.no_ceilings and not args.cpu,
            quick=args.quick,
            check_tokens=args.check_tokens,
            sink=args.sink,
            seed=args.seed,
            commit=args.commit,
            out_path=out,
            budget_ms=args.budget_ms if args.budget_ms is not None else bench.GRID_BUDGET_MS,
            time_limit_s=args.time_limit,
            log=_say,
        )
    except ValueError as e:
        print(f"sparse-mla bench: {e}", file=sys.stderr)
        return 2
    return _bench_done(rows, out)


def _bench_done(rows, out) -> int:
    """Where the rows went and which providers failed; exit status 1 when one did."""
    if out is not None:
        print(f"{len(rows)} rows appended to {out}")
    bad = [f"{r['workload']}/{r['provider']}" + (f"@T{r['T']}" if r.get("T") else "")
           for r in rows if not r.get("ok")]  # fmt: skip
    if bad:
        print(f"FAILED (not timed): {', '.join(bad)}")
    return 1 if bad else 0


def _cmd_which(args: argparse.Namespace) -> int:
    from . import dispatch

    arch = None if args.arch == "cpu" else args.arch
    if args.table:
        if args.verbose:
            raise UsageError("--table and --verbose: pick one (the table has one kernel a cell)")
        ids = " (dense ids with their rows' lengths)" if args.lengths else ""
        for H in args.heads:
            print(f"{args.arch} H={H} D={args.head_dim}: the kernel config=None runs{ids}")
            print(dispatch.choice_table(arch, H, args.head_dim, args.tokens, args.slots,
                                        dense_lengths=args.lengths))  # fmt: skip
        return 0
    if args.slots and not args.tokens:
        raise UsageError("--slots goes with --tokens (slots per token of a call of T tokens)")
    if args.sms is not None and not (args.tokens and args.slots):
        raise UsageError("--sms goes with --tokens and --slots (the split counts need the lists)")
    if args.sms is not None and args.sms < 1:
        raise UsageError(f"--sms must be >= 1, got {args.sms}")
    for H in args.heads:
        for T in args.tokens or [None]:
            for S in args.slots or [None]:
                print(dispatch.describe(arch, H, args.head_dim, num_tokens=T, verbose=args.verbose,
                                        slots_per_token=S, dense_lengths=args.lengths))  # fmt: skip
                if args.sms is not None:
                    print("  " + _splits_line(arch, H, args.head_dim, T, S, args.sms))
    return 0


def _splits_line(arch, num_heads: int, head_dim: int, T: int, slots: int, sms: int) -> str:
    """How the kernel config=None picks for the shape splits its lists on ``sms`` SMs / CUs."""
    from . import dispatch

    c = dispatch.choose(dispatch.Call.of_shape(arch, num_heads, head_dim, num_tokens=T,
                                               slots_per_token=slots))  # fmt: skip
    k = dispatch.kernel(c.kernel)
    if "num_kv_splits" not in k.per_call_keys:
        return f"{c.kernel} runs each list whole (no KV splits)"
    from .gluon.launch import call_splits, get_target

    ran, splits = call_splits(c.kernel, c.launch, T, num_heads, T * slots, get_target(arch), sms)
    if splits == 1:
        return f"{c.kernel} runs each list whole on {sms} SMs (launch.split_plan)"
    blocks = "" if ran is c.launch else f", in {ran.BLOCK_H}-head blocks"
    if c.kernel == "gluon_ws":
        from .gluon import hopper_ws

        if hopper_ws.l2_rows(splits):
            blocks += ", its producer built with L2_ROWS (hopper_ws.l2_rows)"
    return (f"{c.kernel} splits each list {splits} ways on {sms} SMs{blocks}, then combines "
            "(launch.split_plan)")  # fmt: skip


class _Parser(argparse.ArgumentParser):
    """argparse with whole option names only (``--token`` is not ``--tokens``) and its errors
    on one line, as every other mistake is."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sparse-mla", description=__doc__)
    parser.add_argument(
        "--debug", action="store_true", help="show Python tracebacks (accepted anywhere)"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("check", help="run the prefill kernel once and compare with fp32")
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=512)
    p.add_argument("--pool", type=int, default=1024)
    p.add_argument("--slots", type=int, default=128, help="most slots per token")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--sink", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", action="store_true", help="use the interpreter even with a GPU")
    p.set_defaults(func=_cmd_check)

    p = sub.add_parser("sweep", help="sweep launch configs: compile-only resources or GPU timing")
    p.add_argument("--target", action="append", help="gfx942, gfx950, sm90, local (repeatable)")
    p.add_argument("--heads", action="append", default=None, help="e.g. 8,16,64,128 (default 16)")
    p.add_argument("--head-dim", action="append", default=None, help="e.g. 512 (default 512)")
    p.add_argument("--grid", action="append", metavar="NAME=V1,V2", help="e.g. BLOCK_K=16,32")
    p.add_argument("--mode", choices=["compile", "time"], default="compile")
    p.add_argument("--sample", type=int, default=None, help="run N random configs of the grid")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workload", default="dsv4_csa", help="time mode: sparse_mla.workloads name")
    p.add_argument("--workload-arg", action="append", metavar="KEY=VALUE", help="e.g. T=16384")
    p.add_argument("--jobs", type=int, default=None, help="worker processes")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--out", default=None, help="CSV path (default runs/sweeps/<mode>_...csv)")
    p.add_argument("--top", type=int, default=5, help="rows shown per shape")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--kernel", default=None,
        help="registered kernel swept (default triton; `sparse-mla kernels` lists them and "
        "their knobs, the --grid names)",
    )  # fmt: skip
    p.set_defaults(func=_cmd_sweep)

    p = sub.add_parser(
        "profile",
        help="stall reasons per source line of one launch on this GPU (Nsight Compute, ncu)",
    )
    p.add_argument("--kernel", default="triton", help="registered kernel (`sparse-mla kernels`)")
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--head-dim", type=int, default=512)
    p.add_argument("--tokens", type=int, default=4096, help="T of the DSv4 CSA workload")
    p.add_argument(
        "--context",
        type=int,
        default=0,
        metavar="TOKENS",
        help="tokens already cached before the call, as bench --grid --context builds them "
        "(from 4 x top-k on, every token's list is whole; default 0: a short prompt)",
    )
    p.add_argument(
        "--topk",
        type=int,
        default=None,
        help="the workload's CSA top-k (default: the grid's, 1024 at 96 heads and more, else 512)",
    )
    p.add_argument(
        "--set",
        action="append",
        type=_parse_setting,
        metavar="KNOB=VAL",
        help="a knob of the kernel's launch (repeatable)",
    )
    p.add_argument("--top", type=int, default=20, help="source lines shown")
    p.add_argument("--out", default=None, help="folder for the .ncu-rep report (default: temp)")
    p.set_defaults(func=_cmd_profile)

    p = sub.add_parser("kernels", help="list the registered kernels: targets, knobs, summary")
    p.add_argument("--json", action="store_true", help="a JSON list of {name, targets, knobs, ...}")
    p.set_defaults(func=_cmd_kernels)

    p = sub.add_parser("export", help="merge a sweep's winners into a tuned-config JSON")
    p.add_argument(
        "csv", nargs="+",
        help="rows saved by `sparse-mla sweep` (--kernel-choice: by bench; several files' runs "
        "are taken together, e.g. the grid and a grid with --context)",
    )  # fmt: skip
    p.add_argument("--arch", required=True, help="config file's arch id: sm90, gfx942, ...")
    p.add_argument(
        "--root",
        default=None,
        help="config root (default: $SPARSE_MLA_CONFIG_DIR, else ~/.config/sparse-mla; the "
        "shipped files: sparse_mla/tuned)",
    )
    p.add_argument("--source", default=None, help="provenance: where the sweep came from")
    p.add_argument("--notes", default=None, help="provenance: free text")
    p.add_argument("--dry-run", action="store_true", help="print the diff, write nothing")
    p.add_argument("--allow-compile-only", action="store_true")
    p.add_argument(
        "--kernel-choice",
        action="store_true",
        help="CSV is `sparse-mla bench` rows: record each shape's fastest package kernel "
        "of one run (the entry's 'kernel', read by sparse_mla_prefill's dispatch)",
    )
    p.add_argument(
        "--run", action="append", default=None,
        help="--kernel-choice: a run's timestamp, once per run taken (default: each file's "
        "latest run)",
    )  # fmt: skip
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("capture", help="record calls made on a named workload into captures")
    p.add_argument("--workload", required=True, help="sparse_mla.workloads standard name")
    p.add_argument(
        "--out", default=str(RUNS / "captures"), help="FILE.safetensors or a folder (runs/captures)"
    )
    p.add_argument("--tokens", type=int, default=None, help="override the workload's T")
    p.add_argument("--heads", type=int, default=None, help="override the workload's H")
    p.add_argument("--head-dim", type=int, default=None, help="override the workload's D")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument(
        "--arg",
        action="append",
        metavar="KEY=VALUE",
        help="other generator argument, e.g. context=4096 (JSON value)",
    )
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cpu or cuda (default: the GPU if any)")
    p.add_argument("--big-buffer", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument(
        "--kernel",
        choices=["triton", "reference"],
        default="triton",
        help="the function called and recorded (reference: fast on CPU)",
    )
    p.add_argument("--calls", type=int, default=1, help="calls made")
    p.add_argument("--every", type=int, default=1, help="record every n-th call")
    p.add_argument("--first", type=int, default=None, help="only among the first k calls")
    p.add_argument("--max-bytes", type=int, default=64 * 2**20, help="total bytes written")
    p.set_defaults(func=_cmd_capture)

    p = sub.add_parser("replay", help="replay captures through a kernel and compare with fp32")
    p.add_argument("files", nargs="+", help="capture .safetensors files")
    p.add_argument("--kernel", choices=["triton", "reference"], default="triton")
    p.add_argument("--device", default=None, help="cpu or cuda (default: the GPU if any)")
    p.add_argument(
        "--big-buffer",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pool inside a >2 GiB buffer (default: on GPU only)",
    )
    p.add_argument("--time", action="store_true", help="also time the kernel (GPU)")
    p.add_argument("--info", action="store_true", help="print each capture's metadata")
    p.set_defaults(func=_cmd_replay)
    p = sub.add_parser(
        "isa",
        help="cross-compile the prefill kernel: resources, ISA, diff",
        epilog="exit status: 0 compiled and launchable; 1 the compile failed (one line naming "
        "the pass, the compiler's output kept in a file) or the config cannot launch "
        "(occupancy 0); 2 a --set value of the wrong type or an unknown setting",
    )
    p.add_argument("--target", default="gfx942", help="sm90, sm100, gfx942, gfx950 or local")
    p.add_argument(
        "--kernel",
        default=None,
        help="registered kernel compiled (default triton; 'default': the one config=None runs "
        "at this shape); `sparse-mla kernels` lists them",
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="T of the shape (picks the recorded launch's token bucket)",
    )
    p.add_argument(
        "--slots",
        type=int,
        default=None,
        help="with --kernel default: slots per token of the call (the lists' total length // "
        "T; picks the recorded list-length bucket; default: the longest lists')",
    )
    p.add_argument(
        "--set",
        action="append",
        type=_parse_setting,
        metavar="KEY=VAL",
        help="PrefillConfig field or compiler option (repeatable), e.g. EVEN_HD=1 BLOCK_K=16",
    )
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=512)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--index-dtype", choices=["int32", "int64"], default="int32")
    p.add_argument(
        "--ids",
        choices=["csr", "dense", "lengths"],
        default="csr",
        help="the slot lists' form the build reads: CSR, dense [T, K] ids (DENSE_IDS), or dense "
        "ids with the rows' lengths (kv_lengths); the dense forms for the kernels that read "
        "them (`sparse-mla kernels` says which)",
    )
    p.add_argument("--sink", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--asm",
        nargs="?",
        const="isa",
        choices=["isa", "ttir", "ttgir", "llir", "ptx", "amdgcn"],
        help="print the ISA (default) or an IR stage",
    )
    p.add_argument(
        "--diff-against",
        nargs="+",
        type=_parse_setting,
        metavar="KEY=VAL",
        help="also compile with these settings changed and diff the two",
    )
    p.add_argument("--diff-lines", type=int, default=200, help="ISA diff lines shown (0: all)")
    p.add_argument(
        "--by-line",
        action="store_true",
        help="per kernel source line: the instructions, memory ops, MFMA/MMA and spills it made",
    )
    p.add_argument("--by-line-top", type=int, default=0, help="source lines shown (0: all)")
    p.set_defaults(func=_cmd_isa)

    p = sub.add_parser("bench", help="check and time providers on workloads against the floor")
    p.add_argument("--workloads", default=None, help="comma-separated names (default: the five)")
    p.add_argument(
        "--grid",
        action="store_true",
        help="one run over the H x T grid: DSv4 CSA (top-k 512 + window 128, top-k 1024 from "
        "96 heads) at H 1..128 (16 values) x T 64..16384 (5), plus GLM full top-k 2048 at H "
        "16/32/64, T 16384; default out data/bench/<device>_grid.csv",
    )
    p.add_argument(
        "--fp8",
        action="store_true",
        help="one run on DSv4's FP8 KV cache (MODEL1): fp8_default (config=None on the cache), "
        "every FP8 kernel (fp8_<name>), FlashMLA on a gather-dequantized bf16 workspace "
        "(flashmla*_fp8ws, timed together) and the bf16 default on the dequantized pool, at "
        "CSA T 16384 x H 8/16/32/64/128 plus T 256/1024 at H 16 (--heads/--tokens: that "
        "grid instead); default out data/bench/<device>_fp8.csv",
    )
    p.add_argument(
        "--tokens",
        action="append",
        default=None,
        metavar="T[,T...]",
        help="T (default 16384; --cpu: 16); with --grid a comma-separated list of the grid's T",
    )
    p.add_argument(
        "--heads",
        action="append",
        default=None,
        metavar="H[,H...]",
        help="--grid or --fp8: the head counts (default 1,2,4,...,112,128; --fp8: 8,16,32,64,128)",
    )
    p.add_argument(
        "--glm",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--grid only: include the GLM full top-k points (default on; only where --heads "
        "and --tokens include them)",
    )
    p.add_argument(
        "--context",
        type=int,
        default=None,
        metavar="TOKENS",
        help="--grid only: tokens already cached per request before the call (a chunked-prefill "
        "or MTP step of a long request; from 4 x top-k on every token's list is whole); the CSA "
        "points only (no GLM points), rows' workload csa_h{H}_topk{k}_ctx{TOKENS}; default out "
        "data/bench/<device>_grid_ctx{TOKENS}.csv",
    )
    p.add_argument(
        "--providers",
        default=None,
        help="comma-separated (default: all; --grid: the package's kernels, default, "
        "default_dense, default_dense_len and flashmla): the package's kernels (every "
        "registered name), default (what config=None runs), default_dense and "
        "default_dense_len (config=None on FlashMLA's -1 padded [T, K] ids, without and with "
        "the rows' lengths), default_dense_wide (the ids at an engine's fixed width, top-k + "
        "window, with their lengths and max_kv_length), torch, and the peers flashmla and "
        "aiter when importable (a missing peer is a log line, no row)",
    )
    p.add_argument(
        "--budget-ms",
        type=float,
        default=None,
        help="time each provider and point with as many calls as fit this many ms (at least 5; "
        "default: --grid 40, else do_bench's fixed windows)",
    )
    p.add_argument(
        "--time-limit",
        type=float,
        default=None,
        metavar="SECONDS",
        help="--grid or --fp8: start no point after this many seconds (rows so far are kept)",
    )
    p.add_argument(
        "--aiter-module",
        default=None,
        help="aiter's sparse_attention_dsv4 kernels: a module name or a .py path (default: "
        "aiter_sparse_dsv4_kernels, then the installed aiter's module)",
    )
    p.add_argument(
        "--out",
        default=None,
        help="CSV appended to (default data/bench/<device>.csv; --grid: <device>_grid.csv)",
    )
    p.add_argument(
        "--host",
        action="store_true",
        help="also measure each provider's host time per call (host_us: 200 calls with out= "
        "given, no sync between, wall time / 200; GPU only)",
    )
    p.add_argument("--no-ceilings", action="store_true", help="skip the ceilings (no floor)")
    p.add_argument("--quick", action="store_true", help="short timing windows, 64 checked tokens")
    p.add_argument("--check-tokens", type=int, default=None, help="tokens checked (default 256)")
    p.add_argument("--sink", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--commit", default=None, help="commit recorded (default: git rev-parse HEAD)")
    p.add_argument("--cpu", action="store_true", help="tiny smoke run in the interpreter")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser(
        "which", help="which kernel config=None runs for a shape, and why (the dispatch's choice)"
    )
    p.add_argument("--arch", required=True, help="arch id: sm90, gfx942, gfx950, ... or cpu")
    p.add_argument("--heads", type=int, nargs="+", required=True, help="head counts H")
    p.add_argument("--tokens", type=int, nargs="+", default=None, help="token counts T")
    p.add_argument(
        "--slots", type=int, nargs="+", default=None,
        help="slots per token (a call's lists' total length // T: ~640 for a DSv4 CSA step of "
        "a long request, tens for a short prompt; default: unknown, the longest recorded)",
    )  # fmt: skip
    p.add_argument("--head-dim", type=int, default=512)
    p.add_argument(
        "--lengths", action="store_true",
        help="the lists come as dense [T, K] ids with their rows' lengths (kv_lengths): the "
        "choice passes over kernels that read CSR only (they would get the lists packed)",
    )  # fmt: skip
    p.add_argument(
        "-v", "--verbose", action="store_true",
        help="also say, for every registered kernel, whether it can run the shape",
    )  # fmt: skip
    p.add_argument(
        "--table", action="store_true",
        help="one table a head count: the kernel at each token count (rows, --tokens; default "
        "1 4 16 64 256 1024 16384) and list length (columns, --slots; default 8 384 640 1152)",
    )  # fmt: skip
    p.add_argument(
        "--sms", type=int, default=None,
        help="with --tokens and --slots: also say how many KV splits the kernel runs on a GPU "
        "of this many SMs / CUs (132: H100 / H200)",
    )  # fmt: skip
    p.set_defaults(func=_cmd_which)

    return parser


# Least values of numeric options (by argparse dest); a smaller one is a user mistake.
_MIN_VALUES = {
    "tokens": 0, "heads": 1, "head_dim": 1, "pool": 0, "slots": 0, "num_requests": 1,
    "calls": 1, "every": 1, "first": 0, "max_bytes": 0, "sample": 1, "jobs": 0, "top": 0,
    "check_tokens": 0, "diff_lines": 0, "context": 0,
}  # fmt: skip
# Exceptions that report a user's mistake (bad value, missing or damaged file, unknown name):
# one line on stderr and exit status 2. Anything else is an internal error and keeps its
# traceback. CaptureError and json/csv decode errors are ValueErrors.
_USER_ERRORS = (ValueError, TypeError, KeyError, OSError)


class UsageError(ValueError):
    """A command-line mistake found after parsing (reported like argparse's own)."""


def _check_args(args: argparse.Namespace) -> None:
    for dest, least in _MIN_VALUES.items():
        value = getattr(args, dest, None)
        values = value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, int) and v < least:
                flag = "--" + dest.replace("_", "-")
                raise UsageError(f"{flag} must be >= {least}, got {v}")
    seed = getattr(args, "seed", None)
    if isinstance(seed, int) and not -(2**63) <= seed < 2**64:
        raise UsageError(f"--seed must be in [-2**63, 2**64) (torch's seed range), got {seed}")
    device = getattr(args, "device", None)
    if device is not None:
        import torch

        try:
            kind = torch.device(device).type
        except (RuntimeError, ValueError, TypeError):
            kind = None
        if kind not in ("cpu", "cuda"):
            raise UsageError(f"--device {device}: not supported; use cpu or cuda[:N]")
    if device is not None and str(device).split(":")[0] in ("cuda", "hip"):
        from . import runtime

        if not runtime.has_gpu():
            raise UsageError(f"--device {device}: torch sees no CUDA or ROCm GPU here")
    _check_targets(args)


def _check_targets(args: argparse.Namespace) -> None:
    """``--target local`` and a time sweep need a GPU: say so in one line."""
    from . import runtime

    if args.command not in ("isa", "sweep") or runtime.has_gpu():
        return
    if args.command == "sweep" and args.mode == "time":
        raise UsageError(
            "--mode time: needs a GPU (torch sees no CUDA or ROCm device); --mode compile "
            "ranks configs by cross-compiling without one"
        )
    names = [args.target] if args.command == "isa" else (args.target or ["local"])
    if any(t.strip().lower() == "local" for item in names for t in item.split(",")):
        raise UsageError(
            "--target local: torch sees no GPU on this machine; name a target to cross-compile "
            "for: sm90, sm100, gfx942 or gfx950"
        )


def _one_line(e: BaseException) -> str:
    text = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        text = f"{e.filename}: {e.strerror}"
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return " ".join(lines) or type(e).__name__


def main(argv: list[str] | None = None) -> int:
    """Run a command. A user's mistake prints one line on stderr and returns 2; ``--debug``
    (anywhere on the line) shows the traceback instead."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    args, extra = build_parser().parse_known_args(argv)
    if extra:  # named by the subcommand's prog, like every other mistake
        print(f"sparse-mla {args.command}: error: unrecognized arguments: {' '.join(extra)} "
              f"(see sparse-mla {args.command} --help)", file=sys.stderr)  # fmt: skip
        return 2
    try:
        _check_args(args)
        return args.func(args)
    except _USER_ERRORS as e:
        if debug:
            raise
        print(f"sparse-mla {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except RecursionError:  # reading a file nested past Python's recursion limit (JSON)
        if debug:
            raise
        print(f"sparse-mla {args.command}: error: {_nested_file(args)} is nested too deeply to "
              "read", file=sys.stderr)  # fmt: skip
        return 2


def _nested_file(args: argparse.Namespace) -> str:
    """The file a RecursionError came from: the config file ``export`` merges into (the only
    nested JSON a command reads), else "an input file"."""
    if args.command == "export":
        from . import configs
        from .targets import get_target

        try:
            return str(configs.config_path(get_target(args.arch).name, args.root))
        except Exception:
            pass
    return "an input file"


if __name__ == "__main__":
    sys.exit(main())
