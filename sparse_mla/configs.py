"""Tuned launch configs: <root>/<arch>/triton/attention/sparse_attention_dsv4/DEFAULT.json.

One JSON file per architecture id (``gfx942``, ``gfx950``, ``sm90``; never product names),
keyed by shape::

    {
      "H64_D512": {
        "kernel": {"name": "gluon",
                   "provenance": {"device": "...", "date": "2026-11-29", "source": "...",
                                  "times_ms": {"gluon": 4.79, "triton": 6.51}, ...}},
        "launch": {"BLOCK_H": 16, "BLOCK_K": 16, "num_warps": 1, "num_stages": 2,
                   "EVEN_HD": true, "USE_EXP2": true, "kpack": 2, "waves_per_eu": 1},
        "provenance": {"device": "...", "triton": "3.6.0", "date": "2026-11-29",
                       "workload": "...", "time_ms": 1.6, "sweep_size": 36, ...}
      }
    }

``launch`` holds :class:`PrefillConfig` fields, the Triton kernel's launch (``kpack`` and
``waves_per_eu`` on AMD archs only); ``provenance`` says where its numbers come from. The
optional ``kernel`` records which of the package's kernels is the fastest for the shape (its
``name``, optionally its own ``launch``, and the ``provenance`` of the same-run timing that chose
it, ``times_ms`` per kernel), or a list of such choices, each serving a bucket of token
counts (``"tokens": [lo, hi]``) and, where the fastest kernel depends on how long the lists are
(a chunked-prefill or MTP step of a long request against a short prompt), a bucket of slots per
token (``"slots": [lo, hi]``); :mod:`sparse_mla.dispatch` reads it. Every file is validated as
a whole when first read (strict JSON: no duplicate keys, no integer of more than 18 digits;
types, known keys, a launch the kernel accepts for that shape, a recorded kernel's own
``launch`` checked against that kernel's config in the registry); a broken, unreadable or
dangling file raises :class:`ConfigFileError` naming the file and the entry.

Where the files live (the roots), first match per shape wins:

1. Inside ``with use_root(path):`` only ``path`` (a context variable: the current thread and
   the tasks it starts with a copied context; threads started in the block do not see it).
   For a notebook's scratch copy; ``path`` must be an existing folder.
2. Else the user root, read over the shipped files entry by entry (a shape the user root has
   replaces the shipped entry for that shape; other shapes keep the shipped ones). It is
   ``$SPARSE_MLA_CONFIG_DIR`` when that variable is set (then the folder must exist), else
   ``$XDG_CONFIG_HOME/sparse-mla`` (default ``~/.config/sparse-mla``; absent is fine). The
   variable is read at each lookup and holds for every thread of the process: the way for an
   engine that dispatches from worker threads to use its own tuned files.
3. The shipped files, package data under ``sparse_mla/tuned/`` (:data:`CONFIG_ROOT`, found with
   importlib.resources, so a wheel install has them).

Writing entries (atomically, under a file lock) is :func:`sparse_mla.tune.export` and
:func:`sparse_mla.tune.export_kernel_choice`; without ``root=`` they write under the
``use_root`` block's root, else the user root (:func:`config_path`), never the shipped files
(pass ``root=CONFIG_ROOT``, CLI ``--root sparse_mla/tuned``, to update those in a checkout).

A missing file or entry is the normal case for most shapes and is silent (nothing logged):
:func:`lookup` returns None and the launcher uses :func:`sparse_mla.prefill.default_config`.
This module owns the config dataclass and imports no other module of the package at import
time, so the kernels and the dispatch can import it; checking a recorded kernel's ``launch``
asks the registry (:mod:`sparse_mla.dispatch`) when a file is read.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime as _dt
import functools
import importlib.resources
import itertools
import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CONFIG_DIR_ENV",
    "CONFIG_ROOT",
    "PROVENANCE_KEYS",
    "ConfigEntry",
    "ConfigFileError",
    "KernelChoice",
    "PrefillConfig",
    "config_path",
    "dump_entries",
    "entries",
    "holds",
    "launch_types",
    "lookup",
    "lookup_entry",
    "parse_entries",
    "parse_shape_key",
    "read_json",
    "roots",
    "shape_key",
    "slots_per_token",
    "use_root",
    "user_root",
    "validate_all",
    "validate_file",
]

# The shipped tuned files: package data (sparse_mla/tuned/), present in a wheel install too.
CONFIG_ROOT = Path(str(importlib.resources.files(__package__).joinpath("tuned")))
# The environment variable naming the user root (read at each lookup, never at import).
CONFIG_DIR_ENV = "SPARSE_MLA_CONFIG_DIR"
# The root that lookups without an explicit ``root`` read: CONFIG_ROOT unless use_root() says
# otherwise. A context variable, so a notebook's scratch root does not leak into other threads.
_ACTIVE_ROOT: contextvars.ContextVar[Path | None] = contextvars.ContextVar(
    "sparse_mla_config_root", default=None
)


@contextlib.contextmanager
def use_root(root: str | Path):
    """Inside the block, lookups (and so the launcher) and exports without ``root=`` use only
    ``root`` (an existing folder; ConfigFileError otherwise), not the user root or the shipped
    files. The current thread only: for a process-wide root set ``SPARSE_MLA_CONFIG_DIR``."""
    path = Path(root)
    if not path.is_dir():
        raise ConfigFileError(f"use_root: {path} is not an existing folder")
    token = _ACTIVE_ROOT.set(path)
    try:
        yield path
    finally:
        _ACTIVE_ROOT.reset(token)


def user_root() -> Path | None:
    """The user's config root: ``$SPARSE_MLA_CONFIG_DIR`` when set (ConfigFileError unless it is
    an existing folder), else ``$XDG_CONFIG_HOME/sparse-mla`` or ``~/.config/sparse-mla``
    (which may not exist; None when there is no home folder)."""
    env = os.environ.get(CONFIG_DIR_ENV)
    if env:
        path = Path(env).expanduser()
        if not path.is_dir():
            raise ConfigFileError(f"{CONFIG_DIR_ENV}={env}: not an existing folder")
        return path
    base = os.environ.get("XDG_CONFIG_HOME")
    if not base:
        try:
            base = Path.home() / ".config"
        except RuntimeError:  # no HOME and no passwd entry
            return None
    return Path(base) / "sparse-mla"


def roots() -> tuple[Path, ...]:
    """The roots lookups without ``root=`` read, first match per shape wins: the ``use_root``
    block's root alone, else the user root then the shipped :data:`CONFIG_ROOT`."""
    active = _ACTIVE_ROOT.get()
    if active is not None:
        return (active,)
    user = user_root()
    if user is None or user == CONFIG_ROOT:
        return (CONFIG_ROOT,)
    return (user, CONFIG_ROOT)


def _default_root() -> Path:
    """Where exports without ``root=`` write: the ``use_root`` root, else the user root."""
    return roots()[0]


# (SPARSE_MLA_CONFIG_DIR, XDG_CONFIG_HOME, HOME) -> roots() outside a use_root block.
_ROOTS_BY_ENV: dict[tuple, tuple[Path, ...]] = {}
# os.environ's own dict of bytes on POSIX (as sparse_mla/_env.py reads it; configs imports
# nothing of the package): every os.environ[...] = / del updates it.
_ENV_BYTES = getattr(os.environ, "_data", None) if os.name == "posix" else None
if not isinstance(_ENV_BYTES, dict) or CONFIG_DIR_ENV != "SPARSE_MLA_CONFIG_DIR":
    _ENV_BYTES = None


def roots_cached() -> tuple[Path, ...]:
    """:func:`roots` for every call of the entry: the roots a lookup without ``root=`` reads
    (the user root over the shipped files), from the environment variables they are made of
    (Path building and ``Path.home()`` once per their values). A ``$SPARSE_MLA_CONFIG_DIR``
    that is no longer a folder still raises, as in :func:`user_root`."""
    active = _ACTIVE_ROOT.get()
    if active is not None:
        return (active,)
    data = _ENV_BYTES
    if data is not None:  # undecoded values: a key, not the values user_root reads
        env = data.get(b"SPARSE_MLA_CONFIG_DIR")
        key = (env, data.get(b"XDG_CONFIG_HOME"), data.get(b"HOME"))
    else:
        env = os.environ.get(CONFIG_DIR_ENV)
        key = (env, os.environ.get("XDG_CONFIG_HOME"), os.environ.get("HOME"))
    got = _ROOTS_BY_ENV.get(key)
    if got is None or (env and not os.path.isdir(got[0])):
        got = roots()  # raises ConfigFileError for a bad $SPARSE_MLA_CONFIG_DIR
        if len(_ROOTS_BY_ENV) >= 64:
            _ROOTS_BY_ENV.clear()
        _ROOTS_BY_ENV[key] = got
    return got


_OP_DIR = Path("triton/attention/sparse_attention_dsv4")
_SHAPE_RE = re.compile(r"^H([1-9][0-9]*)_D([1-9][0-9]*)$")
_AMD_ONLY = ("kpack", "waves_per_eu")
_NVIDIA_ONLY = ("maxnreg",)


@dataclass(frozen=True)
class PrefillConfig:
    """Launch parameters of the Triton prefill kernel.

    ``PREFETCH_KV`` loads the next tile's ids and rows into registers before this tile's math
    (a software pipeline of depth 2 in registers; costs the registers of one KV tile).
    ``EVEN_HD=None`` means "on whenever it is valid" (head_dim == BLOCK_D and
    num_heads % BLOCK_H == 0). ``kpack`` and ``waves_per_eu`` are AMD compiler options: accepted
    everywhere, passed to the compiler only on AMD; ``maxnreg`` (a register cap per thread)
    likewise only on NVIDIA.
    """

    BLOCK_H: int = 16
    BLOCK_K: int = 32
    num_warps: int = 4
    num_stages: int = 2
    EVEN_HD: bool | None = None
    USE_EXP2: bool = True
    PREFETCH_KV: bool = False
    kpack: int | None = None
    waves_per_eu: int | None = None
    maxnreg: int | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PrefillConfig:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(
                f"config: unknown key(s) {unknown}; expected a subset of {sorted(names)}"
            )
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def compile_options(self, backend: str) -> dict[str, Any]:
        """Compiler options for ``backend`` ("cuda" or "hip"); the other vendor's are dropped."""
        opts: dict[str, Any] = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        own = _AMD_ONLY if backend == "hip" else _NVIDIA_ONLY
        opts.update({k: getattr(self, k) for k in own if getattr(self, k) is not None})
        return opts

    def validate(self) -> None:
        """Raise ValueError naming the field unless every field has a type and value the kernel
        and compiler accept (ints are ints, not floats or bools; flags are bools)."""
        for name in ("BLOCK_H", "BLOCK_K"):
            v = getattr(self, name)
            if not _is_int(v) or not 16 <= v <= MAX_BLOCK or v & (v - 1):
                raise ValueError(
                    f"config: {name} must be a power of two in [16, {MAX_BLOCK}] (tl.dot), "
                    f"got {v!r}"
                )
        if not _is_int(self.num_warps) or self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"config: num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps!r}")
        if not _is_int(self.num_stages) or not 1 <= self.num_stages <= MAX_STAGES:
            raise ValueError(
                f"config: num_stages must be an int in [1, {MAX_STAGES}], got {self.num_stages!r}"
            )
        if self.EVEN_HD is not None and not isinstance(self.EVEN_HD, bool):
            raise ValueError(f"config: EVEN_HD must be True, False or None, got {self.EVEN_HD!r}")
        for name in ("USE_EXP2", "PREFETCH_KV"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"config: {name} must be True or False, got {getattr(self, name)!r}"
                )
        if self.kpack is not None and (not _is_int(self.kpack) or self.kpack not in (1, 2)):
            raise ValueError(f"config: kpack must be 1, 2 or None, got {self.kpack!r}")
        if self.waves_per_eu is not None and not (
            _is_int(self.waves_per_eu) and 0 <= self.waves_per_eu <= 8
        ):
            raise ValueError(
                f"config: waves_per_eu must be an int in [0, 8] or None, got {self.waves_per_eu!r}"
            )
        if self.maxnreg is not None and not (_is_int(self.maxnreg) and 24 <= self.maxnreg <= 255):
            raise ValueError(f"config: maxnreg must be an int in [24, 255], got {self.maxnreg!r}")


MAX_BLOCK = 256  # BLOCK_H and BLOCK_K
MAX_STAGES = 8


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@functools.lru_cache(maxsize=1)
def launch_types() -> dict[str, tuple[type, bool]]:
    """PrefillConfig's fields as JSON types: name -> (int or bool, None allowed)."""
    out = {}
    for f in fields(PrefillConfig):
        text = f.type if isinstance(f.type, str) else repr(f.type)
        out[f.name] = (bool if "bool" in text else int, "None" in text)
    return out


_LAUNCH_REQUIRED = ("BLOCK_H", "BLOCK_K", "num_warps", "num_stages")

# Provenance fields: (type(s), required). Numbers may be null when not measured.
_PROV_TYPES: dict[str, tuple[tuple[type, ...], bool]] = {
    "device": ((str,), True),
    "triton": ((str,), True),
    "date": ((str,), True),
    "workload": ((str,), True),
    "time_ms": ((int, float, type(None)), True),
    "sweep_size": ((int, type(None)), True),
    "torch": ((str,), False),
    "mode": ((str,), False),
    "source": ((str,), False),
    "notes": ((str,), False),
    "rel_l2": ((int, float, type(None)), False),
    "occupancy": ((int, float, type(None)), False),
    "spill_bytes": ((int, type(None)), False),
    "registers": ((int, type(None)), False),
}
PROVENANCE_KEYS = tuple(_PROV_TYPES)
_ENTRY_KEYS = ("launch", "provenance")
_OPTIONAL_ENTRY_KEYS = ("kernel",)
_KERNEL_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")
# Provenance of a kernel choice: (type(s), required).
_CHOICE_PROV_TYPES: dict[str, tuple[tuple[type, ...], bool]] = {
    "device": ((str,), True),
    "date": ((str,), True),
    "source": ((str,), True),
    "times_ms": ((dict,), True),
    "workload": ((str,), False),
    "commit": ((str,), False),
    "run": ((str,), False),
    "triton": ((str,), False),
    "torch": ((str,), False),
    "notes": ((str,), False),
}


class ConfigFileError(ValueError):
    """A tuned-config file that cannot be used; the message names the file."""


def slots_per_token(nnz: int | None, num_tokens: int | None) -> int | None:
    """A call's slots per token, the list length recorded choices are bucketed by: its lists'
    total length (``kv_indices.numel()``, [T, K] ids: T x K) // T; None when either is unknown
    or T is 0."""
    if nnz is None or not num_tokens:
        return None
    return nnz // num_tokens


def holds(bucket: Sequence[int | None] | None, value: int | None) -> bool:
    """Whether ``value`` is in the bucket [lo, hi) (bucket None: every value; value None: only
    an open-ended bucket holds it)."""
    if bucket is None:
        return True
    lo, hi = bucket
    if value is None:
        return hi is None
    return lo <= value and (hi is None or value < hi)


@dataclass(frozen=True)
class KernelChoice:
    """An entry's recorded kernel: its name, its launch (None: the kernel's default; Triton's
    is the entry's ``launch``), the provenance of the run that chose it, the token counts it
    serves: ``tokens = (lo, hi)`` for lo <= T < hi (hi None: no upper end; None: every T),
    and the list lengths: ``slots = (lo, hi)`` for lo <= a call's slots per token (its lists'
    total length // T, :func:`slots_per_token`) < hi (None: every length)."""

    name: str
    launch: dict[str, Any] | None = None
    provenance: dict[str, Any] = field(default_factory=dict)
    tokens: tuple[int, int | None] | None = None
    slots: tuple[int, int | None] | None = None

    def serves(self, num_tokens: int | None, slots: int | None = None) -> bool:
        """Whether this choice is the one for a call of ``num_tokens`` tokens and ``slots``
        slots per token (None: the largest, i.e. a bucket without an upper end)."""
        return holds(self.tokens, num_tokens) and holds(self.slots, slots)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        if self.tokens is not None:
            out["tokens"] = list(self.tokens)
        if self.slots is not None:
            out["slots"] = list(self.slots)
        if self.launch is not None:
            out["launch"] = dict(self.launch)
        out["provenance"] = dict(self.provenance)
        return out


@dataclass(frozen=True)
class ConfigEntry:
    """One validated shape entry: Triton's launch as a PrefillConfig, its provenance, and the
    kernels recorded as the fastest for the shape (empty: none recorded), one per token bucket
    (a single choice without ``tokens`` serves every T); ``source`` names the file it came from."""

    num_heads: int
    head_dim: int
    launch: PrefillConfig
    provenance: dict[str, Any] = field(default_factory=dict)
    kernels: tuple[KernelChoice, ...] = ()
    source: str | None = field(default=None, compare=False)

    @property
    def key(self) -> str:
        return shape_key(self.num_heads, self.head_dim)

    @property
    def kernel(self) -> KernelChoice | None:
        """The choice for the largest token counts (None: no kernel recorded)."""
        return self.kernel_for(None)

    def kernel_for(self, num_tokens: int | None, slots: int | None = None) -> KernelChoice | None:
        """The recorded choice whose token bucket holds ``num_tokens`` and whose list-length
        bucket holds ``slots`` (slots per token, :func:`slots_per_token`); None: the largest."""
        for c in self.kernels:
            if c.serves(num_tokens, slots):
                return c
        return None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        one = self.kernels[0] if len(self.kernels) == 1 else None
        if one is not None and one.tokens is None and one.slots is None:
            out["kernel"] = self.kernels[0].to_json()
        elif self.kernels:
            out["kernel"] = [c.to_json() for c in self.kernels]
        out["launch"] = launch_to_json(self.launch)
        out["provenance"] = dict(self.provenance)
        return out


def shape_key(num_heads: int, head_dim: int) -> str:
    """``"H16_D512"``: the key of a shape's entry."""
    return f"H{num_heads}_D{head_dim}"


def parse_shape_key(key: str) -> tuple[int, int]:
    """``"H16_D512"`` -> (16, 512); ValueError on any other form."""
    m = _SHAPE_RE.match(key) if isinstance(key, str) else None
    if m is None:
        raise ValueError(f"shape key must look like 'H16_D512', got {key!r}")
    return int(m.group(1)), int(m.group(2))


def config_path(arch: str, root: Path | str | None = None) -> Path:
    """Path of ``arch``'s DEFAULT.json under ``root`` (default: where an export without ``root``
    writes: the ``use_root`` block's root, else the user root; see the module docstring)."""
    if not isinstance(arch, str) or not re.fullmatch(r"[a-z]+[0-9a-z]*", arch):
        raise ValueError(f"arch must be an id like 'gfx942' or 'sm90', got {arch!r}")
    return Path(root if root is not None else _default_root()) / arch / _OP_DIR / "DEFAULT.json"


def _is_amd_arch(arch: str) -> bool:
    return arch.startswith("gfx")


def launch_to_json(cfg) -> dict[str, Any]:
    """A PrefillConfig as the JSON ``launch`` object (None fields left out, field order)."""
    return cfg.to_dict()


def _check_launch(arch: str, num_heads: int, head_dim: int, launch: Any):
    """The PrefillConfig of a ``launch`` object; ValueError saying what is wrong."""
    if not isinstance(launch, dict):
        raise ValueError(f"'launch' must be an object, got {type(launch).__name__}")
    types = launch_types()
    unknown = sorted(set(launch) - set(types))
    if unknown:
        raise ValueError(f"launch: unknown key(s) {unknown}; known: {list(types)}")
    missing = [k for k in _LAUNCH_REQUIRED if k not in launch]
    if missing:
        raise ValueError(f"launch: missing key(s) {missing}")
    for k, v in launch.items():
        typ, nullable = types[k]
        if v is None and nullable:
            continue
        # bool is an int subclass: reject True where a count is expected and 1 for a flag.
        if type(v) is not typ:
            raise ValueError(f"launch: {k} must be {typ.__name__}, got {v!r}")
    if not _is_amd_arch(arch):
        amd = [k for k in _AMD_ONLY if launch.get(k) is not None]
        if amd:
            raise ValueError(f"launch: {amd} are AMD compiler options, not valid for {arch}")
    elif launch.get("maxnreg") is not None:
        raise ValueError(f"launch: maxnreg is an NVIDIA compiler option, not valid for {arch}")
    if launch.get("kpack") not in (None, 1, 2):
        raise ValueError(f"launch: kpack must be 1 or 2, got {launch['kpack']!r}")
    if launch.get("waves_per_eu") is not None and not 0 <= launch["waves_per_eu"] <= 8:
        raise ValueError(f"launch: waves_per_eu must be in 0..8, got {launch['waves_per_eu']!r}")
    cfg = PrefillConfig.from_dict(dict(launch))
    cfg.validate()
    block_d = 1 << (head_dim - 1).bit_length()
    if cfg.EVEN_HD and not (head_dim == block_d and num_heads % cfg.BLOCK_H == 0):
        raise ValueError(
            f"launch: EVEN_HD needs head_dim == BLOCK_D and H % BLOCK_H == 0; got H={num_heads}, "
            f"head_dim={head_dim}, BLOCK_D={block_d}, BLOCK_H={cfg.BLOCK_H}"
        )
    return cfg


def _check_provenance(prov: Any) -> dict[str, Any]:
    if not isinstance(prov, dict):
        raise ValueError(f"'provenance' must be an object, got {type(prov).__name__}")
    unknown = sorted(set(prov) - set(_PROV_TYPES))
    if unknown:
        raise ValueError(f"provenance: unknown key(s) {unknown}; known: {list(_PROV_TYPES)}")
    for k, (types, required) in _PROV_TYPES.items():
        if k not in prov:
            if required:
                raise ValueError(f"provenance: missing key {k!r}")
            continue
        v = prov[k]
        if isinstance(v, bool) or not isinstance(v, types):
            names = "/".join("null" if t is type(None) else t.__name__ for t in types)
            raise ValueError(f"provenance: {k} must be {names}, got {v!r}")
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"provenance: {k} must be finite, got {v!r}")
    try:
        _dt.date.fromisoformat(prov["date"][:10])
    except ValueError:
        raise ValueError(
            f"provenance: date must be ISO (YYYY-MM-DD...), got {prov['date']!r}"
        ) from None
    if prov["time_ms"] is not None and prov["time_ms"] <= 0:
        raise ValueError(f"provenance: time_ms must be > 0 or null, got {prov['time_ms']!r}")
    return dict(prov)


def _check_kernel(obj: Any) -> KernelChoice:
    """The KernelChoice of an entry's ``kernel`` object; ValueError saying what is wrong.

    Only the form is checked here; whether the name is a registered kernel and its launch one
    that kernel accepts is :mod:`sparse_mla.dispatch`'s question (this module imports no kernel).
    """
    if not isinstance(obj, dict):
        raise ValueError(f"'kernel' must be an object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - {"name", "launch", "provenance", "tokens", "slots"})
    if unknown or "name" not in obj or "provenance" not in obj:
        raise ValueError(
            f"kernel: keys must be name, provenance (and launch, tokens, slots), got {list(obj)}"
        )
    tokens, slots = _bucket(obj, "tokens"), _bucket(obj, "slots")
    name = obj["name"]
    if not isinstance(name, str) or not _KERNEL_NAME_RE.match(name):
        raise ValueError(f"kernel: name must be an id like 'gluon', got {name!r}")
    launch = obj.get("launch")
    if launch is not None:
        if name == "triton":
            raise ValueError("kernel: Triton's launch is the entry's 'launch', not kernel.launch")
        if not isinstance(launch, dict) or not all(
            isinstance(k, str) and (v is None or type(v) in (int, bool)) for k, v in launch.items()
        ):
            raise ValueError(f"kernel: launch must map names to ints/bools/null, got {launch!r}")
    prov = obj["provenance"]
    if not isinstance(prov, dict):
        raise ValueError(f"kernel: provenance must be an object, got {type(prov).__name__}")
    unknown = sorted(set(prov) - set(_CHOICE_PROV_TYPES))
    if unknown:
        raise ValueError(f"kernel.provenance: unknown key(s) {unknown}")
    for k, (types, required) in _CHOICE_PROV_TYPES.items():
        if k not in prov:
            if required:
                raise ValueError(f"kernel.provenance: missing key {k!r}")
        elif not isinstance(prov[k], types):
            raise ValueError(f"kernel.provenance: {k} must be {types[0].__name__}, got {prov[k]!r}")
    times = prov["times_ms"]
    for k, v in times.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v < math.inf):
            raise ValueError(f"kernel.provenance: times_ms[{k!r}] must be > 0, got {v!r}")
    if name not in times:
        raise ValueError(f"kernel.provenance: times_ms must include the chosen kernel {name!r}")
    if times[name] > min(times.values()):
        fastest = min(times, key=times.get)
        raise ValueError(f"kernel: {name!r} is recorded but {fastest!r} was faster ({times})")
    try:
        _dt.date.fromisoformat(prov["date"][:10])
    except ValueError:
        raise ValueError(f"kernel.provenance: date must be ISO, got {prov['date']!r}") from None
    return KernelChoice(
        name, dict(launch) if launch is not None else None, dict(prov), tokens, slots
    )


def _bucket(obj: dict, key: str) -> tuple[int, int | None] | None:
    """A choice's ``tokens`` or ``slots`` bucket: [lo, hi] with 0 <= lo < hi (hi null: open)."""
    b = obj.get(key)
    if b is None:
        return None
    ok = (
        isinstance(b, list) and len(b) == 2 and _is_int(b[0]) and b[0] >= 0
        and (b[1] is None or (_is_int(b[1]) and b[1] > b[0]))
    )  # fmt: skip
    if not ok:
        raise ValueError(f"kernel: {key} must be [lo, hi] with 0 <= lo < hi (or hi null), "
                         f"got {b!r}")  # fmt: skip
    return (b[0], b[1])


def _check_tiling(edges: list, what: str) -> None:
    """Buckets that start at 0, end open (null) and follow each other: every value has one."""
    if edges[0][0] != 0 or edges[-1][1] is not None:
        raise ValueError(f"kernel: {what} buckets must start at 0 and end open (null), got {edges}")
    for (_, hi), (lo, _) in itertools.pairwise(edges):
        if hi != lo:
            raise ValueError(f"kernel: {what} buckets must follow each other, got {edges}")


def _check_kernels(obj: Any) -> tuple[KernelChoice, ...]:
    """An entry's ``kernel``: one choice for every T and list length, or a list of choices whose
    ``tokens`` buckets are sorted, do not overlap, start at 0 and end open (every T has one
    choice); several choices in a row with the same ``tokens`` split that bucket by ``slots``
    (slots per token), buckets that do the same (every list length has one choice)."""
    if not isinstance(obj, list):
        c = _check_kernel(obj)
        if c.slots is not None:
            raise ValueError("kernel: a single choice serves every list length (no 'slots')")
        return (c,)
    if not obj:
        raise ValueError("kernel: a list of choices must not be empty")
    choices = tuple(_check_kernel(o) for o in obj)
    if any(c.tokens is None for c in choices):
        raise ValueError("kernel: each choice of a list needs its 'tokens' bucket")
    groups = [list(g) for _, g in itertools.groupby(choices, key=lambda c: c.tokens)]
    _check_tiling([g[0].tokens for g in groups], "token")
    for g in groups:
        if len(g) == 1:
            if g[0].slots is not None:
                raise ValueError(f"kernel: T in {list(g[0].tokens)} has one choice, so no "
                                 f"'slots' (it serves every list length)")  # fmt: skip
            continue
        if any(c.slots is None for c in g):
            raise ValueError(f"kernel: the choices of T in {list(g[0].tokens)} each need 'slots'")
        _check_tiling([c.slots for c in g], f"T in {list(g[0].tokens)}: slots")
    return choices


def parse_entries(data: Any, arch: str, source: str = "<data>") -> dict[str, ConfigEntry]:
    """Validate a whole file's JSON object; ConfigFileError naming ``source`` on any problem."""
    if not isinstance(data, dict):
        raise ConfigFileError(f"{source}: top level must be an object keyed by shape")
    out = {}
    for key, entry in data.items():
        try:
            H, D = parse_shape_key(key)
            if not isinstance(entry, dict):
                raise ValueError(f"entry must be an object, got {type(entry).__name__}")
            unknown = sorted(set(entry) - set(_ENTRY_KEYS) - set(_OPTIONAL_ENTRY_KEYS))
            missing = [k for k in _ENTRY_KEYS if k not in entry]
            if unknown or missing:
                raise ValueError(
                    f"entry keys must be {list(_ENTRY_KEYS)} (and optionally "
                    f"{list(_OPTIONAL_ENTRY_KEYS)}), got {list(entry)}"
                )
            cfg = _check_launch(arch, H, D, entry["launch"])
            prov = _check_provenance(entry["provenance"])
            choices = _check_kernels(entry["kernel"]) if "kernel" in entry else ()
            for c in choices:
                _check_choice_launch(c, arch, H, D)
        except (TypeError, ValueError) as e:
            raise ConfigFileError(f"{source}: entry {key!r}: {e}") from None
        out[key] = ConfigEntry(H, D, cfg, prov, choices, source)
    return out


def _check_choice_launch(c: KernelChoice, arch: str, num_heads: int, head_dim: int) -> None:
    """A recorded kernel's own ``launch`` must be one its config class takes: known fields,
    ints as ints and flags as bools, values the kernel accepts (ValueError otherwise). The
    registry knows each kernel's config; a name it does not know is the dispatch's error."""
    if c.launch is None:
        return
    from . import dispatch  # at file check time: dispatch imports this module

    k = dispatch.KERNELS.get(c.name)
    if k is None:
        return
    try:
        cfg = k.resolve(dict(c.launch), dispatch.Call(arch, num_heads, head_dim))
    except (TypeError, ValueError) as e:
        raise ValueError(f"kernel {c.name!r}: launch {c.launch}: {e}") from None
    if is_dataclass(cfg):
        for f in fields(cfg):
            v = c.launch.get(f.name)
            text = f.type if isinstance(f.type, str) else repr(f.type)
            want = bool if "bool" in text else (int if "int" in text else None)
            if v is not None and want is not None and type(v) is not want:
                raise ValueError(
                    f"kernel {c.name!r}: launch {f.name} must be {want.__name__}, got {v!r}"
                )


def _arch_of(path: Path) -> str:
    # configs/<arch>/triton/attention/sparse_attention_dsv4/DEFAULT.json
    return path.parents[len(_OP_DIR.parts)].name


MAX_INT_DIGITS = 18  # any count or time a config holds fits; a longer integer is a broken file


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text.lstrip('-'))} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r} (JSON keeps the last one silently)")
        out[k] = v
    return out


def read_json(path: Path | str, text: str | None = None) -> Any:
    """A config file's JSON value (``text``: its contents, already read); ConfigFileError naming
    the file when it cannot be read (a dangling symlink, a loop, no permission), is not UTF-8,
    is not strict JSON (a duplicate key, an integer over 18 digits) or is nested too deeply."""
    path = Path(path)
    if text is None:
        _stamp(path, missing_ok=False)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigFileError(f"{path}: cannot be read ({e.strerror or e})") from None
        except UnicodeDecodeError as e:
            raise ConfigFileError(f"{path}: not a readable JSON file (not UTF-8: {e})") from None
    try:
        return json.loads(text, object_pairs_hook=_unique_keys, parse_int=_parse_int)
    except RecursionError:
        raise ConfigFileError(f"{path}: not a readable JSON file (nested too deeply)") from None
    except ValueError as e:  # JSONDecodeError, or a hook's refusal
        raise ConfigFileError(f"{path}: not a readable JSON file ({e})") from None


def _stamp(path: Path, *, missing_ok: bool = True) -> tuple[int, ...] | None:
    """The file's stat stamp (None: no file, when ``missing_ok``); ConfigFileError for a
    dangling symlink, a symlink loop or a path that cannot be looked at."""
    try:
        st = path.stat()
    except FileNotFoundError:
        if path.is_symlink():
            raise ConfigFileError(
                f"{path}: a dangling symlink (to {os.readlink(path)}, which does not exist)"
            ) from None
        if missing_ok:
            return None
        raise ConfigFileError(f"{path}: no such file") from None
    except OSError as e:  # ELOOP (a symlink loop), EACCES, ENOTDIR, ...
        raise ConfigFileError(f"{path}: cannot be read ({e.strerror or e})") from None
    return (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)


@functools.lru_cache(maxsize=64)
def _load(path: Path, stamp: tuple[int, ...]) -> dict[str, ConfigEntry]:
    # Keyed by the file's stat stamp: an export (a new inode via os.replace) is seen at once.
    return parse_entries(read_json(path), _arch_of(path), str(path))


def validate_file(path: Path | str, arch: str | None = None) -> dict[str, ConfigEntry]:
    """Read and validate one config file (arch taken from its path unless given)."""
    path = Path(path)
    return parse_entries(read_json(path), arch or _arch_of(path), str(path))


def validate_all(root: Path | str | None = None) -> dict[str, dict[str, ConfigEntry]]:
    """Validate every arch's DEFAULT.json under ``root`` (default: every root of :func:`roots`,
    merged as lookups merge them): {arch: {shape key: entry}}."""
    found: dict[str, dict[str, ConfigEntry]] = {}
    for r in reversed(roots()) if root is None else (Path(root),):
        # Every DEFAULT.json there, dangling symlinks and loops included (glob skips those).
        arch_dirs = sorted(Path(r).iterdir()) if Path(r).is_dir() else []
        for path in (d / _OP_DIR / "DEFAULT.json" for d in arch_dirs):
            if os.path.lexists(path):
                found.setdefault(_arch_of(path), {}).update(validate_file(path))
    return found


def entries(arch: str, root: Path | str | None = None) -> dict[str, ConfigEntry]:
    """All validated entries of ``arch`` ({} when no file has any): those of the file under
    ``root``, or without ``root`` those of every root of :func:`roots`, the first root's entry
    winning per shape (each entry's ``source`` names its file)."""
    if root is not None:
        paths = (config_path(arch, root),)
    else:
        paths = tuple(config_path(arch, r) for r in roots())
    found = [(p, s) for p in paths if (s := _stamp(p)) is not None]
    if len(found) == 1:
        return _load(*found[0])
    return _merged(tuple(found))


@functools.lru_cache(maxsize=64)
def _merged(found: tuple[tuple[Path, tuple[int, ...]], ...]) -> dict[str, ConfigEntry]:
    out: dict[str, ConfigEntry] = {}
    for path, stamp in reversed(found):
        out.update(_load(path, stamp))
    return out


def lookup_entry(
    arch: str | None, num_heads: int, head_dim: int, root: Path | str | None = None
) -> ConfigEntry | None:
    """The tuned entry (launch + provenance) for (arch, H, D), or None silently."""
    if arch is None:
        return None
    return entries(arch, root).get(shape_key(num_heads, head_dim))


def lookup(arch: str | None, num_heads: int, head_dim: int, root: Path | str | None = None):
    """The tuned PrefillConfig for (arch, H, D), or None (silently) when there is none.

    Exact shape match only: a shape that was not swept keeps the default launch. A file that
    exists but is broken raises ConfigFileError naming it.
    """
    found = lookup_entry(arch, num_heads, head_dim, root)
    return None if found is None else found.launch


def dump_entries(data: dict[str, Any]) -> str:
    """The canonical text of a config file: entries ordered by (H, D), 2-space JSON."""
    ordered = dict(sorted(data.items(), key=lambda kv: parse_shape_key(kv[0])))
    return json.dumps(ordered, indent=2) + "\n"
