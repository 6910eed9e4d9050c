"""Which kernel the public entry runs: a registry of kernel launchers and the choice per call.

``sparse_mla_prefill(..., config=None)`` runs, for the local arch and the call's (H, D), the
kernel that ``configs/<arch>/.../DEFAULT.json`` records as the fastest: the entry's ``kernel``
object (its name, optionally its launch, and the provenance of the run that chose it). Triton,
with its tuned launch, runs where nothing is recorded and where the recorded kernel cannot run
the call (CPU interpreter, an arch without that kernel, a head dim or pool it cannot take).
``config=`` forces a kernel and its launch: a :class:`~sparse_mla.configs.PrefillConfig` or a
dict of its fields (Triton), a kernel's own config object (``GluonConfig``: Gluon), or a
:class:`Choice` naming any registered kernel.

Kernels join the registry with :func:`register` (the package's own are registered by
:mod:`sparse_mla.prefill`, the module of the public entry). This module imports no kernel, so
the dependencies run one way: entry -> dispatch -> configs, and entry -> kernels.

Adding a kernel: register a :class:`Kernel` beside the others in ``prefill.py`` (its ``run`` on
validated inputs, ``resolve`` for its launch, ``unavailable`` for where it cannot run). It is
then a provider of ``sparse-mla bench`` under its name, ``config=Choice(name)`` forces it, and
``sparse-mla export BENCH.csv --arch ARCH --kernel-choice`` records it for the shapes where a
bench run found it fastest.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from . import configs

__all__ = ["KERNELS", "Call", "Choice", "Kernel", "choose", "describe", "kernel", "register"]


@dataclass(frozen=True)
class Call:
    """What a kernel needs to know to say whether it can run a call."""

    arch: str | None  # local GPU arch ("sm90", "gfx942"); None: CPU tensors (interpreter)
    num_heads: int
    head_dim: int
    dtype: Any = None  # q's torch dtype (None: not known, e.g. a shape-only question)
    kv: Any = None  # the [N, D] pool (None: not known)


@dataclass(frozen=True)
class Kernel:
    """One kernel the entry can run.

    ``run(q, kv, kv_indices, kv_indptr, softmax_scale, attn_sink, out, launch)`` launches it on
    validated inputs (``kv`` is [N, D], T > 0 and N > 0) and writes ``out``. ``resolve(launch,
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
    per_call_keys: tuple[str, ...] = ()  # launch keys the kernel computes per call (not recorded)


class _Registry(dict):
    """The kernel registry. The package's own kernels register when :mod:`sparse_mla.prefill`
    is imported; ``import sparse_mla`` no longer imports it (it stays light: no torch), so the
    first read of the registry imports it, and a caller that reached this module another way
    (``from sparse_mla import bench, dispatch``) still sees them."""

    _loaded = False

    def _load(self) -> None:
        if not _Registry._loaded:
            _Registry._loaded = True
            import importlib

            importlib.import_module(f"{__package__}.prefill")

    def __getitem__(self, key):
        self._load()
        return super().__getitem__(key)

    def __contains__(self, key) -> bool:
        self._load()
        return super().__contains__(key)

    def __iter__(self):
        self._load()
        return super().__iter__()

    def __len__(self) -> int:
        self._load()
        return super().__len__()

    def get(self, key, default=None):
        self._load()
        return super().get(key, default)

    def keys(self):
        self._load()
        return super().keys()

    def values(self):
        self._load()
        return super().values()

    def items(self):
        self._load()
        return super().items()


KERNELS: dict[str, Kernel] = _Registry()
FALLBACK = "triton"


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
        k = kernel(config.kernel)
        launch = config.launch
    elif isinstance(config, Mapping):
        k, launch = kernel(FALLBACK), config
    else:
        name = _type_name(config)
        found = [k for k in KERNELS.values() if k.config_type == name]
        if not found:
            types = sorted(k.config_type for k in KERNELS.values() if k.config_type)
            raise TypeError(f"config must be None, a dict, a Choice or one of {types}, got {name}")
        k, launch = found[0], config
    why = k.unavailable(call)
    if why:
        raise ValueError(f"config: the {k.name} kernel cannot run this call: {why}")
    return Choice(k.name, k.resolve(launch, call), "config=")


def _recorded(entry: configs.ConfigEntry) -> str:
    """One line on the run that recorded an entry's kernel choice."""
    prov = entry.kernel.provenance
    times = prov.get("times_ms") or {}
    shown = ", ".join(f"{n} {t:.3g} ms" for n, t in sorted(times.items(), key=lambda kv: kv[1]))
    where = ", ".join(str(prov[k]) for k in ("device", "date") if prov.get(k))
    return f"{entry.key}: {shown} ({where})" if shown else f"{entry.key} ({where})"


def choose(call: Call, *, config: Any = None, root=None) -> Choice:
    """The kernel (and launch) the entry runs for ``call``.

    ``config`` given: that kernel and launch (ValueError if that kernel cannot run the call).
    Else the kernel recorded in configs/ for (arch, H, D) when it can run the call, else Triton
    with its tuned (or default) launch. A recorded kernel that is not registered raises
    :class:`~sparse_mla.configs.ConfigFileError` (a typo must not silently cost speed).
    """
    if config is not None:
        return _forced(config, call)
    fallback = kernel(FALLBACK)
    entry = configs.lookup_entry(call.arch, call.num_heads, call.head_dim, root)
    if entry is None or entry.kernel is None:
        why = "no tuned entry" if entry is None else f"{entry.key} records no kernel choice"
        return Choice(FALLBACK, fallback.resolve(None, call), why)
    name = entry.kernel.name
    if name not in KERNELS:
        raise configs.ConfigFileError(
            f"{configs.config_path(call.arch, root)}: entry {entry.key!r}: kernel {name!r} is "
            f"not registered (known: {sorted(KERNELS)})"
        )
    k = KERNELS[name]
    why = k.unavailable(call)
    if why:
        return Choice(FALLBACK, fallback.resolve(None, call), f"{name} recorded, but {why}")
    launch = entry.kernel.launch if name != FALLBACK else None
    return Choice(name, k.resolve(launch, call), "recorded " + _recorded(entry))


def describe(arch: str | None, num_heads: int, head_dim: int, root=None) -> str:
    """One line: the kernel ``config=None`` runs for (arch, H, D) and why (no tensors needed;
    a pool the kernel cannot address may still send a call to Triton)."""
    c = choose(Call(arch, num_heads, head_dim), root=root)
    where = arch or "CPU (interpreter)"
    return f"{where} H={num_heads} D={head_dim}: {c.kernel} ({c.reason})"
