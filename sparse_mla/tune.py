"""Sweeps of the prefill launch and export of the winners into tuned-config files.

A sweep runs a grid (or a random subset of it) of launch parameters x shapes x targets and
returns tidy rows, one per (target, shape, config):

- ``mode="compile"`` needs no GPU: each config is cross-compiled with
  :func:`sparse_mla.inspect.compile_prefill`, in parallel over the CPU cores, and ranked by
  resources: no spills first, then higher occupancy, then fewer registers.
- ``mode="time"`` needs GPUs: each config first passes the correctness gate (one run on the
  workload, compared with the fp32 reference), then is timed with
  ``triton.testing.do_bench(return_mode="median")``; one worker process per visible GPU.

A config that cannot run is a row with ``status`` ``"invalid"`` (rejected before compiling),
``"error"`` (compile or launch failed), ``"fail"`` (wrong results) or ``"skipped"`` (a head
block larger than the heads need), with a ``reason``; a sweep never stops on one. Rows are saved
as CSV under data/ (:func:`save_rows`), winners picked by :func:`best_per_shape` and merged
into the JSON files by :func:`export`, atomically and under a file lock.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import csv
import datetime as _dt
import difflib
import fcntl
import itertools
import json
import math
import multiprocessing as mp
import os
import random
import stat
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from . import configs
from . import inspect as _inspect
from ._files import atomic_write

__all__ = [
    "COLUMNS",
    "LAUNCH_PARAMS",
    "base_launch",
    "best_per_shape",
    "catalog",
    "expand_grid",
    "export",
    "export_kernel_choice",
    "export_launch",
    "kernel_choices",
    "kernel_launch",
    "kernel_targets",
    "knob_types",
    "load_rows",
    "parse_grid",
    "save_rows",
    "sweep",
    "sweep_kernel",
]

# PrefillConfig's fields, in order (a new kernel knob joins the grid and the CSV by itself).
LAUNCH_PARAMS = tuple(configs.launch_types())
_AMD_ONLY = ("kpack", "waves_per_eu")
_NVIDIA_ONLY = ("maxnreg",)
_BOOL_PARAMS = tuple(k for k, (t, _) in configs.launch_types().items() if t is bool)

COLUMNS = (
    "target",
    "H",
    "D",
    "dtype",
    "mode",
    *LAUNCH_PARAMS,
    "status",
    "reason",
    "rank",
    "time_ms",
    "rel_l2",
    "max_abs",
    "occupancy",
    "spill_bytes",
    "registers",
    "shared_bytes",
    "compile_s",
    "sweep_size",
    "workload",
    "device",
    "triton",
    "torch",
    "date",
)
_INT_COLS = {"H", "D", "rank", "spill_bytes", "registers", "shared_bytes", "sweep_size"}
_INT_COLS |= {p for p in LAUNCH_PARAMS if p not in _BOOL_PARAMS}
_FLOAT_COLS = {"time_ms", "rel_l2", "max_abs", "occupancy", "compile_s"}
_STATUSES = ("ok", "fail", "error", "invalid", "skipped")

# Tokens of the correctness gate in time mode (the last ones of the timed workload).
_CHECK_TOKENS = 256
# sparse_mla.workloads generators a time sweep can call as fn(T, H, **kw).
_GENERATORS = ("dsv4_csa", "dsv4_hca", "glm_full_topk", "flashmla_uniform")


# ----------------------------------------------------------------------------------------------
# Grid
# ----------------------------------------------------------------------------------------------


def _parse_value(text: str):
    t = text.strip()
    low = t.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null", "auto"):
        return None
    try:
        return int(t)
    except ValueError:
        raise ValueError(f"grid: value {text!r} is not an int, true/false or none") from None


def parse_grid(items: Iterable[str]) -> dict[str, list]:
    """``["BLOCK_K=16,32", "num_warps=1,2"]`` -> ``{"BLOCK_K": [16, 32], "num_warps": [1, 2]}``."""
    grid: dict[str, list] = {}
    for item in items:
        name, sep, values = item.partition("=")
        name = name.strip()
        if not sep or not values.strip():
            raise ValueError(f"grid: expected NAME=V1,V2,..., got {item!r}")
        if name not in LAUNCH_PARAMS:
            raise ValueError(f"grid: unknown parameter {name!r}; expected one of {LAUNCH_PARAMS}")
        grid.setdefault(name, [])
        grid[name] += [_parse_value(v) for v in values.split(",") if v.strip()]
    return grid


def expand_grid(
    grid: Mapping[str, Iterable], *, sample: int | None = None, seed: int = 0
) -> list[dict[str, Any]]:
    """All combinations of ``grid`` (param -> values), or ``sample`` of them drawn with ``seed``.

    Parameters not in the grid keep PrefillConfig's defaults. The same configs are then run for
    every shape and target.
    """
    if not isinstance(grid, Mapping):
        raise TypeError(f"grid must be a dict of parameter -> values, got {type(grid).__name__}")
    names = list(grid)
    for n in names:
        if n not in LAUNCH_PARAMS:
            raise ValueError(f"grid: unknown parameter {n!r}; expected one of {LAUNCH_PARAMS}")
    values = []
    for n in names:
        v = grid[n]
        v = [v] if isinstance(v, (int, bool)) or v is None else list(dict.fromkeys(v))
        if not v:
            raise ValueError(f"grid: parameter {n!r} has no values")
        values.append(v)
    combos = [dict(zip(names, c, strict=True)) for c in itertools.product(*values)]
    if sample is not None:
        if isinstance(sample, bool) or not isinstance(sample, int) or sample < 1:
            raise ValueError(f"sample must be a positive int, got {sample!r}")
        if sample < len(combos):
            combos = random.Random(seed).sample(combos, sample)
    return combos


def _target(name):
    from .targets import get_target

    return get_target(name)


def _normalize_shapes(shapes) -> list[tuple[int, int]]:
    if isinstance(shapes, tuple) and len(shapes) == 2 and all(isinstance(s, int) for s in shapes):
        shapes = [shapes]
    out = []
    for s in shapes:
        if isinstance(s, str):
            s = configs.parse_shape_key(s)
        H, D = s
        if isinstance(H, bool) or not isinstance(H, int) or H < 1:
            raise ValueError(f"shapes: num_heads must be a positive int, got {H!r}")
        if isinstance(D, bool) or not isinstance(D, int) or D < 1:
            raise ValueError(f"shapes: head_dim must be a positive int, got {D!r}")
        out.append((H, D))
    if not out:
        raise ValueError("shapes: need at least one (num_heads, head_dim)")
    return list(dict.fromkeys(out))


def _precheck(target, H: int, D: int, params: dict[str, Any]) -> tuple[str, str | None]:
    """("ok", None) or (status, reason), decided without compiling."""
    from .prefill import PrefillConfig
    from .targets import validate_options

    try:
        cfg = PrefillConfig.from_dict(params)
        cfg.validate()
        block_d = 1 << (D - 1).bit_length()
        if cfg.EVEN_HD and not (block_d == D and H % cfg.BLOCK_H == 0):
            raise ValueError(
                f"EVEN_HD needs head_dim == BLOCK_D and H % BLOCK_H == 0 "
                f"(H={H}, D={D}, BLOCK_H={cfg.BLOCK_H})"
            )
        validate_options(target, _options(cfg, target.is_amd))
    except (TypeError, ValueError) as e:
        return "invalid", str(e)
    if max(16, 1 << (H - 1).bit_length()) < cfg.BLOCK_H:
        return "skipped", f"BLOCK_H={cfg.BLOCK_H} > {H} heads: the extra rows are all masked"
    return "ok", ""


def _options(cfg, amd: bool) -> dict[str, Any]:
    return cfg.compile_options("hip" if amd else "cuda")


def _plan(grid, shapes, targets, sample, seed, dtype, mode) -> list[dict[str, Any]]:
    combos = expand_grid(grid, sample=sample, seed=seed)
    if isinstance(targets, str):
        targets = [targets]
    rows = []
    for tname in dict.fromkeys(targets):
        t = _target(tname)
        seen = set()
        for H, D in _normalize_shapes(shapes):
            for params in combos:
                # One vendor's compiler options mean nothing on the other's: drop them (and the
                # duplicates that leaves).
                other = _NVIDIA_ONLY if t.is_amd else _AMD_ONLY
                p = {k: v for k, v in params.items() if k not in other}
                key = (H, D, tuple(sorted(p.items(), key=lambda kv: kv[0])))
                if key in seen:
                    continue
                seen.add(key)
                row = {"target": t.name, "H": H, "D": D, "dtype": dtype, "mode": mode}
                row.update(_full_params(p))
                row["status"], row["reason"] = _precheck(t, H, D, p)
                row["_params"] = p
                rows.append(row)
    return rows


def _full_params(p: dict[str, Any]) -> dict[str, Any]:
    from .prefill import PrefillConfig

    try:
        cfg = PrefillConfig(**p)
        return {k: getattr(cfg, k) for k in LAUNCH_PARAMS}
    except TypeError:
        return {k: p.get(k) for k in LAUNCH_PARAMS}


# ----------------------------------------------------------------------------------------------
# Workers
# ----------------------------------------------------------------------------------------------


def _compile_job(job: dict[str, Any]) -> dict[str, Any]:
    """Cross-compile one config; the resource columns of its row."""
    from .prefill import PrefillConfig

    t0 = time.perf_counter()
    try:
        with _inspect.compiler_quiet():
            if job.get("_kernel") is not None:  # another registered kernel (sweep_kernel)
                res = _inspect.compile_kernel(
                    job["_kernel"], job["target"], num_heads=job["H"], head_dim=job["D"],
                    config=job["_launch"], dtype=job["dtype"],
                )[1]  # fmt: skip
            else:
                res = _inspect.compile_prefill(
                    job["target"],
                    PrefillConfig.from_dict(job["_params"]),
                    num_heads=job["H"],
                    head_dim=job["D"],
                    dtype=job["dtype"],
                )
    except Exception as e:  # compile errors of any kind become a row
        reason = _inspect.failure_reason(e)
        return {"status": "error", "reason": reason, "compile_s": time.perf_counter() - t0}
    return {
        "status": "ok",
        "reason": None,
        **_resource_columns(res.resources),
        "compile_s": getattr(res, "compile_seconds", None) or time.perf_counter() - t0,
    }


def _resource_columns(r) -> dict[str, Any]:
    """The sweep's resource columns of an ``inspect.Resources`` (AMD or NVIDIA)."""
    registers = getattr(r, "total_vgprs", None)
    if registers is None:
        registers = getattr(r, "registers", None)
    shared = getattr(r, "shared_bytes", None)
    if shared is None:
        shared = getattr(r, "lds_bytes", None)
    return {
        "occupancy": getattr(r, "occupancy", None),
        "spill_bytes": getattr(r, "spill_bytes", None),
        "registers": registers,
        "shared_bytes": shared,
    }


# Per-process state of a time-mode worker: its GPU lock and the workloads built so far.
_WORKER: dict[str, Any] = {"lock": None, "workloads": {}}


def _init_time_worker(gpu: int | None, lock) -> None:
    # Runs before the worker touches CUDA, so the variable decides which GPU it sees.
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    _WORKER["lock"] = lock


def _random_workload(T: int, H: int, D: int, *, slots: int, pool: int, dtype, device, seed: int):
    """Built-in inputs when sparse_mla.workloads is absent: random CSR slot lists.

    The KV pool is a view into a buffer of more than 2 GiB on a GPU, as in an engine (Triton
    compiles a different variant for small buffers on AMD).
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g).to(device=device, dtype=dtype)
    if device != "cpu":
        rows = max(pool, (2**31 + 2**20) // (D * torch.finfo(dtype).bits // 8))
        buf = torch.empty(rows, D, dtype=dtype, device=device)
        kv = buf[:pool]
        kv.copy_(torch.randn(pool, D, generator=g).to(dtype))
    else:
        kv = torch.randn(pool, D, generator=g).to(dtype)
    lengths = torch.randint(max(1, slots // 2), slots + 1, (T,), generator=g)
    indptr = torch.zeros(T + 1, dtype=torch.int32)
    indptr[1:] = lengths.cumsum(0)
    idx = torch.randint(0, pool, (int(indptr[-1]),), generator=g, dtype=torch.int32)
    idx[torch.rand(idx.numel(), generator=g) < 0.02] = -1  # a few absent top-k entries
    sink = torch.randn(H, generator=g).to(device)
    args = (q, kv, idx.to(device), indptr.to(device), D**-0.5)
    return args, {"attn_sink": sink}


def _workload(spec: dict[str, Any], H: int, D: int, dtype_name: str, device: str):
    """(args, kwargs, description) for sparse_mla_prefill at shape (H, D); cached per worker."""
    import torch

    key = (json.dumps(spec, sort_keys=True), H, D, dtype_name, device)
    if key in _WORKER["workloads"]:
        return _WORKER["workloads"][key]
    _WORKER["workloads"].clear()  # one shape at a time: a 16k-token H=128 call is GiBs
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    spec = dict(spec)
    name = spec.pop("name", "random")
    try:
        from . import workloads as _wl
    except ImportError:  # the built-in generator below stands in
        _wl = None
    if name != "random" and _wl is None:
        raise RuntimeError(f"workload {name!r} needs sparse_mla.workloads, which is missing")
    if name == "random" or _wl is None:
        T = int(spec.get("T", 4096))
        slots = int(spec.get("slots", 640))
        pool = int(spec.get("pool", 65536))
        args, kwargs = _random_workload(
            T, H, D, slots=slots, pool=pool, dtype=dtype, device=device, seed=spec.get("seed", 0)
        )
        desc = f"random CSR T={T} slots<={slots} pool={pool} sink"
    else:
        kw = {"D": D, "dtype": dtype, "device": device, "big_buffer": device != "cpu", **spec}
        if name in _GENERATORS:
            w = getattr(_wl, name)(int(kw.pop("T", 16384)), H, **kw)
        else:  # a standard name (workloads.standard_names()), at this shape's H
            w = _wl.by_name(name, H=H, **kw)
        args, kwargs = tuple(w.args()), dict(w.kwargs())
        m = w.meta
        keys = ("kind", "T", "topk", "ratio", "window", "num_requests", "pool_rows", "nnz")
        desc = " ".join([w.name, *(f"{k}={m[k]}" for k in keys if k in m)])
    # The fp32 reference of the checked tokens, computed once per shape.
    from .reference import sparse_mla_prefill_ref

    q, kv, idx, indptr, scale = args[:5]
    # The last tokens: the longest slot lists. Tokens are independent, so a slice is exact.
    n = min(_CHECK_TOKENS, q.shape[0])
    sub = (q[q.shape[0] - n :], kv, idx, indptr[q.shape[0] - n :], scale)
    sink = kwargs.get("attn_sink")
    ref = sparse_mla_prefill_ref(*sub, attn_sink=sink)
    base = sparse_mla_prefill_ref(*sub, attn_sink=sink, upcast=False)
    found = _WORKER["workloads"][key] = (args, kwargs, desc, n, ref, base)
    return found


def _bench(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, return_mode="median"))


def _time_job(job: dict[str, Any]) -> dict[str, Any]:
    """Correctness gate then do_bench median for one config on this worker's GPU."""
    import torch

    from . import prefill
    from .prefill import PrefillConfig
    from .reference import error_report

    device = job.get("_device", "cuda")
    # Workers sharing a GPU hold its lock for GPU work; only compiling runs outside it.
    lock = _WORKER["lock"] or contextlib.nullcontext()
    try:
        with lock:
            args, kwargs, desc, n, ref, base = _workload(
                job["_workload"], job["H"], job["D"], job["dtype"], device
            )
            out = torch.full_like(args[0], float("nan"))
    except Exception as e:
        return {"status": "error", "reason": "workload: " + _inspect.failure_reason(e)}
    if job.get("_kernel") is not None:  # another registered kernel (sweep_kernel)
        from .dispatch import Choice

        cfg = Choice(job["_kernel"], job["_launch"])
    else:
        cfg = PrefillConfig.from_dict(job["_params"])

    def fn():
        return prefill.sparse_mla_prefill(*args, **kwargs, out=out, config=cfg)

    row: dict[str, Any] = {"workload": desc, "T": int(args[0].shape[0])}
    try:
        t0 = time.perf_counter()
        with _inspect.compiler_quiet():
            triton_launch = job.get("_kernel") is None
            compiled = _compile_only(fn) if device != "cpu" and triton_launch else None
        row["compile_s"] = time.perf_counter() - t0
        if compiled is not None:
            # The launched kernel's own registers / occupancy, as in compile mode; a resource
            # read that fails leaves those columns empty.
            with contextlib.suppress(Exception):
                row.update(_resource_columns(_inspect.resources_of(compiled, job["target"])))
        with lock:
            with _inspect.compiler_quiet():  # a compile that failed above fails here again
                fn()
            _sync(device)
            rep = error_report(out[out.shape[0] - n :], ref, base)
            row.update(rel_l2=rep.rel_l2, max_abs=rep.max_abs)
            if not rep.ok:
                row.update(status="fail", reason=f"correctness: {rep}")
                return row
            row["time_ms"] = _bench(fn)
    except Exception as e:
        row.update(status="error", reason=_inspect.failure_reason(e))
        return row
    row.update(status="ok", reason=None)
    return row


def _compile_only(fn):
    """Call ``fn`` with kernel launches replaced by Triton's JIT warmup: compile, don't run.

    Both launch routes are caught: :func:`sparse_mla.runtime.launch` and the direct-launch
    path every GPU launch of the package takes (:class:`sparse_mla.fastlaunch.Launcher`), with
    the op's plan replays off for the call (a replay launches what it recorded, not through
    either). The compiled kernel lands in the JIT cache, so the next real call launches at
    once. A failure here is left for that call to report. Returns the last kernel compiled (a
    ``CompiledKernel``), or None.
    """
    from . import fastlaunch, op, runtime

    real, real_call = runtime.launch, fastlaunch.Launcher.__call__
    compiled = []

    def warm(kernel, grid, *args, interpret, **kw):
        if interpret:
            return None
        with runtime.compiling():
            compiled.append(kernel.warmup(*args, grid=grid, **kw))
        return None

    def warm_direct(self, grid, args, kwargs):
        with runtime.compiling():
            compiled.append(self.fn.warmup(*fastlaunch.jit_args(args), grid=grid, **kwargs))

    runtime.launch = warm
    fastlaunch.Launcher.__call__ = warm_direct
    plans = op.set_plans_enabled(False)
    try:
        fn()
    except Exception:
        pass
    finally:
        runtime.launch = real
        fastlaunch.Launcher.__call__ = real_call
        op.set_plans_enabled(plans)
    return compiled[-1] if compiled else None


def _sync(device: str) -> None:
    import torch

    if device != "cpu":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------
# Sweep
# ----------------------------------------------------------------------------------------------


def _in_jupyter() -> bool:
    """Whether this runs in a Jupyter kernel (its stderr shows pink: progress goes to stdout)."""
    ip = sys.modules.get("IPython")
    shell = ip.get_ipython() if ip is not None and hasattr(ip, "get_ipython") else None
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


class _Progress:
    """tqdm when installed, else one rewritten line; on stderr in a terminal, on stdout in a
    Jupyter kernel (where stderr is drawn as an error)."""

    def __init__(self, total: int, desc: str, enabled: bool):
        self.total, self.desc, self.enabled = total, desc, enabled
        self.stream = sys.stdout if _in_jupyter() else sys.stderr
        self.done = self.bad = 0
        self.t0 = time.perf_counter()
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=desc, file=self.stream, leave=True)
            except ImportError:
                self._draw()

    def update(self, status: str) -> None:
        self.done += 1
        self.bad += status != "ok"
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(not_ok=self.bad, refresh=False)
        else:
            self._draw()

    def _draw(self) -> None:
        dt = time.perf_counter() - self.t0
        self.stream.write(
            f"\r{self.desc}: {self.done}/{self.total} ({self.bad} not ok) {dt:.0f}s"
            + ("\n" if self.done == self.total else "")
        )
        self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def sweep(
    grid: Mapping[str, Iterable],
    shapes,
    targets,
    *,
    mode: str = "compile",
    workload: str | Mapping[str, Any] = "dsv4_csa",
    jobs: int | None = None,
    progress: bool = True,
    sample: int | None = None,
    seed: int = 0,
    dtype: str = "bf16",
) -> list[dict[str, Any]]:
    """Run a grid of launch configs over shapes and targets; tidy rows, best first per shape.

    Args:
        grid: parameter -> values, over :data:`LAUNCH_PARAMS` (others keep PrefillConfig's
            defaults), e.g. ``{"BLOCK_K": [16, 32], "num_warps": [1, 2, 4]}``.
        shapes: (num_heads, head_dim) pairs (or ``"H16_D512"`` keys).
        targets: target names (``"gfx942"``, ``"sm90"``, ``"local"``); time mode times on the
            local GPUs, so there it takes only the local arch.
        mode: ``"compile"`` (no GPU: cross-compile, rank by resources) or ``"time"`` (GPU:
            correctness gate, then do_bench median).
        workload: time mode only: a name for ``sparse_mla.workloads.by_name`` (``"dsv4_csa"``)
            or a dict ``{"name": ..., **kwargs}``; ``"random"`` (or a missing workloads module
            with a dict spec of T/slots/pool) uses a built-in random CSR generator.
        jobs: compile mode: worker processes (default: all CPU cores; 0 = in this process).
            Time mode: worker processes in all, spread over the visible GPUs (default one per
            GPU); 0 = in this process on the current device.
        progress: show progress on stderr.
        sample, seed: run ``sample`` configs drawn from the grid instead of all of it.
        dtype: ``"bf16"`` or ``"fp16"``.

    Returns:
        One dict per (target, shape, config) with the columns of :data:`COLUMNS`; ``rank`` is
        1 for the best ``ok`` row of each (target, H, D).
    """
    if mode not in ("compile", "time"):
        raise ValueError(f"mode must be 'compile' or 'time', got {mode!r}")
    if dtype not in ("bf16", "fp16"):
        raise ValueError(f"dtype must be 'bf16' or 'fp16', got {dtype!r}")
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 0):
        raise ValueError(f"jobs must be an int >= 0 or None, got {jobs!r}")
    rows = _plan(grid, shapes, targets, sample, seed, dtype, mode)
    return _execute(rows, mode, workload, jobs, f"sweep ({mode})", progress)


def _execute(rows, mode, workload, jobs, label, progress) -> list[dict[str, Any]]:
    """Run a planned sweep's ``ok`` rows (compile, or check then time on ``workload``) behind
    one progress bar, stamp and rank them: the tail of :func:`sweep` and :func:`sweep_kernel`."""
    todo = [r for r in rows if r["status"] == "ok"]
    if mode == "time":
        spec = {"name": workload} if isinstance(workload, str) else dict(workload)
        _check_time_targets(rows)
        for r in todo:
            r["_workload"] = spec
    bar = _Progress(len(rows), label, progress)
    for r in rows:
        if r["status"] != "ok":
            bar.update(r["status"])
    try:
        if mode == "compile":
            _run_compile(todo, jobs, bar)
        else:
            _run_time(todo, jobs, bar)
    finally:
        bar.close()
    _stamp(rows, mode)
    return _rank(rows)


def _check_time_targets(rows) -> None:
    from . import runtime

    local = runtime.arch()
    if local is None:
        raise RuntimeError("sweep(mode='time') needs a GPU; use mode='compile' on this machine")
    local_name = _target("local").name
    wrong = sorted({r["target"] for r in rows} - {local_name})
    if wrong:
        raise ValueError(f"time mode runs on the local GPUs ({local_name}); got targets {wrong}")


def _run_compile(todo, jobs, bar) -> None:
    workers = (os.cpu_count() or 1) if jobs is None else jobs
    if workers == 0 or len(todo) <= 1:
        for r in todo:
            r.update(_compile_job(_job(r)))
            bar.update(r["status"])
        return
    # fork: no CUDA here and no re-import of torch per worker; spawn elsewhere.
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with cf.ProcessPoolExecutor(max_workers=min(workers, len(todo)), mp_context=ctx) as pool:
        futures = {pool.submit(_compile_job, _job(r)): r for r in todo}
        for fut in cf.as_completed(futures):
            r = futures[fut]
            try:
                r.update(fut.result())
            except Exception as e:  # a worker that died (e.g. a crash inside LLVM)
                r.update(status="error", reason="worker: " + _inspect.failure_reason(e))
            bar.update(r["status"])


def _job(r: dict[str, Any]) -> dict[str, Any]:
    keys = ("target", "H", "D", "dtype", "_params", "_workload", "_device", "_kernel", "_launch")
    return {k: r[k] for k in keys if k in r}


def _visible_gpus() -> list[int]:
    import torch

    return list(range(torch.cuda.device_count()))


def _run_time(todo, jobs, bar) -> None:
    if jobs == 0 or not todo:
        try:
            for r in todo:
                r.update(_time_job(_job(r)))
                bar.update(r["status"])
        finally:
            _WORKER["workloads"].clear()
        return
    gpus = _visible_gpus()
    ctx = mp.get_context("spawn")  # CUDA cannot be forked
    n = len(gpus) if jobs is None else max(jobs, 1)
    locks = {g: ctx.Lock() for g in gpus}
    # CUDA_VISIBLE_DEVICES names physical ids; map our logical index back when it is set.
    phys = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [s.strip() for s in phys.split(",")] if phys else [str(g) for g in gpus]
    slots = [gpus[i % len(gpus)] for i in range(n)]

    def new_pool(g):
        return cf.ProcessPoolExecutor(
            max_workers=1,
            mp_context=ctx,
            initializer=_init_time_worker,
            initargs=(ids[g], locks[g]),
        )

    pools = [new_pool(g) for g in slots]
    queue = list(todo)
    running: dict[cf.Future, tuple[int, dict]] = {}
    try:
        while queue or running:
            busy = {i for i, _ in running.values()}
            for i in range(n):
                if i not in busy and queue:
                    r = queue.pop(0)
                    running[pools[i].submit(_time_job, _job(r))] = (i, r)
            done, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
            for fut in done:
                i, r = running.pop(fut)
                try:
                    r.update(fut.result())
                except Exception as e:  # the worker died (e.g. an illegal memory access)
                    r.update(status="error", reason="worker: " + _inspect.failure_reason(e))
                    pools[i].shutdown(wait=False, cancel_futures=True)
                    pools[i] = new_pool(slots[i])
                bar.update(r["status"])
    finally:
        for p in pools:
            p.shutdown(wait=True, cancel_futures=True)


def _stamp(rows, mode) -> None:
    import torch
    import triton

    from . import runtime

    today = _dt.date.today().isoformat()
    device = runtime.device_name() if mode == "time" else "compile-only"
    for r in rows:
        r.pop("_params", None)
        r.pop("_workload", None)
        r.pop("_device", None)
        r.pop("_kernel", None)
        r.pop("_launch", None)
        r.setdefault("workload", "compile-only" if mode == "compile" else "")
        r.update(device=device, triton=triton.__version__, torch=torch.__version__, date=today)


def _sort_key(r: dict[str, Any]):
    if r.get("mode") == "time":
        t = r.get("time_ms")
        return (t is None, t if t is not None else math.inf)
    spill = r.get("spill_bytes") or 0
    occ = r.get("occupancy")
    regs = r.get("registers")
    return (spill > 0, -(occ if occ is not None else -1), regs if regs is not None else math.inf)


def _rank(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple, list] = {}
    for r in rows:
        groups.setdefault((r["target"], r["H"], r["D"]), []).append(r)
    out = []
    for key in groups:
        g = groups[key]
        ok = sorted((r for r in g if r["status"] == "ok"), key=_sort_key)
        for i, r in enumerate(ok, 1):
            r["rank"] = i
        rest = [r for r in g if r["status"] != "ok"]
        for r in rest:
            r["rank"] = None
        size = sum(r["status"] != "skipped" for r in g)
        for r in g:
            r["sweep_size"] = size
        out += ok + sorted(rest, key=lambda r: _STATUSES.index(r["status"]))
    return [
        {c: r.get(c) for c in COLUMNS} | {k: v for k, v in r.items() if k not in COLUMNS}
        for r in out
    ]


def best_per_shape(rows: Iterable[Mapping[str, Any]]) -> dict[tuple[str, int, int], dict]:
    """The best ``ok`` row of each (target, H, D): fastest in time mode, else by resources."""
    best: dict[tuple[str, int, int], dict] = {}
    for r in rows:
        if r.get("status") != "ok":
            continue
        key = (r["target"], int(r["H"]), int(r["D"]))
        if key not in best or _sort_key(r) < _sort_key(best[key]):
            best[key] = dict(r)
    return best


# ----------------------------------------------------------------------------------------------
# CSV
# ----------------------------------------------------------------------------------------------


def save_rows(rows: Iterable[Mapping[str, Any]], path: Path | str) -> Path:
    """Write rows as CSV (the :data:`COLUMNS` first, then any others); returns the path."""
    rows = list(rows)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    extra = [k for r in rows for k in r if k not in COLUMNS and not k.startswith("_")]
    cols = [*COLUMNS, *dict.fromkeys(extra)]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: _to_csv(r.get(k)) for k in cols})
    return path


def _to_csv(v):
    """A cell: "" for None, JSON for a dict (a kernel's launch), else the value."""
    if v is None:
        return ""
    return json.dumps(v, sort_keys=True) if isinstance(v, dict) else v


def _from_csv(col: str, text: str):
    if text == "":
        return None
    if col in _BOOL_PARAMS:
        return text == "True"
    if col in _INT_COLS or col in _FLOAT_COLS:
        try:
            return int(text)
        except ValueError:
            return float(text)
    return text


_REQUIRED_COLUMNS = ("target", "H", "D", "mode", "BLOCK_H", "BLOCK_K", "num_warps", "status")


def load_rows(path: Path | str) -> list[dict[str, Any]]:
    """Rows saved by :func:`save_rows`, with ints, floats, bools and None restored.

    ValueError if the file lacks a column that names a row's shape, config or status (not a
    sweep's CSV); columns added since an older sweep (e.g. ``maxnreg``) may be absent."""
    with Path(path).open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in _REQUIRED_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
            raise ValueError(
                f"{path}: not rows saved by `sparse-mla sweep` (missing column(s) "
                f"{', '.join(missing[:4])}{more})"
            )
        rows = [{k: _from_csv(k, v) for k, v in r.items()} for r in reader]
    for r in rows:
        if isinstance(r.get("launch"), str):
            r["launch"] = json.loads(r["launch"])
        if isinstance(r.get("T"), str):
            r["T"] = int(r["T"])
    return rows


# ----------------------------------------------------------------------------------------------
# Export
# ----------------------------------------------------------------------------------------------

_PROV_FROM_ROW = (
    "device",
    "triton",
    "torch",
    "date",
    "workload",
    "time_ms",
    "sweep_size",
    "mode",
    "rel_l2",
    "occupancy",
    "spill_bytes",
    "registers",
)


def _entry_from(key, value, arch: str, provenance: Mapping[str, Any] | None):
    """(shape key, JSON entry) from a winner: a row dict, a ConfigEntry or a PrefillConfig."""
    from .prefill import PrefillConfig

    prov: dict[str, Any] = {}
    if isinstance(value, configs.ConfigEntry):
        H, D, cfg = value.num_heads, value.head_dim, value.launch
        prov.update(value.provenance)
    elif isinstance(value, PrefillConfig):
        H, D = configs.parse_shape_key(key) if isinstance(key, str) else key[-2:]
        cfg = value
    elif isinstance(value, Mapping):
        row_target = value.get("target")
        if row_target is not None and _target(row_target).name != arch:
            raise ValueError(f"export: a winner for target {row_target!r} given for arch {arch!r}")
        H, D = int(value["H"]), int(value["D"])
        launch = {k: value.get(k) for k in LAUNCH_PARAMS if value.get(k) is not None}
        cfg = PrefillConfig.from_dict(launch)
        prov.update({k: value[k] for k in _PROV_FROM_ROW if value.get(k) is not None})
    else:
        raise TypeError(f"export: a winner must be a row dict or PrefillConfig, got {value!r}")
    if not arch.startswith("gfx"):
        from dataclasses import replace

        cfg = replace(cfg, kpack=None, waves_per_eu=None)
    else:
        from dataclasses import replace

        cfg = replace(cfg, maxnreg=None)
    prov.setdefault("date", _dt.date.today().isoformat())
    prov.setdefault("time_ms", None)
    prov.setdefault("sweep_size", None)
    prov.update(provenance or {})
    order = list(configs.PROVENANCE_KEYS)
    prov = dict(sorted(prov.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else 99))
    return configs.shape_key(H, D), {"launch": cfg.to_dict(), "provenance": prov}


def _winner_items(winners) -> list[tuple[Any, Any]]:
    if isinstance(winners, Mapping):
        return list(winners.items())
    return [(None, w) for w in winners]


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def export(
    winners,
    arch: str,
    *,
    root: Path | str | None = None,
    provenance: Mapping[str, Any] | None = None,
    dry_run: bool = False,
    allow_compile_only: bool = False,
) -> str:
    """Merge winners into ``arch``'s DEFAULT.json; returns a unified diff of the file.

    Args:
        winners: rows (e.g. ``best_per_shape(rows).values()``), or a dict of shape key or
            (target, H, D) -> row / PrefillConfig / ConfigEntry.
        arch: the file's arch id (``"sm90"``, ``"gfx942"``); rows for another target are refused.
        root: config root (default: the ``use_root`` block's root, else the user root,
            ``$SPARSE_MLA_CONFIG_DIR`` or ``~/.config/sparse-mla``; never the shipped files
            unless named: ``root=configs.CONFIG_ROOT``).
        provenance: fields set on every written entry, over those taken from the rows
            (required in the end: device, triton, date, workload, time_ms, sweep_size).
        dry_run: compute the diff without writing anything (no folder, lock or file).
        allow_compile_only: export winners ranked by compile-only resources (provenance
            ``mode`` "compile"). Refused by default, as ``sparse-mla export`` refuses them:
            they are candidates to time, and would replace measured entries.

    Entries for other shapes are kept. The write is atomic (a temporary file in the same
    folder, then os.replace) and runs under an exclusive lock on ``DEFAULT.json.lock``, so
    concurrent exports into one file lose nothing. The merged file is validated first.

    A DEFAULT.json that is a symlink is written through: the file it leads to is replaced
    (atomically, in its own folder, with its mode kept), so every root sharing it sees the
    export and the link stays a link. A file the exporting user may not write by its mode bits
    (read-only, e.g. 0444, or another user's without a write bit for us; root included) is
    refused with a ConfigFileError, as is a link that leads nowhere: nothing is written.
    """
    items = _winner_items(winners)
    others = [v for _, v in items if isinstance(v, Mapping) and is_kernel_row(v)]
    if others:  # winners of another kernel: its launch is the entry's kernel choice
        diff = export_launch(others, arch, root=root, provenance=provenance, dry_run=dry_run)
        rest = [(k, v) for k, v in items if not (isinstance(v, Mapping) and is_kernel_row(v))]
        return diff + (export(dict(rest) if all(k is not None for k, _ in rest) else
                              [v for _, v in rest], arch, root=root, provenance=provenance,
                              dry_run=dry_run, allow_compile_only=allow_compile_only)
                       if rest else "")  # fmt: skip
    path = configs.config_path(arch, root)
    new_entries = dict(_entry_from(k, v, arch, provenance) for k, v in items)
    if not new_entries:
        return ""
    compiled = sorted(k for k, e in new_entries.items() if e["provenance"].get("mode") == "compile")
    if compiled and not allow_compile_only:
        timed = sorted(
            k for k in compiled
            if (old := configs.lookup_entry(arch, *configs.parse_shape_key(k), root=root))
            is not None and old.provenance.get("mode") == "time"
        )  # fmt: skip
        over = f"; {timed} would replace timed entries" if timed else ""
        raise ValueError(
            f"export: {compiled} were ranked by compile-only resources, not timed{over}; run a "
            "time sweep, or pass allow_compile_only=True (CLI: --allow-compile-only)"
        )
    label = str(path)
    # Validate the new entries alone first so the error names them, not the old file.
    configs.parse_entries(new_entries, arch, f"{label} (new entries)")

    def merge(old: dict[str, Any]) -> dict[str, Any]:
        merged = {**old, **new_entries}
        for key in new_entries:  # a new Triton launch keeps the shape's recorded kernel choice
            if "kernel" in old.get(key, {}) and "kernel" not in new_entries[key]:
                merged[key] = {"kernel": old[key]["kernel"], **new_entries[key]}
        return merged

    return _merge_into(path, arch, merge, dry_run)


def _writable_by_us(st: os.stat_result) -> bool:
    """Whether the file's mode bits let this user write it (root is not exempt: an export must
    not replace a file its owner made read-only or that belongs to someone else)."""
    if st.st_uid == os.geteuid():
        return bool(st.st_mode & stat.S_IWUSR)
    if st.st_gid == os.getegid() or st.st_gid in os.getgroups():
        return bool(st.st_mode & stat.S_IWGRP)
    return bool(st.st_mode & stat.S_IWOTH)


def _export_target(path: Path) -> Path:
    """The file an export writes for ``path``: itself, or the file its symlink leads to;
    ConfigFileError for a link that leads nowhere or a file we may not write."""
    target = path
    if path.is_symlink():
        try:
            target = path.resolve(strict=True)
        except (OSError, RuntimeError) as e:  # dangling, or a loop (RuntimeError before 3.13)
            raise configs.ConfigFileError(
                f"{path}: a symlink that leads to no file ({e}); export does not replace it"
            ) from None
    try:
        st = target.stat()
    except FileNotFoundError:
        return target
    if not _writable_by_us(st):
        via = f" (the target of {path})" if target != path else ""
        raise configs.ConfigFileError(
            f"{target}{via}: read-only for this user (mode {stat.filemode(st.st_mode)}, owner uid "
            f"{st.st_uid}); export does not replace it: make it writable or export to another "
            "root (root=, CLI --root, or SPARSE_MLA_CONFIG_DIR)"
        )
    return target


def _merge_into(path: Path, arch: str, merge, dry_run: bool) -> str:
    """Under the file's lock: validate the old file, write ``merge(old)`` atomically if it
    differs (unless ``dry_run``); returns the unified diff. ``path`` a symlink: its target is
    written (:func:`export`)."""
    path = _export_target(path)
    label = str(path)
    # A dry run reads the file as it is and writes nothing: no folder, no lock file.
    with contextlib.nullcontext() if dry_run else _locked(path):
        old_text = ""
        if path.exists():
            try:
                old_text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise configs.ConfigFileError(f"{label}: cannot be read ({e})") from None
        old = configs.read_json(path, old_text) if old_text.strip() else {}
        configs.parse_entries(old, arch, label)
        new_text = configs.dump_entries(merge(old))
        configs.parse_entries(json.loads(new_text), arch, label)
        if not dry_run and new_text != old_text:
            mode = stat.S_IMODE(path.stat().st_mode) if old_text else None
            try:
                atomic_write(path, new_text.encode(), mode=mode)
            except OSError as e:
                raise configs.ConfigFileError(f"{label}: cannot write ({e})") from None
            from . import dispatch  # the entry reads the shipped files' stamps once a process

            dispatch.clear_cache()
    try:
        rel = path.resolve().relative_to(Path.cwd().resolve())
        a, b = f"a/{rel}", f"b/{rel}"
    except ValueError:  # outside the working directory: the absolute path
        a = b = label
    diff = difflib.unified_diff(
        old_text.splitlines(keepends=True),
        new_text.splitlines(keepends=True),
        fromfile=a if old_text else "/dev/null",
        tofile=b,
    )
    return "".join(diff)


# ----------------------------------------------------------------------------------------------
# Kernel choice (from benchmark rows)
# ----------------------------------------------------------------------------------------------


def _bench_value(r: Mapping[str, Any], col: str):
    v = r.get(col)
    if isinstance(v, str):
        if col == "ok":
            return v == "True"
        if col in ("H", "D"):
            return int(v) if v else None
        if col == "ms":
            return float(v) if v else None
        if col == "config":
            return json.loads(v) if v else {}
    return v


def token_buckets(tokens: Iterable[int]) -> list[tuple[int, int | None]]:
    """Buckets around measured values (token counts, or slots per token): each value serves
    from the geometric midpoint with the value below it (0 for the smallest) up to the
    midpoint with the value above it (open for the largest), a midpoint above the value below
    it (1 and 2: 2). One value: one bucket serving every value."""
    ts = sorted(set(int(t) for t in tokens))
    edges = [0] + [max(math.isqrt(a * b), a + 1) for a, b in itertools.pairwise(ts)] + [None]
    return list(itertools.pairwise(edges))


def kernel_choices(
    rows: Iterable[Mapping[str, Any]],
    *,
    run: str | Sequence[str] | None = None,
    source: str = "bench rows",
    arch: str | None = None,
) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """The fastest registered kernel per (H, D), token count and list length in benchmark runs.

    Args:
        rows: :func:`sparse_mla.bench.run_bench` rows, or rows read back from its CSV.
        run: the run's ``timestamp``, or several runs' (their points taken together, e.g. the
            grid and a grid of long requests' steps, ``bench --grid --context``); default: the
            latest run in ``rows``. The runs must be on one device and must not measure the
            same (workload, T, H) twice.
        source: where the rows come from (recorded in the provenance).
        arch: the arch the runs' GPU is (``sm90``): a chosen kernel's launch (the row's
            ``config``) that is its own default there is recorded as None, the kernel's
            default, which is what the bench ran (a kernel's default may act on the call, as
            ``gluon_mma``'s trades its head blocks for 16-head ones at small T, and a given
            launch does not); None: launches recorded as the rows have them.

    Returns:
        {(H, D): [{"name", "launch", "provenance", "triton_row", "tokens", "slots"}, ...]}:
        per T the runs measured at that (H, D), and per slots per token measured at that T
        (a workload's valid slots // T: the list length), the kernel with the lowest total
        time over the workloads at that (H, D, T, slots per token), among the providers that
        are registered kernels (``default`` and peers are not candidates) and that passed the
        check on every one of those workloads. ``tokens`` is the bucket of token counts the
        choice serves (:func:`token_buckets`; None when one T and one length were measured: it
        serves every T), ``slots`` its bucket of slots per token among the lengths measured at
        its T (None when one kernel won at every length measured there: it serves every
        length); neighbouring lengths that chose the same kernel and launch are one bucket,
        their times summed.
    """
    from . import dispatch, prefill  # noqa: F401  (prefill registers the package's kernels)

    rows = [dict(r) for r in rows]
    runs = sorted({r["timestamp"] for r in rows if r.get("timestamp")})
    if not runs:
        raise ValueError("kernel choice: no benchmark rows")
    wanted = [runs[-1]] if run is None else [run] if isinstance(run, str) else list(run)
    for w in wanted:
        if w not in runs:
            raise ValueError(f"kernel choice: no run {w!r}; runs: {runs}")
    label = wanted[0] if len(wanted) == 1 else " + ".join(wanted)
    mine = [r for r in rows
            if r.get("timestamp") in wanted and r.get("provider") in dispatch.KERNELS]  # fmt: skip
    devices = sorted({r["device"] for r in mine})
    if len(devices) != 1:
        raise ValueError(f"kernel choice: run {label} must be on one device, got {devices}")
    shapes: dict[tuple[int, int], dict[int, dict[int, dict[str, dict[str, dict]]]]] = {}
    measured_by: dict[tuple, str] = {}
    for r in mine:
        key = (_bench_value(r, "H"), _bench_value(r, "D"))
        T = int(r.get("T") or 0)
        point = (*key, T, r["workload"])
        if measured_by.setdefault(point, r["timestamp"]) != r["timestamp"]:
            raise ValueError(
                f"kernel choice: {r['workload']} T={T} is in two runs "
                f"({measured_by[point]}, {r['timestamp']}); give one of them"
            )
        slots = int(r.get("nnz") or 0) // max(T, 1)
        shapes.setdefault(key, {}).setdefault(T, {}).setdefault(slots, {}).setdefault(
            r["workload"], {}
        )[r["provider"]] = r
    out: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for (H, D), by_tokens in sorted(shapes.items()):
        picked = []
        for T, by_slots in sorted(by_tokens.items()):
            here = []
            for slots, by_workload in sorted(by_slots.items()):
                c = _fastest(by_workload, dispatch, devices[0], source, slots, arch)
                if c is not None:
                    here.append((slots, c))
            merged: list[dict[str, Any]] = []
            for (_, c), bucket in zip(here, token_buckets(s for s, _ in here), strict=True):
                c["slots"] = bucket
                last = merged[-1] if merged else None
                if last is not None and (last["name"], last["launch"]) == (c["name"], c["launch"]):
                    merged[-1] = _merged(last, c)  # neighbouring lengths, the same kernel
                else:
                    merged.append(c)
            if len(merged) == 1:
                merged[0]["slots"] = None  # one kernel for every length measured at this T
            if merged:
                picked.append((T, merged))
        if not picked:
            continue
        buckets = token_buckets(T for T, _ in picked)
        listed = len(picked) > 1 or len(picked[0][1]) > 1  # a list of choices: each has tokens
        for (_, cs), bucket in zip(picked, buckets, strict=True):
            for c in cs:
                c["tokens"] = bucket if listed else None
        out[(H, D)] = [c for _, cs in picked for c in cs]
    return out


def _default_launch(k, arch: str, H: int, D: int, T: int | None) -> dict[str, Any] | None:
    """Kernel ``k``'s default launch for (arch, H, D, T) as a bench row's ``config`` holds it
    (per-call keys left out); None when it has none to compare."""
    from . import dispatch

    if k.to_dict is None:
        return None
    try:
        cfg = k.resolve(None, dispatch.Call(arch, H, D, num_tokens=T))
    except ValueError:
        return None
    return {c: v for c, v in k.to_dict(cfg).items() if c not in k.per_call_keys}


def _merged(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two neighbouring list-length choices of one T that chose the same kernel and launch, as
    one: the union of their slots buckets, their times summed (the kernel was the fastest in
    each, so it is in the sum), their workloads listed."""
    pa, pb = a["provenance"], b["provenance"]
    times = {n: round(pa["times_ms"][n] + pb["times_ms"][n], 4)
             for n in pa["times_ms"] if n in pb["times_ms"]}  # fmt: skip
    prov = dict(pa)
    prov["times_ms"] = dict(sorted(times.items(), key=lambda kv: kv[1]))
    work = f"{pa['workload'].removesuffix(' (times summed)')} + "
    prov["workload"] = work + pb["workload"].removesuffix(" (times summed)") + " (times summed)"
    for key in ("run", "commit"):
        if pb.get(key) and pb.get(key) not in str(pa.get(key) or "").split(" + "):
            prov[key] = f"{pa[key]} + {pb[key]}" if pa.get(key) else pb[key]
    return {**a, "provenance": prov, "slots": (a["slots"][0], b["slots"][1])}


def _fastest(
    by_workload, dispatch, device: str, source: str, slots: int, arch: str | None = None
) -> dict | None:  # fmt: skip
    """The fastest registered kernel over one (H, D, T, slots per token)'s workloads (times
    summed)."""
    workloads = sorted(by_workload)
    totals: dict[str, float] = {}
    for name in dispatch.KERNELS:
        got = [by_workload[w].get(name) for w in workloads]
        if all(g is not None and _bench_value(g, "ok") and _bench_value(g, "ms") for g in got):
            totals[name] = sum(_bench_value(g, "ms") for g in got)
    if not totals:
        return None
    # An exact tie (the timer's resolution at a few-us call) is no evidence for the fallback:
    # it goes to the other kernel.
    best = min(totals, key=lambda n: (totals[n], n == dispatch.FALLBACK))
    first = by_workload[workloads[0]][best]
    k = dispatch.KERNELS[best]
    launch = None
    if best != dispatch.FALLBACK:
        launch = {c: v for c, v in _bench_value(first, "config").items()
                  if c not in k.per_call_keys}  # fmt: skip
        H, D, T = _bench_value(first, "H"), _bench_value(first, "D"), int(first.get("T") or 0)
        if arch is not None and launch == _default_launch(k, arch, H, D, T or None):
            launch = None  # the kernel's own default, as the bench ran it
    prov = {
        "device": device,
        "date": str(first.get("timestamp") or "")[:10],
        "source": source,
        "times_ms": {n: round(t, 4) for n, t in sorted(totals.items(), key=lambda kv: kv[1])},
        "workload": " + ".join(f"{w} T={by_workload[w][best].get('T')}" for w in workloads)
        + (f" ({slots} slots/token)" if first.get("nnz") not in (None, "") else "")
        + (" (times summed)" if len(workloads) > 1 else ""),
        "commit": first.get("commit") or "unknown",
        "run": first.get("timestamp") or "",
        "triton": first.get("triton") or "",
        "torch": first.get("torch") or "",
    }
    triton_rows = [by_workload[w].get(dispatch.FALLBACK) for w in workloads]
    triton_row = next((t for t in triton_rows if t is not None), None)
    return {"name": best, "launch": launch, "provenance": prov, "triton_row": triton_row}


def export_kernel_choice(
    rows: Iterable[Mapping[str, Any]],
    arch: str,
    *,
    run: str | Sequence[str] | None = None,
    source: str = "bench rows",
    root: Path | str | None = None,
    dry_run: bool = False,
) -> str:
    """Record each shape's fastest kernel of one benchmark run, or of several taken together
    (:func:`kernel_choices`), as the ``kernel`` object of ``arch``'s entries (an entry's
    choices are replaced by the runs' for every (H, D) they measured); returns the unified
    diff.

    An entry's Triton ``launch`` and ``provenance`` are kept; a shape without an entry gets
    the launch the run's Triton row used, with that row as its provenance (``mode`` "bench").
    Atomic and under the file's lock, like :func:`export`.
    """
    arch = _target(arch).name
    choices = kernel_choices(rows, run=run, source=source, arch=arch)
    if not choices:
        return ""
    path = configs.config_path(arch, root)

    def merge(old: dict[str, Any]) -> dict[str, Any]:
        merged = dict(old)
        for (H, D), picked in choices.items():
            key = configs.shape_key(H, D)
            kernels = []
            for c in picked:
                kernel: dict[str, Any] = {"name": c["name"]}
                if c["tokens"] is not None:
                    kernel["tokens"] = list(c["tokens"])
                if c["slots"] is not None:
                    kernel["slots"] = list(c["slots"])
                if c["launch"] is not None:
                    kernel["launch"] = c["launch"]
                kernel["provenance"] = c["provenance"]
                kernels.append(kernel)
            entry = {k: v for k, v in old.get(key, {}).items() if k != "kernel"}
            if not entry:
                t = next((c["triton_row"] for c in reversed(picked) if c["triton_row"]), None)
                if t is None:
                    raise ValueError(f"kernel choice: {key} has no entry and no triton row")
                prov = {
                    "device": t["device"], "triton": t["triton"], "date": t["timestamp"][:10],
                    "workload": t["workload"], "time_ms": _bench_value(t, "ms"),
                    "sweep_size": None, "torch": t["torch"], "mode": "bench", "source": source,
                }  # fmt: skip
                entry = {"launch": _bench_value(t, "config"), "provenance": prov}
            merged[key] = {"kernel": kernels[0] if len(kernels) == 1 else kernels, **entry}
        return merged

    return _merge_into(path, arch, merge, dry_run)


# ----------------------------------------------------------------------------------------------
# Any registered kernel (sparse_mla.dispatch.KERNELS): its launch, sweeps and export
# ----------------------------------------------------------------------------------------------


def _call(name: str, target, num_heads: int, head_dim: int, num_tokens: int | None = None):
    from . import dispatch

    return dispatch.Call(_target(target).name, num_heads, head_dim, num_tokens=num_tokens)


def kernel_targets(name: str) -> tuple[str, ...]:
    """The named targets kernel ``name`` cross-compiles for (``"*"``: every named target of
    :data:`sparse_mla.targets.TARGETS` but ``local``)."""
    from . import dispatch
    from .targets import TARGETS

    k = dispatch.kernel(name)
    named = tuple(t for t in TARGETS if t != "local")
    return named if "*" in k.targets else tuple(t for t in k.targets if t in named)


def catalog() -> list[dict[str, Any]]:
    """Every registered kernel as JSON: name, targets (named ones), knobs (field -> allowed
    values), summary, config_type, whether it can be cross-compiled, the pool format it reads
    and whether it reads dense [T, K] ids itself (``sparse-mla kernels --json`` prints this
    list)."""
    from . import dispatch

    out = []
    for name, k in dispatch.KERNELS.items():
        out.append({
            "name": name,
            "targets": list(kernel_targets(name)),
            "knobs": {f: list(v) for f, v in k.knobs.items()},
            "summary": k.summary,
            "config_type": k.config_type,
            "compiles": name == dispatch.FALLBACK or k.compile_args is not None,
            "kv_format": k.kv_format,
            "dense_ids": k.dense_ids,
        })  # fmt: skip
    return out


def knob_types(name: str) -> dict[str, type]:
    """Field -> type (int or bool) of kernel ``name``'s launch: every field its config class
    has (the registry's ``knobs`` list their usual values; any field can be set)."""
    import dataclasses

    from . import dispatch

    if name == dispatch.FALLBACK:
        return {k: t for k, (t, _) in configs.launch_types().items()}
    k = dispatch.kernel(name)
    targets = kernel_targets(name)
    if not targets:
        raise ValueError(f"kernel {name!r} compiles for no named target")
    cfg = k.resolve(None, _call(name, targets[0], 16, 512))
    out = {}
    for f in dataclasses.fields(cfg):
        text = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        out[f.name] = bool if "bool" in text else int
    return out


def _check_target(name: str, target) -> str:
    from . import dispatch

    t = _target(target)
    arch = t.name
    if arch not in kernel_targets(name) and name != dispatch.FALLBACK:
        raise ValueError(
            f"kernel {name!r} does not compile for {arch}; its targets: "
            f"{', '.join(kernel_targets(name))}"
        )
    return arch


def base_launch(
    name: str, target, num_heads: int, head_dim: int = 512, *, num_tokens: int | None = None,
    root=None,
) -> tuple[Any, str]:  # fmt: skip
    """Kernel ``name``'s launch for (target, H, D) before any knob is set, and where it comes
    from: Triton's tuned entry (else its default); another kernel's launch recorded for the
    shape (the choice serving ``num_tokens``, else any recorded for it), else its default."""
    from . import dispatch
    from .prefill import default_config

    arch = _check_target(name, target)
    entry = configs.lookup_entry(arch, num_heads, head_dim, root)
    key = configs.shape_key(num_heads, head_dim)
    if name == dispatch.FALLBACK:
        if entry is not None:
            return entry.launch, f"tuned entry {key} in {entry.source}"
        return default_config(num_heads, head_dim), f"the default for {key} (no tuned entry)"
    k = dispatch.kernel(name)
    call = _call(name, arch, num_heads, head_dim, num_tokens)
    mine = [c for c in (entry.kernels if entry is not None else ()) if c.name == name]
    pick = next((c for c in mine if c.serves(num_tokens)), mine[-1] if mine else None)
    if pick is not None and pick.launch is not None:
        where = "" if pick.tokens is None else f" for T in {list(pick.tokens)}"
        return k.resolve(dict(pick.launch), call), f"recorded {key}{where} in {entry.source}"
    return k.resolve(None, call), f"{name}'s default for H={num_heads}"


def kernel_launch(
    name: str, target, num_heads: int, head_dim: int = 512, knobs: Mapping[str, Any] | None = None,
    *, base: Any = None, num_tokens: int | None = None, root=None,
) -> Any:  # fmt: skip
    """Kernel ``name``'s launch at (target, H, D) with ``knobs`` set over ``base`` (default
    :func:`base_launch`), validated without compiling: ValueError with the reason (a field the
    kernel lacks, a value its config refuses, a launch it cannot take on that target)."""
    import dataclasses

    from . import dispatch

    arch = _check_target(name, target)
    types = knob_types(name)
    knobs = dict(knobs or {})
    unknown = sorted(set(knobs) - set(types))
    if unknown:
        raise ValueError(f"{name} has no knob {', '.join(unknown)}; its knobs: {', '.join(types)}")
    for f, v in knobs.items():
        if types[f] is bool and v in (0, 1) and not isinstance(v, bool):
            knobs[f] = bool(v)
    if base is None:
        base = base_launch(name, arch, num_heads, head_dim, num_tokens=num_tokens, root=root)[0]
    try:
        cfg = dataclasses.replace(base, **knobs)
    except TypeError as e:
        raise ValueError(f"{name}: {e}") from None
    if name == dispatch.FALLBACK:
        status, reason = _precheck(_target(arch), num_heads, head_dim, cfg.to_dict())
        if status == "invalid":
            raise ValueError(reason)
        return cfg
    k = dispatch.kernel(name)
    cfg = k.resolve(cfg, _call(name, arch, num_heads, head_dim, num_tokens))
    if k.compile_args is not None:  # its own checks of the launch (no compile)
        k.compile_args(arch, num_heads=num_heads, config=cfg)
    return cfg


def launch_json(name: str, launch: Any) -> dict[str, Any]:
    """A kernel's launch as the JSON dict configs/ records."""
    from . import dispatch

    k = dispatch.kernel(name)
    return dict(k.to_dict(launch)) if k.to_dict is not None else dict(vars(launch))


def sweep_kernel(
    name: str,
    grid: Mapping[str, Iterable],
    shapes,
    targets,
    *,
    mode: str = "compile",
    workload: str | Mapping[str, Any] = "dsv4_csa",
    jobs: int | None = None,
    progress: bool = True,
    sample: int | None = None,
    seed: int = 0,
    dtype: str = "bf16",
) -> list[dict[str, Any]]:
    """:func:`sweep` for any registered kernel: its knobs (:func:`knob_types`) over the launch
    it would run at each shape (:func:`base_launch`). Rows have the :data:`COLUMNS` plus
    ``kernel``, ``launch`` (the JSON of the whole launch) and one column per knob; a launch
    the kernel refuses is an ``invalid`` row with the reason, before compiling. Compile mode
    ranks by resources without a GPU; time mode checks each launch against the fp32
    reference on the workload, then times it (``sparse_mla_prefill(config=Choice(name,
    launch))``, so the kernel timed is the one the dispatch would run)."""
    from . import dispatch

    if name == dispatch.FALLBACK:
        rows = sweep(grid, shapes, targets, mode=mode, workload=workload, jobs=jobs,
                     progress=progress, sample=sample, seed=seed, dtype=dtype)  # fmt: skip
        for r in rows:
            r["kernel"] = name
            r["launch"] = {p: r[p] for p in LAUNCH_PARAMS if r.get(p) is not None}
        return rows
    if mode not in ("compile", "time"):
        raise ValueError(f"mode must be 'compile' or 'time', got {mode!r}")
    if dtype not in ("bf16", "fp16"):
        raise ValueError(f"dtype must be 'bf16' or 'fp16', got {dtype!r}")
    types = knob_types(name)
    bad = sorted(set(grid) - set(types))
    if bad:
        raise ValueError(f"grid: {name} has no knob {', '.join(bad)}; its knobs: "
                         f"{', '.join(types)}")  # fmt: skip
    values = {}
    for n, v in grid.items():
        v = [v] if isinstance(v, (int, bool)) or v is None else list(dict.fromkeys(v))
        if not v:
            raise ValueError(f"grid: parameter {n!r} has no values")
        values[n] = v
    combos = [dict(zip(values, c, strict=True)) for c in itertools.product(*values.values())]
    if sample is not None and sample < len(combos):
        combos = random.Random(seed).sample(combos, sample)
    if isinstance(targets, str):
        targets = [targets]
    rows: list[dict[str, Any]] = []
    for tname in dict.fromkeys(targets):
        arch = _check_target(name, tname)
        for H, D in _normalize_shapes(shapes):
            base = base_launch(name, arch, H, D)[0]
            for knobs in combos:
                row = {"target": arch, "H": H, "D": D, "dtype": dtype, "mode": mode,
                       **{p: None for p in LAUNCH_PARAMS}, "kernel": name}  # fmt: skip
                try:
                    launch = kernel_launch(name, arch, H, D, knobs, base=base)
                except (TypeError, ValueError) as e:
                    row.update(knobs, status="invalid", reason=str(e), launch=dict(knobs))
                    rows.append(row)
                    continue
                d = launch_json(name, launch)
                row.update({p: v for p, v in d.items() if p in LAUNCH_PARAMS})
                row.update(d, status="ok", reason="", launch=d)
                row["_kernel"], row["_launch"] = name, launch
                rows.append(row)
    return _execute(rows, mode, workload, jobs, f"sweep {name} ({mode})", progress)


def _row_launch(r: Mapping[str, Any]) -> dict[str, Any]:
    launch = r.get("launch")
    if isinstance(launch, str):
        launch = json.loads(launch) if launch else {}
    return dict(launch or {})


def is_kernel_row(r: Mapping[str, Any]) -> bool:
    """Whether a sweep row is of a kernel other than Triton (exported as a kernel choice)."""
    from . import dispatch

    return r.get("kernel") not in (None, "", dispatch.FALLBACK)


def export_launch(
    winners: Iterable[Mapping[str, Any]],
    arch: str,
    *,
    root: Path | str | None = None,
    provenance: Mapping[str, Any] | None = None,
    dry_run: bool = False,
) -> str:
    """Record timed sweep winners of a kernel other than Triton (rows of :func:`sweep_kernel`,
    ``mode`` "time") as the ``kernel`` of their shape's entry in ``arch``'s DEFAULT.json, so
    ``sparse_mla_prefill(config=None)`` runs that kernel with that launch there; returns the
    unified diff.

    The choice serves every T, unless the entry records token buckets and the row's ``T``
    (the timed workload's tokens) falls in one: then that bucket's choice is replaced (each of
    its choices, where it is split by list length) and the others kept. A shape without an
    entry gets Triton's default launch beside it (provenance ``mode`` "default": nothing
    measured it). Compile-only rows are refused: a kernel choice
    records a measured time. Atomic and under the file's lock, like :func:`export`."""
    from . import dispatch
    from .prefill import default_config

    arch = _target(arch).name
    prov_in = dict(provenance or {})
    picked: dict[str, list[dict[str, Any]]] = {}
    for r in winners:
        name = r.get("kernel")
        if name not in dispatch.KERNELS:
            raise ValueError(f"export: kernel {name!r} is not registered")
        if r.get("target") is not None and _target(r["target"]).name != arch:
            raise ValueError(f"export: a winner for target {r['target']!r} given for arch {arch!r}")
        t = r.get("time_ms")
        if r.get("mode") != "time" or not isinstance(t, (int, float)) or not t > 0:
            raise ValueError(
                f"export: the {name} row for H{r['H']}_D{r['D']} has no measured time (mode "
                f"{r.get('mode')!r}); a kernel choice records one: run a --mode time sweep on a GPU"
            )
        launch = _row_launch(r)
        H, D = int(r["H"]), int(r["D"])
        dispatch.kernel(name).resolve(dict(launch), dispatch.Call(arch, H, D))  # validates
        prov = {
            "device": str(r.get("device") or prov_in.get("device") or "unknown"),
            "date": str(r.get("date") or _dt.date.today().isoformat()),
            "source": str(prov_in.get("source") or "sparse-mla sweep"),
            "times_ms": {name: round(float(t), 4)},
        }
        for k in ("workload", "triton", "torch"):
            if r.get(k):
                prov[k] = str(r[k])
        if prov_in.get("notes"):
            prov["notes"] = str(prov_in["notes"])
        T = r.get("T")
        picked.setdefault(configs.shape_key(H, D), []).append(
            {"name": name, "launch": launch, "provenance": prov, "T": None if T in (None, "")
             else int(T)}
        )  # fmt: skip
    if not picked:
        return ""
    path = configs.config_path(arch, root)

    def merge(old: dict[str, Any]) -> dict[str, Any]:
        merged = dict(old)
        for key, choices in picked.items():
            c = choices[-1]
            new = {"name": c["name"], "launch": c["launch"], "provenance": c["provenance"]}
            entry = dict(old.get(key, {}))
            kern = entry.get("kernel")
            if isinstance(kern, list) and c["T"] is not None:
                lst = []
                for o in kern:
                    serves = configs.holds(o["tokens"], c["T"])
                    # (a bucket split by list length: each length's choice is replaced, its
                    # slots kept, since the sweep's rows do not say their lists' length)
                    kept = {k: o[k] for k in ("tokens", "slots") if k in o}
                    lst.append({**new, **kept} if serves else o)
                entry["kernel"] = lst
            else:
                entry["kernel"] = new
            if "launch" not in entry:
                H, D = configs.parse_shape_key(key)
                cfg = default_config(H, D)
                entry["launch"] = configs.launch_to_json(cfg)
                entry["provenance"] = {
                    "device": c["provenance"]["device"], "triton": c["provenance"].get(
                        "triton", ""), "date": c["provenance"]["date"],
                    "workload": "none: Triton's default launch (the entry was made for a "
                    f"{c['name']} choice)", "time_ms": None, "sweep_size": None,
                    "mode": "default",
                }  # fmt: skip
            merged[key] = {"kernel": entry.pop("kernel"), **entry}
        return merged

    return _merge_into(path, arch, merge, dry_run)
