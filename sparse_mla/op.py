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

``config=`` reaches the operator as a string (:func:`config_spec`: canonical JSON, computed once
per config object; under ``torch.compile`` a trace-time constant, so a new config recompiles);
the real kernel turns it back into the object the caller passed (:func:`config_object`).

Dense slot lists (``kv_indices`` [T, K], ``kv_indptr=None``) take the same operator: its
``kv_indptr`` is optional (``Tensor?``), and the fake kernel, which writes nothing, is the same.

``validate`` under compile: the operator's real kernel runs at run time with real tensors, so
``validate=True`` (or ``SPARSE_MLA_VALIDATE=1``) checks ``kv_indptr``'s values there, outside
the traced graph, exactly as in eager mode (a host sync on a GPU). Inside a CUDA-graph capture
(``mode="reduce-overhead"``) the check is skipped: a replay runs no Python, so it could not
check later inputs anyway; the eager warm-up call that precedes a capture does check.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["LIB", "NAMESPACE", "SCHEMA", "config_object", "config_spec", "prefill_op", "spec_of"]

NAMESPACE = "sparse_mla"
SCHEMA = (
    "prefill(Tensor q, Tensor kv, Tensor kv_indices, Tensor? kv_indptr, float softmax_scale, "
    "Tensor? attn_sink, Tensor(a!) out, str? config=None, bool? validate=None) -> ()"
)

# One Library per namespace and process: other operators of the package (the FP8 cache entry)
# define their schemas on this one.
LIB = torch.library.Library(NAMESPACE, "DEF")
LIB.define(SCHEMA)


_registered = False


def register_impl(fn) -> None:
    """Make ``fn`` the op's CPU and CUDA kernel (ROCm builds of torch dispatch HIP tensors to
    CUDA too). :mod:`sparse_mla.prefill` registers its ``_prefill_impl`` when imported, which
    importing this module does (at its end); registered directly, a call pays no extra frame."""
    global _registered
    if _registered:
        raise RuntimeError("torch.ops.sparse_mla.prefill has its kernels already")
    LIB.impl("prefill", fn, "CPU")
    LIB.impl("prefill", fn, "CUDA")
    _registered = True


@torch.library.register_fake(f"{NAMESPACE}::prefill", lib=LIB)
def _fake(q, kv, kv_indices, kv_indptr, softmax_scale, attn_sink, out, config=None, validate=None):
    # out is written in place and nothing is returned: the fake kernel has nothing to build.
    # Shape and dtype errors are raised by the real kernel (validate_inputs) when it runs.
    return None


prefill_op = torch.ops.sparse_mla.prefill.default

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
    from .dispatch import Choice

    if torch.compiler.is_compiling() and type(config) is Choice and config.launch is None:
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


from . import prefill as _prefill  # noqa: E402, F401  (registers the op's kernels)
