"""The public entry as a registered torch operator: ``torch.ops.sparse_mla.prefill``.

:func:`sparse_mla.sparse_mla_prefill` allocates ``out`` when it is not given and calls this
operator, which writes ``out`` (``Tensor(a!) out``) and returns nothing. Registered with
``torch.library`` (a ``Library`` with a schema, a CPU and a CUDA kernel and a fake kernel, the
pattern of flash-attn's ``_flash_attn_forward`` and vLLM's attention ops), the call is one opaque
node to ``torch.compile``: Dynamo does not trace the validation, the dispatch or the Triton/Gluon
launch (Inductor would otherwise take the Gluon launch for a user Triton kernel), and the fake
kernel gives shapes without running anything. ``fullgraph=True`` and ``mode="reduce-overhead"``
(CUDA graphs) work over a function that calls the entry.

Everything that needs host facts (the GPU's arch, the tuned config files, the kernel choice, the
launch) happens in the real kernel, :func:`sparse_mla.prefill._prefill_impl`, at run time.
The op's kernel (:func:`_impl`) replays a plan for a call layout it has seen (the launches the
last such call made, after the checks that depend on more than the layout; see "The op's
kernel" below), and in plain eager mode the entry calls that kernel without the dispatcher
(:func:`call`). The FP8-cache entry is ``torch.ops.sparse_mla.prefill_fp8`` (:func:`prefill_fp8`).

``config=`` reaches the operator as a string (:func:`config_spec`: canonical JSON, computed once
per config object; under ``torch.compile`` a trace-time constant, so a new config recompiles);
the real kernel turns it back into the object the caller passed (:func:`config_object`).

Dense slot lists (``kv_indices`` [T, K], ``kv_indptr=None``) take the same operator: its
``kv_indptr`` is optional (``Tensor?``), and the fake kernel, which writes nothing, is the same.
With the rows' lengths (the entry's ``kv_lengths``) the op gets them in ``kv_indptr``'s place:
a 2-D ``kv_indices`` tells them apart from CSR (:mod:`sparse_mla.validation`). Plans key on
both tensors' layouts, so the three forms never share one.

``validate`` under compile: the operator's real kernel runs at run time with real tensors, so
``validate=True`` (or ``SPARSE_MLA_VALIDATE=1``) checks ``kv_indptr``'s values there, outside
the traced graph, exactly as in eager mode (a host sync on a GPU). Inside a CUDA-graph capture
(``mode="reduce-overhead"``) the check is skipped: a replay runs no Python, so it could not
check later inputs anyway; the eager warm-up call that precedes a capture does check.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import dispatch, fastlaunch, runtime, validation

__all__ = [
    "LIB", "NAMESPACE", "SCHEMA", "SCHEMA_FP8", "call", "config_object", "config_spec",
    "plans_enabled", "prefill_fp8", "prefill_fp8_op", "prefill_op", "set_plans_enabled",
    "spec_of",
]  # fmt: skip

NAMESPACE = "sparse_mla"
SCHEMA = (
    "prefill(Tensor q, Tensor kv, Tensor kv_indices, Tensor? kv_indptr, float softmax_scale, "
    "Tensor? attn_sink, Tensor(a!) out, str? config=None, bool? validate=None, "
    "int? max_kv_length=None) -> ()"
)

# The FP8-cache entry's op: an FP8Cache is a frozen dataclass over the engine's tensor, so the op
# takes that tensor and the block size and its kernel makes the FP8Cache (whose checks run there).
SCHEMA_FP8 = (
    "prefill_fp8(Tensor q, Tensor kv_cache, int block_size, Tensor kv_indices, "
    "Tensor? kv_indptr, float softmax_scale, Tensor? attn_sink, Tensor(a!) out, str? config=None, "
    "bool? validate=None, int? max_kv_length=None) -> ()"
)

# One Library per namespace and process: every operator of the package is defined on it.
LIB = torch.library.Library(NAMESPACE, "DEF")
LIB.define(SCHEMA)
LIB.define(SCHEMA_FP8)


_IMPL: list = [None]  # the op's real work: sparse_mla.prefill._prefill_impl


def register_impl(fn) -> None:
    """Make ``fn`` the op's real work, behind :func:`_impl` (the op's CPU and CUDA kernel; ROCm
    builds of torch dispatch HIP tensors to CUDA too): :mod:`sparse_mla.prefill` registers its
    ``_prefill_impl`` when imported, which importing this module does (at its end)."""
    if _IMPL[0] is not None:
        raise RuntimeError("torch.ops.sparse_mla.prefill has its kernels already")
    _IMPL[0] = fn
    LIB.impl("prefill", _impl, "CPU")
    LIB.impl("prefill", _impl, "CUDA")


@torch.library.register_fake(f"{NAMESPACE}::prefill", lib=LIB)
def _fake(q, kv, kv_indices, kv_indptr, softmax_scale, attn_sink, out, config=None, validate=None,
          max_kv_length=None):  # fmt: skip
    # out is written in place and nothing is returned: the fake kernel has nothing to build.
    # Shape and dtype errors are raised by the real kernel (validate_inputs) when it runs.
    return None


@torch.library.register_fake(f"{NAMESPACE}::prefill_fp8", lib=LIB)
def _fake_fp8(q, kv_cache, block_size, kv_indices, kv_indptr, softmax_scale, attn_sink, out,
              config=None, validate=None, max_kv_length=None):  # fmt: skip
    return None  # as _fake: out is written in place


prefill_op = torch.ops.sparse_mla.prefill.default
prefill_fp8_op = torch.ops.sparse_mla.prefill_fp8.default

# config object -> its spec (hashable configs: frozen dataclasses); spec -> the latest object
# passed with it, so the real kernel runs the very object the caller gave (a Choice whose launch
# is a dict is not hashable and is encoded per call).
_SPECS: dict[Any, str] = {}
_OBJECTS: dict[str, Any] = {}
_MAX_ENTRIES = 4096


def _launch_json(launch: Any) -> Any:
    if launch is None:
        return None
    if isinstance(launch, Mapping):
        return dict(launch)
    if dataclasses.is_dataclass(launch) and not isinstance(launch, type):
        t = type(launch)
        return {"__type__": f"{t.__module__}:{t.__qualname__}", **dataclasses.asdict(launch)}
    raise TypeError(f"config: a launch must be a config object or a dict, got {type(launch)}")


def _encode(config: Any) -> str:
    from . import dispatch

    if isinstance(config, dispatch.Choice):
        d = {"kernel": config.kernel, "launch": _launch_json(config.launch)}
    elif isinstance(config, Mapping):
        d = {"launch": dict(config)}
    else:
        name = dispatch._type_name(config)
        if not any(k.config_type == name for k in dispatch.KERNELS.values()):
            types = sorted(k.config_type for k in dispatch.KERNELS.values() if k.config_type)
            raise TypeError(f"config must be None, a dict, a Choice or one of {types}, got {name}")
        d = {"launch": _launch_json(config)}
    return json.dumps(d, sort_keys=True)


@torch.compiler.assume_constant_result
def config_spec(config: Any) -> str:
    """The string that carries ``config`` (not None) through the operator: canonical JSON of
    the kernel it names and its launch. Under ``torch.compile`` it is computed at trace time
    and baked into the graph as a constant (Dynamo guards on the config)."""
    try:
        spec = _SPECS.get(config)
        hashable = True
    except TypeError:  # a dict, or a Choice holding a dict
        spec, hashable = None, False
    if spec is None:
        spec = _encode(config)
        if hashable:
            if len(_SPECS) >= _MAX_ENTRIES:
                _SPECS.clear()
            _SPECS[config] = spec
    if _OBJECTS.get(spec) is not config:
        if len(_OBJECTS) >= _MAX_ENTRIES:
            _OBJECTS.clear()
        _OBJECTS[spec] = config
    return spec


def spec_of(config: Any) -> str:
    """:func:`config_spec`, in a form Dynamo traces without calling into the config: a
    ``Choice`` of a kernel by name alone (the common forced call) is spelt out from its
    ``kernel`` string; any other config goes through :func:`config_spec` (a trace-time
    constant; a config object passed as an argument of a compiled function may not be
    reconstructible by older Dynamo versions: close over it instead)."""
    if _is_compiling() and type(config) is dispatch.Choice and config.launch is None:
        return '{"kernel": "' + config.kernel + '", "launch": null}'
    return config_spec(config)


def _rebuild_launch(d: Any) -> Any:
    if not isinstance(d, dict) or "__type__" not in d:
        return d
    fields = dict(d)
    module, _, qualname = fields.pop("__type__").partition(":")
    cls = importlib.import_module(module)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    from_dict = getattr(cls, "from_dict", None)
    return from_dict(fields) if from_dict is not None else cls(**fields)


def config_object(spec: str) -> Any:
    """The config a :func:`config_spec` string stands for: the object last passed with it in
    this process, else one rebuilt from the JSON (a graph compiled in another process)."""
    obj = _OBJECTS.get(spec)
    if obj is not None:
        return obj
    from . import dispatch

    d = json.loads(spec)
    launch = _rebuild_launch(d.get("launch"))
    obj = dispatch.Choice(d["kernel"], launch) if "kernel" in d else launch
    _OBJECTS[spec] = obj
    return obj


# ----------------------------------------------------------------------------------------------
# The op's kernel: a replayed plan per call layout, else the real work (prefill._prefill_impl)
# ----------------------------------------------------------------------------------------------
#
# An engine calls the op with the same shapes, strides, dtypes, scale and config every layer;
# only the tensors' addresses change. For such a call everything _prefill_impl does but the
# launch depends on that layout alone: the layout checks of validate_inputs, the kernel choice
# (plus the registry, the configs file and the GPU's arch) and the kernel's launch arguments
# (plus the inputs' 16-byte alignment). So a call whose key (below) was seen before replays
# what the last such call launched (fastlaunch.Replay) after re-checking what depends on more:
# out's overlap with the inputs (their addresses), kv_indptr's values when asked, the choice's
# stamp (dispatch.choice_stamp) and the direct-launch state (Replay.valid).
#
# A plan is recorded from a real call (_prefill_impl after the checks passed), and only when
# that call ran no torch op but torch.empty (scratch such as the KV splits' partials, lent to
# each replay by fastlaunch.Scratch: kept per stream and thread, never across a graph capture),
# launched only through fastlaunch's direct path (a Triton launch any other way is seen too:
# fastlaunch.recording) and at least once unless out is empty, with distinct inputs:
# then every launch argument is an input, a scratch tensor, or a value or tensor the call did
# not make from its inputs. Calls in Triton's interpreter (CPU tensors), under a dispatch mode,
# or with tensor subclasses never plan. Anything else (a new layout, a stale stamp, a failed
# overlap check) takes _prefill_impl's path, which raises the named errors.

_PLANS: dict[tuple, Any] = {}
_PLANS_MAX = 1024
_PLAN_TRIES = 3  # recordings per key that may fail (first compiles, caches made) before giving up
_PLANS_ON = [True]
_T = torch.Tensor
_EMPTY = torch.ops.aten.empty.memory_format
_ZEROS = torch.ops.aten.zeros.default
_DETACH = torch.ops.aten.detach.default


def plans_enabled() -> bool:
    """Whether calls replay their layout's plan (default: yes)."""
    return _PLANS_ON[0]


def set_plans_enabled(flag: bool) -> bool:
    """Turn plan replays (and the eager bypass of the dispatcher, :func:`call`) on or off;
    returns the previous setting. Off: every call is ``torch.ops.sparse_mla.prefill`` ->
    ``_prefill_impl``, as before."""
    prev, _PLANS_ON[0] = _PLANS_ON[0], bool(flag)
    _PLANS.clear()
    fastlaunch.clear_scratch()
    return prev


class _Plan:
    __slots__ = ("arch", "guard", "head", "layout", "replay", "scratch", "stamp")


# The last plan replayed or recorded, the next call's first look (an engine's layers repeat one
# layout): kept in _PLANS under these keys (as a 1-tuple, so clearing or replacing _PLANS drops
# it), one for each op. A call takes it when the plan's key would be the call's, checked without
# building the key (3-4 us of attribute reads and a tuple hash a call): the scale, config and
# block size by ==, the six tensors' dtype, device, sizes and strides by the plan's guard (a
# C++ check of all of them at once), and the 16-byte alignment the key records by one OR of the
# addresses (only plans whose inputs were all aligned are kept here). Any miss: the key.
_LAST = object()
_LAST_FP8 = object()


def _tensor_guard_type():
    """torch's C++ tensor check (``torch._C._dynamo.guards.TensorGuards``, what Dynamo's
    guards use: dispatch keys, dtype, device, requires_grad, sizes and strides of each tensor),
    or None when this torch has none that behaves as used here (then every call builds its key;
    checked once, on small CPU tensors)."""
    try:
        from torch._C._dynamo.guards import TensorGuards

        g = _make_guard(TensorGuards, (torch.empty(2, 3),))
        ok = (g.check(torch.empty(2, 3)) and not g.check(torch.empty(3, 3))
              and not g.check(torch.empty(3, 2).t()) and not g.check(torch.empty(2, 3).double())
              and not g.check(torch.empty(2, 3, 1)))  # fmt: skip
    except Exception:  # a private API: any failure means "not here"
        return None
    return TensorGuards if ok else None


def _make_guard(cls, tensors):
    """A guard of ``tensors``' layouts: sizes and strides as they are (static), not dynamic."""
    return cls(
        *tensors,
        dynamic_dims_sizes=[list(t.shape) for t in tensors],
        dynamic_dims_strides=[list(t.stride()) for t in tensors],
    )


def _guard_of(tensors, head):
    """(guard, head) for a plan recorded from a call on ``tensors`` (None for an absent sink),
    or (None, None) when it is not to be the last-plan shortcut: no guard type here, or an input
    not 16-byte aligned."""
    present = tuple(t for t in tensors if t is not None)
    if _GUARDS is None or any(t.data_ptr() & 15 for t in present):
        return None, None
    return _make_guard(_GUARDS, present), head


_GUARDS = _tensor_guard_type()


def _last(slot, q, kv, kv_indices, kv_indptr, s, out, head):
    """The last plan of ``slot`` (``_LAST`` or ``_LAST_FP8``) when this call has its key, else
    None (the caller then builds the key). ``head``: (scale, config, block size, no sink, dense
    ids), so the guard below is asked about as many tensors as it was made of."""
    got = _PLANS.get(slot)
    if got is None:
        return None
    p = got[0]
    if p.head != head:
        return None
    g = p.guard
    a = q.data_ptr() | kv.data_ptr() | kv_indices.data_ptr() | out.data_ptr()
    if kv_indptr is not None:
        if s is None:
            ok = not (a | kv_indptr.data_ptr()) & 15 and g.check(q, kv, kv_indices, kv_indptr, out)
        else:
            ok = not (a | kv_indptr.data_ptr() | s.data_ptr()) & 15 and g.check(
                q, kv, kv_indices, kv_indptr, s, out
            )
    elif s is None:
        ok = not a & 15 and g.check(q, kv, kv_indices, out)
    else:
        ok = not (a | s.data_ptr()) & 15 and g.check(q, kv, kv_indices, s, out)
    return p if ok else None


class _Watch(TorchDispatchMode):
    """Every torch op of a recorded call: ``torch.empty`` or a ``fastlaunch.zeroed``
    ``torch.zeros`` (kept: the plan's scratch) or anything else (the call is not replayable)."""

    def __init__(self):
        super().__init__()
        self.empties: list = []
        self.aliases: dict[int, int] = {}  # id of a detached alias of an empty -> its index
        self.keep: list = []
        self.other = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        r = func(*args, **kwargs)
        if (func is _EMPTY or (func is _ZEROS and fastlaunch.zeroing())) and type(r) is _T:
            self.aliases[id(r)] = len(self.empties)
            self.empties.append((args, kwargs, r, func is _ZEROS))
        elif func is _DETACH and type(r) is _T and id(args[0]) in self.aliases:
            # torch.empty's result as Python gets it under a mode: the same tensor, detached
            self.aliases[id(r)] = self.aliases[id(args[0])]
            self.keep.append(r)  # alive until the plan is built (ids stay its own)
        else:
            self.other = True
        return r


def _empty_maker(args, kwargs, zeros=False):
    kw = {k: v for k, v in kwargs.items() if v is not None}
    return functools.partial(torch.zeros if zeros else torch.empty, *args, **kw)


def _scratch(empties):
    """A plan's scratch (what its call made with torch.empty, or zero-at-rest tensors with
    fastlaunch.zeroed) as a fastlaunch.Scratch, which lends the same tensors to the next
    replay on the same stream and thread; () if none."""
    if not empties:
        return ()
    made = [r for _, _, r, _ in empties]
    return fastlaunch.Scratch(
        tuple(_empty_maker(a, kw, z) for a, kw, _, z in empties),
        tuple(
            (tuple(r.shape), r.stride(), r.dtype, r.device, r.layout, z) for _, _, r, z in empties
        ),
        sum(r.numel() * r.element_size() for r in made),
        any(r.device.type == "cuda" for r in made),
    )


def _plan_key(q, kv, kv_indices, kv_indptr, softmax_scale, s, out, config, bound=None):
    return (
        q.shape, q.stride(), q.dtype, q.device, q.data_ptr() & 15,
        kv.shape, kv.stride(), kv.dtype, kv.device, kv.data_ptr() & 15,
        kv_indices.shape, kv_indices.stride(), kv_indices.dtype, kv_indices.device,
        kv_indices.data_ptr() & 15,
        None if kv_indptr is None else (kv_indptr.shape, kv_indptr.stride(), kv_indptr.dtype,
                                        kv_indptr.device, kv_indptr.data_ptr() & 15),
        None if s is None else (s.shape, s.stride(), s.dtype, s.device, s.data_ptr() & 15),
        out.shape, out.stride(), out.dtype, out.device, out.data_ptr() & 15,
        softmax_scale, config, bound,
    )  # fmt: skip


def _value_check(validate, q) -> bool:
    """Whether a call checks kv_indptr's values (the op's kernel, its plans and
    ``prefill._prefill_impl``): as asked, else on CPU tensors or when ``SPARSE_MLA_VALIDATE``
    says so, but never inside a CUDA-graph capture."""
    # validation._wants_value_check without q.device (a device object every call)
    check = bool(validate) if validate is not None else q.is_cpu or validation._env_asks_values()
    if check and q.is_cuda and torch.cuda.is_current_stream_capturing():
        check = False
    return check


def _impl(q, kv, kv_indices, kv_indptr, softmax_scale, attn_sink, out, config=None, validate=None,
          max_kv_length=None):  # fmt: skip
    """The op's CPU and CUDA kernel: the call's plan replayed when it has a valid one, else
    ``_prefill_impl`` (recording a plan when the call can have one). See above."""
    if (
        _PLANS_ON[0] and type(q) is _T and type(kv) is _T and type(kv_indices) is _T
        and (kv_indptr is None or type(kv_indptr) is _T) and type(out) is _T
        and (attn_sink is None or type(attn_sink) is _T)
        and not runtime.runs_interpreted(q) and not torch._C._len_torch_dispatch_stack()
    ):  # fmt: skip
        _planned(q, kv, kv_indices, kv_indptr, softmax_scale, attn_sink, out, config, validate,
                 max_kv_length)  # fmt: skip
    else:
        _IMPL[0](q, kv, kv_indices, kv_indptr, softmax_scale, attn_sink, out, config, validate,
                 max_kv_length)  # fmt: skip


def _planned(q, kv, kv_indices, kv_indptr, softmax_scale, attn_sink, out, config, validate,
             bound=None):  # fmt: skip
    """:func:`_impl` past its gate (plans on, plain tensors, a compiled launch, no dispatch
    mode): the plan replayed when valid, else the full path, recording a plan when it may.
    ``bound``: the entry's ``max_kv_length`` (part of the key: it may change the launch)."""
    head = (softmax_scale, config, None, attn_sink is None, kv_indptr is None, bound)
    p = _last(_LAST, q, kv, kv_indices, kv_indptr, attn_sink, out, head)
    if p is not None and _replayable(p, q, kv, kv_indices, kv_indptr, attn_sink, out, validate):
        p.replay((q, kv, kv_indices, kv_indptr, attn_sink, out), p.scratch)
        return
    key = _plan_key(q, kv, kv_indices, kv_indptr, softmax_scale, attn_sink, out, config, bound)
    p = _PLANS.get(key)
    if type(p) is _Plan:
        if _replayable(p, q, kv, kv_indices, kv_indptr, attn_sink, out, validate):
            if p.guard is not None:
                _PLANS[_LAST] = (p,)
            p.replay((q, kv, kv_indices, kv_indptr, attn_sink, out), p.scratch)
            return
        p = None  # stale, or the overlap check fails: the full path (raises by name)
    if p is None or p < _PLAN_TRIES:
        _record(key, 0 if p is None else p, q, kv, kv_indices, kv_indptr, softmax_scale,
                attn_sink, out, config, validate, head, bound)  # fmt: skip
        return
    _IMPL[0](q, kv, kv_indices, kv_indptr, softmax_scale, attn_sink, out, config, validate,
             bound)  # fmt: skip


def _replayable(p, q, pool, kv_indices, kv_indptr, attn_sink, out, validate) -> bool:
    """Whether plan ``p`` may replay this call (the dense and the FP8 op's kernels; ``pool`` is
    the pool or the cache's tensor): the same arch and choice stamp, its launches still valid, out
    overlapping no input; then kv_indptr's values when the call asks (raises by name)."""
    arch = _prefill._arch_of(q)
    if not (
        arch == p.arch and dispatch.choice_stamp(arch) == p.stamp and p.replay.valid()
        and not (p.layout[0] and validation._overlaps_known(
            p.layout, q, pool, kv_indices, kv_indptr, attn_sink, out))
    ):  # fmt: skip
        return False
    if kv_indptr is not None and _value_check(validate, q):  # (or the dense rows' lengths)
        validation.check_ptr_values(kv_indices, kv_indptr)
    return True


def _record(key, tries, q, kv, kv_indices, kv_indptr, softmax_scale, attn_sink, out, config,
            validate, head, bound=None):  # fmt: skip
    """``_prefill_impl`` on a call that may get a plan: the checks first (the same errors in the
    same order), then the call itself recorded (launches and torch ops); a plan when it can be
    replayed, else one try fewer for this key."""
    impl = _IMPL[0]
    x = validation.validate_inputs(
        q, kv, kv_indices, kv_indptr, softmax_scale, attn_sink=attn_sink, out=out,
        validate=_value_check(validate, q),
    )  # fmt: skip
    lkey = validation._layout_key(q, kv, kv_indices, kv_indptr, attn_sink, out, None)
    layout = validation._LAYOUTS.get(lkey)
    inputs = (q, kv, kv_indices, kv_indptr, attn_sink, out)
    if layout is None or x.q is not q or x.kv is not kv:  # a layout the kernels see through views
        _store(key, _PLAN_TRIES)
        impl(q, kv, kv_indices, kv_indptr, softmax_scale, attn_sink, out, config, False, bound)
        return
    arch = _prefill._arch_of(q)
    stamp = dispatch.choice_stamp(arch)
    _plan_from(
        key,
        tries,
        arch,
        stamp,
        layout,
        inputs,
        out,
        lambda: impl(
            q, kv, kv_indices, kv_indptr, softmax_scale, attn_sink, out, config, False, bound
        ),
        (_LAST, inputs, head),
    )


def _plan_from(key, tries, arch, stamp, layout, inputs, out, launch, last) -> None:
    """Run ``launch()`` recorded and store its plan for ``key`` (the dense and the FP8 op's
    kernels): a plan when every launch went through fastlaunch, no torch op but ``torch.empty``
    ran and the choice did not change meanwhile, else one try fewer for this key. ``last``:
    (the op's last-plan slot, the tensors the key describes, the rest of the key as
    :func:`_last` compares it); the plan becomes that slot's when its guard can be made."""
    watch = _Watch()
    with fastlaunch.recording() as launches, watch:
        launch()
    if launches is None:  # another thread is recording: no plan this time
        return
    replay = None
    # A call that wrote out launched something: none recorded means a launch the recording
    # cannot see (not through fastlaunch), so no plan.
    if (launches or not out.numel()) and not watch.other and dispatch.choice_stamp(arch) == stamp:
        replay = fastlaunch.Replay.build(launches, inputs, len(watch.empties), watch.aliases)
    if replay is None:
        _store(key, tries + 1)
        return
    p = _Plan()
    p.arch, p.stamp, p.layout, p.replay = arch, stamp, layout, replay
    p.scratch = _scratch(watch.empties)
    slot, tensors, head = last
    p.guard, p.head = _guard_of(tensors, head)
    _store(key, p)
    if p.guard is not None:
        _PLANS[slot] = (p,)


def _store(key, value) -> None:
    if len(_PLANS) >= _PLANS_MAX:
        _PLANS.clear()
    _PLANS[key] = value


# ----------------------------------------------------------------------------------------------
# The entry's call of the op
# ----------------------------------------------------------------------------------------------

_is_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._is_torch_function_mode_enabled
_functorch = torch._C._are_functorch_transforms_active
_profiling = torch._C._autograd._profiler_enabled
_jit_tracing = torch._C._get_tracing_state
_grad = torch.is_grad_enabled


def _eager(q, kv, kv_indices, kv_indptr, attn_sink, out) -> bool:
    """Whether a call may skip the dispatcher (:func:`call`)."""
    return (
        _PLANS_ON[0] and not _is_compiling() and type(q) is _T and type(kv) is _T
        and type(kv_indices) is _T and (kv_indptr is None or type(kv_indptr) is _T)
        and type(out) is _T
        and (attn_sink is None or type(attn_sink) is _T)
        and not _dispatch_modes() and not _function_modes() and not _functorch()
        and not _profiling() and _jit_tracing() is None
        and not (_grad() and (q.requires_grad or kv.requires_grad or out.requires_grad
                              or (attn_sink is not None and attn_sink.requires_grad)))
    )  # fmt: skip


def call(q, kv, kv_indices, kv_indptr, softmax_scale, attn_sink, out, config, validate,
         max_kv_length=None) -> None:  # fmt: skip
    """``torch.ops.sparse_mla.prefill(...)`` as :func:`sparse_mla.sparse_mla_prefill` makes it.

    In plain eager mode the op's kernel is called without the dispatcher (a few microseconds a
    call): plain tensors (no subclass such as FakeTensor or DTensor), nothing tracing or
    watching ops (``torch.compile``, ``torch.jit.trace``, a torch function or dispatch mode,
    functorch transforms, the autograd profiler), no input that needs a gradient. There the
    dispatcher would call the same kernel with the same arguments (the op has one kernel for
    CPU and CUDA, no autograd or device guard of its own, and does not bump ``out``'s version
    counter either way). Anywhere else, and with :func:`set_plans_enabled` off, the op itself.
    (``_eager`` implies :func:`_impl`'s gate but for the interpreter, so a compiled launch goes
    straight to :func:`_planned`.)"""
    if _eager(q, kv, kv_indices, kv_indptr, attn_sink, out):
        if runtime.runs_interpreted(q):
            _IMPL[0](q, kv, kv_indices, kv_indptr, softmax_scale, attn_sink, out, config, validate,
                     max_kv_length)  # fmt: skip
        else:
            _planned(q, kv, kv_indices, kv_indptr, softmax_scale, attn_sink, out, config,
                     validate, max_kv_length)  # fmt: skip
    else:
        prefill_op(q, kv, kv_indices, kv_indptr, softmax_scale, attn_sink, out, config, validate,
                   max_kv_length)  # fmt: skip


# ----------------------------------------------------------------------------------------------
# The FP8-cache entry: torch.ops.sparse_mla.prefill_fp8
# ----------------------------------------------------------------------------------------------


def prefill_fp8(q, cache, kv_indices, kv_indptr, softmax_scale, *, attn_sink=None, out=None,
                config=None, validate=None, max_kv_length=None):  # fmt: skip
    """:func:`sparse_mla.sparse_mla_prefill` with ``kv`` an :class:`~sparse_mla.fp8.FP8Cache`,
    through ``torch.ops.sparse_mla.prefill_fp8`` (the cache's tensor and block size; the op's
    kernel makes the FP8Cache again and runs :func:`sparse_mla.fp8_prefill.
    sparse_mla_prefill_fp8` into ``out``). Arguments the schema cannot carry go to that
    function directly, which raises the named error."""
    data = cache.data
    if not _prefill._op_args(q, data, kv_indices, kv_indptr, softmax_scale, attn_sink, out):
        from .fp8_prefill import _prefill_fp8

        return _prefill_fp8(q, cache, kv_indices, kv_indptr, softmax_scale, attn_sink, out,
                            config, validate, max_kv_length)  # fmt: skip
    spec = None if config is None else spec_of(config)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    scale = float(softmax_scale)
    v = None if validate is None else bool(validate)
    m = max_kv_length
    if _eager(q, data, kv_indices, kv_indptr, attn_sink, out):
        _fp8_impl(q, data, cache.block_size, kv_indices, kv_indptr, scale, attn_sink, out, spec, v,
                  m)  # fmt: skip
    else:
        prefill_fp8_op(q, data, cache.block_size, kv_indices, kv_indptr, scale, attn_sink, out,
                       spec, v, m)  # fmt: skip
    return out


# The FP8 op's kernel keeps plans as the dense op's does (above), keyed the same way with the
# cache's tensor in the pool's place and the block size added. What the full path checks of the
# cache (FP8Cache: block size, dtype, shape, strides, byte size, 2-byte alignment) and the
# entry's checks of q against it read the layout only: keyed, not re-run. A replay re-checks
# what depends on more: out's overlap with q, the cache's bytes and the other inputs; kv_indptr's
# values when asked; the choice's stamp; the direct-launch state. The launches get the cache as
# its uint8 tensor (FP8Cache.kernel_bytes: data, or data's uint8 view, made per call). Dense
# [T, K] ids (kv_indptr None) plan too: the FP8 kernels read CSR, and the launch hands them the
# ids as they are with a kept kv_indptr (validation._dense_launch_csr), no torch op per call.

_U8 = torch.uint8


def _fp8_impl(q, kv_cache, block_size, kv_indices, kv_indptr, softmax_scale, attn_sink, out,
              config=None, validate=None, max_kv_length=None):  # fmt: skip
    """The CPU and CUDA kernel of ``torch.ops.sparse_mla.prefill_fp8``: the call's plan replayed
    when it has a valid one, else :func:`_fp8_full` (recording a plan when the call can have
    one). See above."""
    if (
        _PLANS_ON[0] and type(q) is _T and type(kv_cache) is _T and type(kv_indices) is _T
        and (kv_indptr is None or type(kv_indptr) is _T) and type(out) is _T
        and type(block_size) is int
        and (attn_sink is None or type(attn_sink) is _T)
        and not runtime.runs_interpreted(q) and not torch._C._len_torch_dispatch_stack()
    ):  # fmt: skip
        bound = max_kv_length
        head = (softmax_scale, config, block_size, attn_sink is None, kv_indptr is None, bound)
        p = _last(_LAST_FP8, q, kv_cache, kv_indices, kv_indptr, attn_sink, out, head)
        if p is not None and _replayable(p, q, kv_cache, kv_indices, kv_indptr, attn_sink, out,
                                         validate):  # fmt: skip
            _replay_fp8(p, q, kv_cache, kv_indices, kv_indptr, attn_sink, out)
            return
        key = (_plan_key(q, kv_cache, kv_indices, kv_indptr, softmax_scale, attn_sink, out,
                         config, bound), block_size)  # fmt: skip
        p = _PLANS.get(key)
        if type(p) is _Plan:
            if _replayable(p, q, kv_cache, kv_indices, kv_indptr, attn_sink, out, validate):
                if p.guard is not None:
                    _PLANS[_LAST_FP8] = (p,)
                _replay_fp8(p, q, kv_cache, kv_indices, kv_indptr, attn_sink, out)
                return
            p = None  # stale, or the overlap check fails: the full path (raises by name)
        if p is None or p < _PLAN_TRIES:
            _record_fp8(key, 0 if p is None else p, q, kv_cache, block_size, kv_indices,
                        kv_indptr, softmax_scale, attn_sink, out, config, validate,
                        head, bound)  # fmt: skip
            return
    _fp8_full(q, kv_cache, block_size, kv_indices, kv_indptr, softmax_scale, attn_sink, out,
              config, validate, max_kv_length)  # fmt: skip


def _replay_fp8(p, q, kv_cache, kv_indices, kv_indptr, attn_sink, out) -> None:
    """Replay the FP8 plan ``p`` (checked) on this call: the launches get the cache as uint8."""
    raw = kv_cache if kv_cache.dtype == _U8 else kv_cache.view(_U8)
    p.replay((q, raw, kv_indices, kv_indptr, attn_sink, out), p.scratch)


def _fp8_full(q, kv_cache, block_size, kv_indices, kv_indptr, softmax_scale, attn_sink, out,
              config=None, validate=None, max_kv_length=None):  # fmt: skip
    """The FP8 op's full path: the FP8Cache (its checks run here, on the real tensor), then the
    FP8 entry's checks, choice and launch."""
    from .fp8 import FP8Cache
    from .fp8_prefill import _prefill_fp8

    _prefill_fp8(
        q, FP8Cache(kv_cache, block_size), kv_indices, kv_indptr, softmax_scale, attn_sink, out,
        None if config is None else config_object(config), _value_check(validate, q),
        max_kv_length,
    )  # fmt: skip


def _record_fp8(key, tries, q, kv_cache, block_size, kv_indices, kv_indptr, softmax_scale,
                attn_sink, out, config, validate, head, bound=None):  # fmt: skip
    """:func:`_fp8_full` on a call that may get a plan: the cache's and the entry's checks and
    the choice first (the same errors in the same order), then the launch recorded; a plan when
    it can be replayed, else one try fewer for this key (as :func:`_record`)."""
    from . import fp8_prefill
    from .fp8 import FP8Cache

    arch = _prefill._arch_of(q)
    stamp = dispatch.choice_stamp(arch)
    cache = FP8Cache(kv_cache, block_size)
    conf = None if config is None else config_object(config)
    x, choice = fp8_prefill._checked(q, cache, kv_indices, kv_indptr, softmax_scale, attn_sink,
                                     out, conf, _value_check(validate, q), bound)  # fmt: skip
    stub = fp8_prefill._stub(cache.device)
    lkey = validation._layout_key(q, stub, kv_indices, kv_indptr, attn_sink, out, None)
    layout = validation._LAYOUTS.get(lkey)
    if layout is None:  # a layout the kernels see through copies or views
        _store(key, _PLAN_TRIES)
        fp8_prefill._launch(x, cache, choice, out)
        return
    # validate_inputs' extents with the cache's bytes in the stub's place (an empty out, which
    # overlaps nothing, has extent 0: no overlap check, as _checked's).
    out_ext, q_ext, same, exts = layout
    layout = (out_ext, q_ext, same, (validation._extent(kv_cache), *exts[1:]))
    raw = cache.kernel_bytes()  # made here, so the launch's cache argument is an input
    inputs = (q, raw, kv_indices, kv_indptr, attn_sink, out)
    _plan_from(
        key,
        tries,
        arch,
        stamp,
        layout,
        inputs,
        out,
        lambda: fp8_prefill._launch(x, cache, choice, out),
        (_LAST_FP8, (q, kv_cache, kv_indices, kv_indptr, attn_sink, out), head),
    )


LIB.impl("prefill_fp8", _fp8_impl, "CPU")
LIB.impl("prefill_fp8", _fp8_impl, "CUDA")


from . import prefill as _prefill  # noqa: E402  (registers the op's kernels)
