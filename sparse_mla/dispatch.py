"""Which kernel the public entry runs: the registry of named kernels and the choice per call.

Every kernel :func:`sparse_mla.sparse_mla_prefill` can run is a named :class:`Kernel` here:
``triton`` (every target and the CPU interpreter) and the Gluon kernels (``gluon_mma``,
``gluon_wgmma``, ``gluon_ws``, ``gluon_ws_small``; :data:`sparse_mla.gluon.launch.KERNELS`);
for an FP8 cache ``triton_fp8``, ``gluon_ws_small_fp8`` and ``gluon_ws_fp8``.
Each says which targets it serves, which calls it can take and why not (``unavailable``), its
knobs, and how to resolve, run and cross-compile a launch. One selector, :func:`choose`,
picks the kernel for a call; nothing inside a launcher decides which kernel runs:

1. ``config=`` given: the kernel it names (:class:`Choice`) or whose config type it is
   (a PrefillConfig or dict: ``triton``; a GluonConfig: ``gluon_mma``; a SmallWSConfig:
   ``gluon_ws_small``), with that launch; ValueError when that kernel cannot run the call.
2. A kernel recorded in the tuned configs (:mod:`sparse_mla.configs`) for the call's (H, D), the
   token bucket holding its T and, where recorded, the bucket holding its slots per token
   (the lists' total length // T: a chunked-prefill or MTP step of a long request has long
   lists at small T, a short prompt short ones); ``sparse-mla export BENCH.csv ...
   --kernel-choice`` writes them from bench runs, the grid's included), when it can run the
   call.
3. Else the documented rule, :func:`rule`: the kernels measured fastest for the shape's
   (arch, H) region, first that can run it (see :data:`RULE`).
4. Else the kernel that serves the call's pool format everywhere (:data:`FALLBACKS`):
   ``triton`` with its tuned (or default) launch for a dense pool, ``triton_fp8`` for an FP8
   cache (:class:`sparse_mla.fp8.FP8Cache`, ``Call.kv_format == "fp8_model1"``). A kernel
   refuses a call whose pool format is not the one it reads (:meth:`Kernel.why_not`).

Dense ids with their rows' lengths (``kv_lengths``, ``Call.dense_lengths``): in steps 2 and 3 a
kernel that reads CSR only is passed over for one that reads them (:data:`DENSE_STAND_IN` in a
recorded kernel's place, else the rule's next), since its lists would first be packed to CSR
by about ten torch ops (3.7x the call at T = 1, one head: docs/PERF_NOTES.md, "No cliffs",
step 41). ``config=`` still runs the kernel it names, packing included. This holds at any T,
though the packing's cost is its launches and matters at small T: on the H200 the shipped
choice records a CSR-only kernel only at one head and T <= 16.

:func:`describe` says, for any shape, which kernel runs and why, and why each other kernel
would or would not. Kernels join the registry with :func:`register`; the package's own are
registered by :mod:`sparse_mla.kernels`, which this module imports at its end, so the registry
is whole once dispatch is imported. Their entries call into the kernels' modules
(:mod:`sparse_mla.prefill`, :mod:`sparse_mla.fp8_prefill`) lazily, so the dependencies run one
way at import: entry -> dispatch -> configs and kernels (-> the Gluon launch table).

Adding a kernel: register a :class:`Kernel` beside the others (its ``run`` on validated
inputs, ``resolve`` for its launch, ``unavailable`` for where it cannot run, ``compile_args``
to cross-compile it). It is then a provider of ``sparse-mla bench`` under its name,
``config=Choice(name)`` forces it, ``inspect`` compiles it, and ``sparse-mla export BENCH.csv
--arch ARCH --kernel-choice`` records it for the shapes where a bench run found it fastest.
"""

from __future__ import annotations

import os
from bisect import bisect_right
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import configs

__all__ = [
    "DENSE_STAND_IN", "FALLBACKS", "FORMATS", "KERNELS", "RULE", "TABLE_SLOTS", "TABLE_TOKENS",
    "Call", "Choice", "Kernel", "choice_table", "choose", "choose_cached", "clear_cache",
    "describe", "fallback", "kernel", "register", "rule", "slot_bounds", "token_bounds",
]  # fmt: skip


@dataclass(frozen=True)
class Call:
    """What a kernel needs to know to say whether it can run a call."""

    arch: str | None  # local GPU arch ("sm90", "gfx942"); None: CPU tensors (interpreter)
    num_heads: int
    head_dim: int
    dtype: Any = None  # q's torch dtype (None: not known, e.g. a shape-only question)
    kv: Any = None  # the [N, D] pool, or an FP8Cache when kv_format says so (None: not known)
    num_tokens: int | None = None  # T (None: not known; the largest recorded bucket serves)
    nnz: int | None = None  # kv_indices.numel(): the slot lists' total length (None: unknown)
    kv_format: str = "dense"  # the pool's format: a key of FORMATS (kv is then an FP8Cache)
    # The lists come as dense [T, K] ids with their rows' lengths (kv_lengths): a kernel that
    # reads CSR only would get them packed by torch ops first (the module docstring)
    dense_lengths: bool = False

    @classmethod
    def of_shape(
        cls, arch: str | None, num_heads: int, head_dim: int, *, num_tokens: int | None = None,
        slots_per_token: int | None = None, kv_format: str = "dense", dense_lengths: bool = False,
    ) -> Call:  # fmt: skip
        """A shape-only call (no tensors) whose lists hold ``slots_per_token`` slots a token
        (the lists' total length // T; None: unknown, the longest recorded lists' choice);
        ``dense_lengths``: they come as dense ids with their rows' lengths."""
        if slots_per_token is not None and num_tokens is None:
            raise ValueError("slots_per_token needs num_tokens")
        nnz = None if slots_per_token is None else slots_per_token * num_tokens
        return cls(arch, num_heads, head_dim, num_tokens=num_tokens, nnz=nnz, kv_format=kv_format,
                   dense_lengths=dense_lengths)  # fmt: skip


@dataclass(frozen=True)
class Kernel:
    """One kernel the entry can run.

    ``run(q, kv, kv_indices, kv_indptr, softmax_scale, attn_sink, out, launch)`` launches it on
    validated inputs (``kv`` is [N, D], T > 0 and N > 0) and writes ``out``; the entry adds
    ``nnz=`` (the lists' total length to plan a split for, in ``kv_indices.numel()``'s place)
    when the caller bounds dense ids' lengths (``max_kv_length``). ``resolve(launch,
    call)`` turns None (the kernel's own default or tuned launch), a dict from configs/ or the
    kernel's config object into a validated config object. ``unavailable(call)`` says why the
    kernel cannot run a call (None: it can). ``config_type`` ("module:Class") is the config
    class whose instances, passed as ``config=``, force this kernel. ``to_dict`` writes a
    launch as JSON (the benchmark's ``config`` column, configs/).
    """

    name: str
    run: Callable[..., Any]
    resolve: Callable[[Any, Call], Any]
    unavailable: Callable[[Call], str | None]
    config_type: str | None = None
    to_dict: Callable[[Any], dict[str, Any]] | None = None
    per_call_keys: tuple[str, ...] = ()  # what the kernel decides per call (bench column only)
    summary: str = ""  # one line: the design
    targets: tuple[str, ...] = ("*",)  # arch ids it compiles for ("*": every target)
    knobs: Mapping[str, tuple] = field(default_factory=dict)  # launch field -> allowed values
    # compile_args(target, **shape) -> (kernel, signature, constexprs, options), for inspect
    compile_args: Callable[..., Any] | None = None
    kv_format: str = "dense"  # the pool format it reads (FORMATS)
    # Slot lists in the dense [T, K] form (kv_indptr None): True, ``run`` takes them as they
    # are (row t at t x K, no kv_indptr load); False, the entry passes ``run`` their CSR form,
    # built on the device (sparse_mla.validation.dense_as_csr: one arange, no host sync).
    dense_ids: bool = False

    def why_not(self, call: Call) -> str | None:
        """Why it cannot run ``call`` (None: it can): a pool of another format, else
        ``unavailable``."""
        if call.kv_format != self.kv_format:
            return f"reads {FORMATS[self.kv_format]}, not {FORMATS[call.kv_format]}"
        return self.unavailable(call)


class _Registry(dict):
    """The kernel registry: a dict whose changes (a kernel added or replaced, a test's spy
    too) clear the per-call choice cache (:func:`clear_cache`), since they may change a
    choice. The package's own kernels are in it once this module is imported
    (:mod:`sparse_mla.kernels`, imported at the end of this module)."""

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        clear_cache()

    def __delitem__(self, key) -> None:
        super().__delitem__(key)
        clear_cache()


KERNELS: dict[str, Kernel] = _Registry()
FALLBACK = "triton"
# Pool formats a call may bring (Call.kv_format), and the kernel that serves each when nothing
# else is chosen. "fp8_model1" is sparse_mla.fp8.FP8Cache (DESIGN.md section 9).
FORMATS = {
    "dense": "a dense [N, D] pool in q's dtype",
    "fp8_model1": "an FP8 KV cache (MODEL1 layout)",
}
FALLBACKS = {"dense": FALLBACK, "fp8_model1": "triton_fp8"}


def fallback(call: Call) -> str:
    """The kernel a call falls back to: the one that serves its pool format everywhere."""
    return FALLBACKS[call.kv_format]


def register(k: Kernel) -> Kernel:
    """Add (or replace) a kernel in the registry; returns it."""
    if not isinstance(k, Kernel):
        raise TypeError(f"register takes a Kernel, got {type(k).__name__}")
    KERNELS[k.name] = k
    return k


def kernel(name: str) -> Kernel:
    """The registered kernel ``name``; ValueError listing the known ones."""
    try:
        return KERNELS[name]
    except KeyError:
        raise ValueError(f"kernel {name!r} is not registered; known: {sorted(KERNELS)}") from None


@dataclass(frozen=True)
class Choice:
    """A kernel and its launch config (None: the kernel's default for the call), and why."""

    kernel: str
    launch: Any = None
    reason: str = ""

    def launch_dict(self) -> dict[str, Any]:
        """The launch as a JSON-able dict (empty when there is none)."""
        if self.launch is None:
            return {}
        k = KERNELS.get(self.kernel)
        if k is not None and k.to_dict is not None:
            return k.to_dict(self.launch)
        if isinstance(self.launch, Mapping):
            return dict(self.launch)
        return dict(vars(self.launch))


def _type_name(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}:{t.__qualname__}"


def _forced(config: Any, call: Call) -> Choice:
    """The kernel and launch that ``config=`` asks for; the kernel must be able to run."""
    if isinstance(config, Choice):
        if config.kernel not in KERNELS:
            raise ValueError(
                f"config: Choice({config.kernel!r}) names no registered kernel; registered: "
                f"{sorted(KERNELS)}"
            )
        k = kernel(config.kernel)
        launch = config.launch
    elif isinstance(config, Mapping):
        k, launch = kernel(fallback(call)), config
    else:
        name = _type_name(config)
        found = [k for k in KERNELS.values() if k.config_type == name]
        if not found:
            types = sorted({k.config_type for k in KERNELS.values() if k.config_type})
            raise TypeError(f"config must be None, a dict, a Choice or one of {types}, got {name}")
        # A config type may serve kernels of several pool formats: take the call's.
        found.sort(key=lambda k: k.kv_format != call.kv_format)
        k, launch = found[0], config
    why = k.why_not(call)
    if why:
        raise ValueError(f"config: the {k.name} kernel cannot run this call: {why}")
    return Choice(k.name, k.resolve(launch, call), "config=")


def _recorded(entry: configs.ConfigEntry, c: configs.KernelChoice) -> str:
    """One line on the run that recorded a kernel choice."""
    prov = c.provenance
    times = prov.get("times_ms") or {}
    shown = ", ".join(f"{n} {t:.3g} ms" for n, t in sorted(times.items(), key=lambda kv: kv[1]))
    where = ", ".join(str(prov[k]) for k in ("device", "date") if prov.get(k))
    workload = str(prov.get("workload") or "")
    if "(times summed)" in workload:  # several workloads: say so beside the sums
        shown += f" (summed over {workload.replace(' (times summed)', '')})"
    key = entry.key
    if c.tokens is not None:
        lo, hi = c.tokens
        key += f" T in [{lo}, {'inf' if hi is None else hi})"
    if c.slots is not None:
        lo, hi = c.slots
        key += f" slots/token in [{lo}, {'inf' if hi is None else hi})"
    line = f"{key}: {shown} ({where})" if shown else f"{key} ({where})"
    return line + _not_shipped(entry.source)


def _not_shipped(source: str | None) -> str:
    """`` [file]`` when an entry's file is not one of the shipped files (a user root's or a
    use_root block's: it overrides the shipped entry of its shape), else ``""``."""
    if not source or source.startswith("<"):
        return ""
    try:
        shipped = Path(source).resolve().is_relative_to(configs.CONFIG_ROOT.resolve())
    except OSError:
        shipped = False
    return "" if shipped else f" [{source}]"


# The documented default for shapes no bench recorded: per arch, rows of (max heads, max
# tokens, kernels in order of preference); the first row whose bounds hold the call (None: no
# bound) names the kernels, and the first of them that can run the call is chosen, else Triton.
# Each row's kernels are the ones measured fastest there on the H200 (docs/PERF_NOTES.md, "No
# cliffs", grid run of 2026-12-01): the heads-on-N kernel up to 32 heads (wgmma's N = 16 or 32
# heads, every KV row gathered once per token) and, below 128 tokens, up to 64 heads (two or
# more items per token fill more SMs: 11.9-12.4 us against 13.6-14.2 us at T=64, H 40-64; at
# T=256 the 64-heads-on-M kernel wins again, 26.9-28.9 us against 32.5-33.0); the
# 64-heads-on-M kernel above (its head blocks clipped at H). Triton is never chosen on sm90
# where one of them can run: it measured 1.1-20x slower there. An FP8 cache takes the same rows
# with the FP8 kernels (the bf16 ones refuse it): the heads-on-N one where its bf16 twin runs,
# the 64-heads-on-M one (gluon_ws_fp8) above 32 heads from 128 tokens on, where the heads-on-N
# one runs two or four items a token and measured 2.1-2.3x slower than FlashMLA on a bf16
# workspace (gluon_ws_fp8 is not measured yet: docs/PERF_NOTES.md, "The FP8 cache on Hopper",
# has the prediction).
RULE: dict[str, tuple[tuple[int | None, int | None, tuple[str, ...]], ...]] = {
    "sm90": (
        (32, None, ("gluon_ws_small", "gluon_ws", "gluon_mma", "gluon_ws_small_fp8",
                    "gluon_ws_fp8")),
        (64, 127, ("gluon_ws_small", "gluon_ws", "gluon_mma", "gluon_ws_small_fp8",
                   "gluon_ws_fp8")),
        (None, None, ("gluon_ws", "gluon_wgmma", "gluon_mma", "gluon_ws_fp8",
                      "gluon_ws_small_fp8")),
    ),
}  # fmt: skip


# The kernel that takes a recorded CSR-only kernel's place when the lists come as dense ids with
# their rows' lengths (Call.dense_lengths): the 64-heads-on-M warp-specialised kernel, which
# reads them itself. Where gluon_mma is recorded on the H200 (one head, T <= 16) gluon_ws
# measured 1.02-1.09x its time on CSR (whole lists, grid run of 2026-12-03 07:53) and
# gluon_ws_small, the rule's first there, 1.3-1.5x.
DENSE_STAND_IN: dict[str, str] = {"gluon_mma": "gluon_ws", "gluon_wgmma": "gluon_ws"}


def _packs(k: Kernel, call: Call) -> str | None:
    """Why the automatic choice passes ``k`` over for ``call`` although it can run it: dense
    ids with lengths, which it reads only once packed to CSR by torch ops (None: it does not)."""
    if call.dense_lengths and not k.dense_ids:
        return "reads CSR only (dense ids with lengths would be packed by torch ops first)"
    return None


def rule(call: Call) -> tuple[str, ...]:
    """The kernels :data:`RULE` prefers for ``call``'s (arch, H, T), best first (may be empty;
    a call of unknown T is taken as a large one)."""
    for max_heads, max_tokens, names in RULE.get(call.arch or "", ()):
        if max_heads is not None and call.num_heads > max_heads:
            continue
        if max_tokens is not None and (call.num_tokens is None or call.num_tokens > max_tokens):
            continue
        return names
    return ()


def _unregistered(name: str, entry: configs.ConfigEntry) -> configs.ConfigFileError:
    hint = ""
    if name == "gluon":
        hint = (
            "; the one 'gluon' kernel is now four named kernels (gluon_ws, gluon_ws_small, "
            "gluon_wgmma, gluon_mma): re-export the choice from a bench run"
        )
    return configs.ConfigFileError(
        f"{entry.source}: kernel {name!r} is not registered (known: {sorted(KERNELS)}){hint}"
    )


def choose(call: Call, *, config: Any = None, root=None) -> Choice:
    """The kernel (and launch) the entry runs for ``call`` (module docstring: the order).

    A recorded kernel that is not registered raises :class:`~sparse_mla.configs.
    ConfigFileError` (a typo must not silently cost speed).
    """
    if config is not None:
        return _forced(config, call)
    passed: list[str] = []
    entry = configs.lookup_entry(call.arch, call.num_heads, call.head_dim, root)
    slots = configs.slots_per_token(call.nnz, call.num_tokens)
    c = entry.kernel_for(call.num_tokens, slots) if entry is not None else None
    if c is not None:
        if c.name not in KERNELS:
            raise _unregistered(c.name, entry)
        k = KERNELS[c.name]
        packs = _packs(k, call)
        why = k.why_not(call) or packs
        if not why:
            launch = c.launch if c.name != FALLBACK else None
            return Choice(c.name, k.resolve(launch, call), "recorded " + _recorded(entry, c))
        passed.append(f"{c.name} recorded, but {why}")
        stand_in = KERNELS.get(DENSE_STAND_IN.get(c.name, ""))
        if packs and stand_in is not None and not stand_in.why_not(call):
            why = f"in place of the recorded {c.name}, which {packs}"
            return Choice(stand_in.name, stand_in.resolve(None, call), why)
    for name in rule(call):
        k = KERNELS.get(name)
        if k is None:
            continue
        why = k.why_not(call) or _packs(k, call)
        if not why:
            where = "no recorded choice" if c is None else passed[0]
            return Choice(name, k.resolve(None, call), f"rule for {call.arch} H={call.num_heads}"
                          f" ({where})")  # fmt: skip
        passed.append(f"{name}: {why}")
    if entry is None:
        why = "no tuned entry"
    elif c is None:
        why = f"{entry.key} records no kernel choice"
    else:
        why = ""
    why = "; ".join([w for w in (why, *passed) if w])
    name = fallback(call)
    return Choice(name, kernel(name).resolve(None, call), why)


def describe(
    arch: str | None, num_heads: int, head_dim: int, root=None, *, num_tokens: int | None = None,
    verbose: bool = False, kv_format: str = "dense", slots_per_token: int | None = None,
    dense_lengths: bool = False,
) -> str:  # fmt: skip
    """The kernel ``config=None`` runs for (arch, H, D[, T][, slots per token]) and why (no
    tensors needed; a pool the kernel cannot address may still send a call elsewhere).
    ``slots_per_token``: the call's lists' total length // T (None: unknown, the longest
    recorded lists' choice). ``verbose``: one more line per registered kernel, saying whether
    it can run the call and why not. ``kv_format``: the pool's format (:data:`FORMATS`;
    "fp8_model1" for an FP8Cache). ``dense_lengths``: the lists come as dense ids with their
    rows' lengths (``Call.dense_lengths``)."""
    call = Call.of_shape(arch, num_heads, head_dim, num_tokens=num_tokens,
                         slots_per_token=slots_per_token, kv_format=kv_format,
                         dense_lengths=dense_lengths)  # fmt: skip
    c = choose(call, root=root)
    where = arch or "CPU (interpreter)"
    t = "" if num_tokens is None else f" T={num_tokens}"
    if slots_per_token is not None:
        t += f" slots/token={slots_per_token}"
    if dense_lengths:
        t += " (dense ids with lengths)"
    line = f"{where} H={num_heads} D={head_dim}{t}: {c.kernel} ({c.reason})"
    if not verbose:
        return line
    lines = [line]
    for name, k in KERNELS.items():
        why = k.why_not(call)
        mark = "runs" if name == c.kernel else ("can run" if not why else "cannot")
        lines.append(f"  {name:<16} {mark}{': ' + why if why else ''}  [{k.summary}]")
    return "\n".join(lines)


# choice_table's default rows and columns: token counts from a step of MTP / speculative
# decoding up to a whole prompt, and list lengths (slots a token): a short prompt's, a middling
# list (context 1024), a DSv4 CSA step of a long request (top-k 512 + window 128; 1152 from
# top-k 1024, as 96 heads and more take)
TABLE_TOKENS = (1, 4, 16, 64, 256, 1024, 16384)
TABLE_SLOTS = (8, 384, 640, 1152)


def choice_table(
    arch: str | None, num_heads: int, head_dim: int, tokens=None, slots=None, root=None, *,
    kv_format: str = "dense", dense_lengths: bool = False,
) -> str:  # fmt: skip
    """Which kernel ``config=None`` runs for (arch, H, D) at each token count (rows) and list
    length (columns, slots a token; None: :data:`TABLE_TOKENS`, :data:`TABLE_SLOTS`), as a text
    table: the recorded choice depends on both (:func:`choose`), where :func:`describe` answers
    for one call. ``dense_lengths``: the lists come as dense ids with their rows' lengths (the
    choice passes over kernels that read CSR only, :attr:`Call.dense_lengths`). A cell that
    raises (a broken configs file) says so instead of the kernel."""
    tokens, slots = tokens or TABLE_TOKENS, slots or TABLE_SLOTS
    rows = []
    for t in tokens:
        row = [str(t)]
        for n in slots:
            call = Call.of_shape(arch, num_heads, head_dim, num_tokens=t, slots_per_token=n,
                                 kv_format=kv_format, dense_lengths=dense_lengths)  # fmt: skip
            try:
                row.append(choose(call, root=root).kernel)
            except Exception as e:
                row.append(f"? ({type(e).__name__})")
        rows.append(row)
    head = ["T \\ slots/token", *map(str, slots)]
    widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in (head, *rows)]  # fmt: skip
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# The entry's per-call choice, cached
# ----------------------------------------------------------------------------------------------

# (registry generation, arch, H, D, dtype, pool key, config key, configs root, file stamp)
# -> (token bounds, {token bucket: Choice}). Everything choose() reads, but T, is in the key;
# T only through its bucket (token_bounds), so an engine's varying token counts reuse entries.
_CACHE: dict[tuple, tuple[tuple[int, ...], dict[int, Choice]]] = {}
_CACHE_MAX = 4096
_PATHS: dict[tuple, tuple] = {}  # (arch, id(root)) -> (root, its configs file's path)
_SHIPPED: dict[str, tuple | None] = {}  # arch -> its shipped configs file's stamp (_stamps)
_generation = 0


def clear_cache() -> None:
    """Forget the cached choices (:func:`choose_cached`) and the shipped configs files' stamps.
    Registering a kernel and an export (:func:`sparse_mla.tune.export`) do this; call it after
    changing :data:`RULE` at run time, or after another process wrote a shipped file."""
    global _generation
    _generation += 1
    _CACHE.clear()
    _SHIPPED.clear()


def token_bounds(
    arch: str | None, num_heads: int, head_dim: int, root=None
) -> tuple[int, ...]:  # fmt: skip
    """The token counts at which :func:`choose`'s answer for (arch, H, D) may change: the
    recorded choices' bucket ends and :data:`RULE`'s token bounds (sorted). Two calls whose T
    fall between the same two bounds get the same choice."""
    bounds = set(_bucket_ends(arch, num_heads, head_dim, root, "tokens"))
    for _, max_tokens, _ in RULE.get(arch or "", ()):
        if max_tokens is not None:
            bounds.add(max_tokens + 1)
    return tuple(sorted(bounds))


def slot_bounds(
    arch: str | None, num_heads: int, head_dim: int, root=None
) -> tuple[int, ...]:  # fmt: skip
    """The slots per token at which :func:`choose`'s answer for (arch, H, D) may change: the
    recorded choices' list-length bucket ends (sorted; empty when no choice has one). Within
    one bucket of :func:`token_bounds` and one of these, the choice is the same."""
    return tuple(sorted(_bucket_ends(arch, num_heads, head_dim, root, "slots")))


def _bucket_ends(arch, num_heads: int, head_dim: int, root, field: str) -> set[int]:
    """The ends of the recorded choices' ``field`` buckets ("tokens" or "slots") for (arch,
    H, D)."""
    ends: set[int] = set()
    entry = configs.lookup_entry(arch, num_heads, head_dim, root)
    for c in entry.kernels if entry is not None else ():
        bucket = getattr(c, field)
        if bucket is not None:
            ends.update(e for e in bucket if e is not None)
    return ends


_access, _F_OK = os.access, os.F_OK


def _file_stamp(arch: str, root) -> tuple[int, ...] | None:
    """The stat stamp of ``arch``'s configs file under ``root``, None when there is none. Asked
    on every call: the usual case, no user file, is answered by ``os.access`` without the
    exception a failed ``os.stat`` raises (about half the cost in Python)."""
    got = _PATHS.get((arch, id(root)))  # by id: hashing a Path costs more than the lookup
    if got is not None and got[0] is root:
        path = got[1]
    else:  # (the root is kept in the entry, so its id is not another object's meanwhile)
        path = str(configs.config_path(arch, root))
        if len(_PATHS) >= 64:
            _PATHS.clear()
        _PATHS[(arch, id(root))] = (root, path)
    if not _access(path, _F_OK):
        return None
    try:  # (a file removed since: None)
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)


def _stamps(arch: str, roots: tuple) -> tuple:
    """The stat stamps of ``arch``'s configs file under each of ``roots``: asked on every call,
    but the shipped root's once a process (:data:`_SHIPPED`; package data, which this process
    changes only through an export, and an export clears it: :func:`clear_cache`)."""
    out = []
    for r in roots:
        if r is configs.CONFIG_ROOT:
            got = _SHIPPED.get(arch, _SHIPPED)
            if got is _SHIPPED:
                got = _SHIPPED[arch] = _file_stamp(arch, r)
            out.append(got)
        else:
            out.append(_file_stamp(arch, r))
    return tuple(out)


def choice_stamp(arch: str) -> tuple:
    """What a cached choice for ``arch`` depends on besides the call's shape, dtype, pool and
    config (the rest of :func:`choose_cached`'s key): the registry's generation, the configs
    roots (the user root over the shipped files) and their files' stat stamps (a forced kernel
    without a launch reads its tuned launch there too). Equal stamps: the same choice
    (:mod:`sparse_mla.op` keeps whole calls on it)."""
    roots = configs.roots_cached()
    return (_generation, roots, _stamps(arch, roots))


def choose_cached(
    arch: str | None, num_heads: int, head_dim: int, dtype, kv, num_tokens: int,
    nnz: int | None = None, *, config: Any = None, config_key: Any = None,
    dense_lengths: bool = False,
) -> Choice:  # fmt: skip
    """:func:`choose` for the entry's call (``Call(arch, H, D, dtype, kv, T, nnz)``), cached on
    what the choice depends on: the registry, (arch, H, D, dtype), the pool's device type,
    emptiness and 16-byte alignment, the config (``config_key``: hashable, equal for equal
    configs), the configs roots (:func:`sparse_mla.configs.roots`: the user root over the
    shipped files) and their files' stat stamps (an export is seen at once), and T's bucket
    between :func:`token_bounds` (and its slots per token's between :func:`slot_bounds`, where
    a choice is recorded by list length) and ``dense_lengths`` (``Call.dense_lengths``). A
    call that raises is not cached. CPU tensors (arch None, the interpreter, whose launch
    takes far longer than a choice) are not cached."""
    if arch is None:
        call = Call(arch, num_heads, head_dim, dtype, kv, num_tokens, nnz,
                    dense_lengths=dense_lengths)  # fmt: skip
        return choose(call, config=config)
    roots = configs.roots_cached()
    stamp = _stamps(arch, roots)
    n = kv.shape[0]
    misaligned = n > 0 and bool(kv.data_ptr() % 16 or (kv.stride(0) * kv.element_size()) % 16)
    key = (_generation, arch, num_heads, head_dim, dtype, kv.device.type, n > 0, misaligned,
           config_key, roots, stamp, dense_lengths)  # fmt: skip
    plan = _CACHE.get(key)
    if plan is None:
        bounds = sbounds = ()
        if config is None:
            bounds = token_bounds(arch, num_heads, head_dim)
            sbounds = slot_bounds(arch, num_heads, head_dim)
        if len(_CACHE) >= _CACHE_MAX:
            _CACHE.clear()
        plan = _CACHE[key] = (bounds, sbounds, {})
    bounds, sbounds, by_bucket = plan
    bucket = bisect_right(bounds, num_tokens) if bounds else 0
    if sbounds:  # (unknown lengths: a bucket of their own, served as the longest)
        slots = configs.slots_per_token(nnz, num_tokens)
        bucket = (bucket, -1 if slots is None else bisect_right(sbounds, slots))
    c = by_bucket.get(bucket)
    if c is None:
        call = Call(arch, num_heads, head_dim, dtype, kv, num_tokens, nnz,
                    dense_lengths=dense_lengths)  # fmt: skip
        c = by_bucket[bucket] = choose(call, config=config)
    return c


# The package's kernels (last: sparse_mla.kernels registers them through this module).
from . import kernels as _kernels  # noqa: E402, F401
