"""Direct launches of compiled Triton/Gluon kernels: ``JITFunction.run`` once, its result after.

``kernel[grid](*args, **kwargs)`` does, on every call (Triton 3.6, ``triton/runtime/jit.py``):
bind the arguments (a generated ``dynamic_func``), specialise each one
(``native_specialize_impl``: a tensor's dtype and 16-byte alignment, an int's ``== 1`` / ``% 16``
/ width), build the cache key ``(tuple(specialization), str(options))`` (hashing every constexpr,
layouts included), look the compiled kernel up, check that each constexpr global the kernel read
is unchanged, and call ``CompiledKernel.run`` (the C launcher) with the grid, the current stream
and every bound argument. :class:`Launcher` does that once per key and, on a later call whose
key is the same, calls the same launcher with the same arguments: the launch is identical (same
compiled kernel, argument values, grid, stream), only the Python around it is gone.

The key (:meth:`Launcher._key`) is at least as fine as Triton's specialisation of these calls:

* the current device (Triton keeps one kernel cache per device) and Triton's ``debug`` and
  ``instrumentation_mode`` options, read as ``run`` reads them;
* the keyword arguments (the constexprs and launch options) by identity: a launch site passes a
  dict that a cache returns (:func:`frozen`, :func:`merged`), never mutated, and the entry keeps
  a reference to it, so its ``id`` names that dict and no other while the entry lives;
* per positional argument: a tensor (``type(a) is torch.Tensor``, on a backend whose tensor
  specialisation is the native one: NVIDIA) by ``(dtype, data_ptr % 16 == 0)``, which is what
  ``native_specialize_impl`` reads of it; a positional constexpr by its value; a
  :class:`TmaArg` by (dtype, block shape, layout, padding), what Triton's ``tensordesc<...>``
  type says; anything else (ints, floats, bools, None) by ``native_specialize_impl`` itself
  with the parameter's flags, the call Triton's binder makes.

It falls back to ``kernel[grid]`` (which compiles, checks and launches as always) when the key
is new, when :func:`set_enabled` turned it off, when a pre-run hook is set or a launch
enter/exit hook is more than Triton 3.6's default empty ``HookChain`` (Triton then builds launch
metadata for it), when a constexpr global the kernel read is not the same object as when it
compiled (Triton's own check then runs and raises), when a keyword argument names a runtime
parameter, when an argument cannot be keyed, and for a Gluon kernel whose TMA descriptors the
compiled launcher does not take as ``CUtensorMap`` (no ``tensordesc_meta``) or that needs
scratch memory. CUDA-graph capture works as with ``kernel[grid]``: the same launcher issues
the same driver call on the current stream.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
from typing import Any

import torch
from triton import knobs
from triton._C.libtriton import native_specialize_impl
from triton.knobs import HookChain
from triton.runtime import driver
from triton.runtime.jit import JITFunction

from . import runtime

__all__ = [
    "Launcher",
    "Replay",
    "Scratch",
    "TmaArg",
    "enabled",
    "frozen",
    "launcher",
    "merged",
    "recording",
    "set_enabled",
    "stats",
]

_ENABLED = [True]
_MISSING = object()
_NOT_FAST = object()  # an entry whose launches always take kernel[grid]
MAX_ENTRIES = 256  # per kernel; cleared when full (a call then takes kernel[grid] once more)
MAX_TMA_MAPS = 512
_STATS = {"fast": 0, "slow": 0}
# Bumped whenever a direct-launch entry is dropped or replaced (clear(), a full entry cache, a
# new entry for a key): a Replay made before is stale then.
_EPOCH = [0]
# (thread id, list) while recording() runs on that thread: each launch appends what it issued.
_RECORDING: list = [None]
_RECORDING_LOCK = threading.Lock()
# Replay passes a tensor argument as its address (an int) when on: Triton's C launcher then takes
# the int as is, where for a tensor it calls ``data_ptr()`` and asks the driver whether the
# address is a device pointer (``cuPointerGetAttribute``, one driver call per tensor argument and
# launch). A replay's tensors are keyed on their device (:mod:`sparse_mla.op`), so that check
# cannot fail there. Off: the tensors themselves (what the recorded call passed; for measuring).
_POINTER_INTS = [True]


def enabled() -> bool:
    """Whether launches take the direct path after their first (default: yes)."""
    return _ENABLED[0]


def set_enabled(flag: bool) -> bool:
    """Turn the direct path on or off (off: every launch is ``kernel[grid](...)``); returns the
    previous setting. For measuring the path against Triton's and for ruling it out."""
    prev, _ENABLED[0] = _ENABLED[0], bool(flag)
    return prev


@contextlib.contextmanager
def disabled():
    prev = set_enabled(False)
    try:
        yield
    finally:
        set_enabled(prev)


def stats() -> dict[str, int]:
    """Launches so far that took the direct path (``fast``) and ``kernel[grid]`` (``slow``)."""
    return dict(_STATS)


# ----------------------------------------------------------------------------------------------
# Keyword dicts with a stable identity
# ----------------------------------------------------------------------------------------------

_FROZEN: dict[tuple, dict] = {}
_MERGED: dict[tuple, tuple[dict, dict]] = {}


def frozen(**kwargs) -> dict[str, Any]:
    """``kwargs`` as a dict shared by every call with equal (hashable) values: the keyword
    arguments of a launch, passed to :meth:`Launcher.__call__`. Never change it."""
    key = tuple(kwargs.items())
    d = _FROZEN.get(key)
    if d is None:
        if len(_FROZEN) >= 4096:
            _FROZEN.clear()
        d = _FROZEN[key] = kwargs
    return d


def merged(base: dict[str, Any], **extra) -> dict[str, Any]:
    """``{**base, **extra}`` shared by every call with the same ``base`` dict object (one a
    cache returned: compared by identity, its values may be unhashable layouts) and equal
    ``extra``. The cache keeps ``base`` alive, so its ``id`` is never reused while cached."""
    key = (id(base), tuple(extra.items()))
    hit = _MERGED.get(key)
    if hit is None or hit[0] is not base:
        if len(_MERGED) >= 4096:
            _MERGED.clear()
        hit = _MERGED[key] = (base, {**base, **extra})
    return hit[1]


# ----------------------------------------------------------------------------------------------
# TMA descriptors
# ----------------------------------------------------------------------------------------------


class TmaArg:
    """A Gluon TMA descriptor argument, not built yet: ``tensor`` (its shape and strides are the
    descriptor's), ``block_shape`` and ``layout`` (an ``NVMMASharedLayout``). ``kernel[grid]``
    gets :meth:`descriptor` (a ``TensorDescriptor``); the direct path gets the encoded
    ``CUtensorMap`` from :func:`_tma_map`, which caches the encoding, never the tensor."""

    __slots__ = ("block_shape", "layout", "padding", "tensor")

    def __init__(self, tensor: torch.Tensor, block_shape: tuple, layout, padding: str = "zero"):
        self.tensor = tensor
        self.block_shape = tuple(block_shape)
        self.layout = layout
        self.padding = padding

    def descriptor(self):
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        t = self.tensor
        return TensorDescriptor(
            t, list(t.shape), list(t.stride()), list(self.block_shape), self.layout, self.padding
        )


def jit_args(args) -> list:
    """A launch's arguments as ``kernel[grid]`` (or its ``warmup``) takes them: each
    :class:`TmaArg` built into its ``TensorDescriptor``."""
    return [a.descriptor() if type(a) is TmaArg else a for a in args]


# (meta, data_ptr, shape, strides, padding) -> the launcher's arguments for one descriptor:
# (CUtensorMap, *shape, *strides). A PyCUtensorMap is 128 bytes of encoded descriptor that
# holds no reference to the tensor (triton/backends/nvidia/driver.c): the cache keeps nothing
# alive, and an entry whose memory was freed and reused at the same address with the same
# shape and strides encodes the very same bytes. cuLaunchKernel copies parameters at launch
# (and a graph node at capture), so sharing one map between launches is safe.
_TMA_MAPS: dict[tuple, tuple] = {}


def _tma_map(arg: TmaArg, meta: dict, meta_key: tuple, encode) -> tuple:
    t = arg.tensor
    key = (meta_key, t.data_ptr(), t.shape, t.stride(), arg.padding)
    hit = _TMA_MAPS.get(key)
    if hit is None:
        # A miss builds the real TensorDescriptor: its checks (alignment, strides, block) run
        # for every new (address, shape, strides), and the encoding is Triton's own.
        hit = tuple(encode(arg.descriptor(), meta))
        if len(_TMA_MAPS) >= MAX_TMA_MAPS:
            _TMA_MAPS.clear()
        _TMA_MAPS[key] = hit
    return hit


def _tma_map_of(t, block_shape, layout, padding, meta, meta_key, encode) -> tuple:
    """:func:`_tma_map` of ``TmaArg(t, block_shape, layout, padding)``, the TmaArg made only on
    a miss (a :class:`Replay`'s descriptors)."""
    hit = _TMA_MAPS.get((meta_key, t.data_ptr(), t.shape, t.stride(), padding))
    if hit is None:
        hit = _tma_map(TmaArg(t, block_shape, layout, padding), meta, meta_key, encode)
    return hit


def _raw_launch(run):
    """The C launch under Triton's ``CudaLauncher`` ``run`` when ``run(...)`` is exactly a call
    of it: a ``CudaLauncher`` (its ``__call__`` Triton's own) whose kernel needs no global or
    profile scratch (``__call__`` then passes None for both and adds nothing else); else None."""
    from triton.backends.nvidia.driver import CudaLauncher

    if type(run).__call__ is not CudaLauncher.__call__:
        return None
    if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return None
    return getattr(run, "launch", None)


def _tma_slot(cache, t, block_shape, layout, padding, meta, meta_key, encode) -> tuple:
    """:func:`_tma_map_of`, kept in ``cache`` by ``t``'s address: a :class:`Replay`'s
    descriptor argument, whose tensor's dtype, shape and strides (and the block, layout,
    padding and meta) are the same every replay, so the encoding is a function of the address
    alone (at most 64 addresses a slot)."""
    hit = _tma_map_of(t, block_shape, layout, padding, meta, meta_key, encode)
    if len(cache) >= 64:
        cache.clear()
    cache[t.data_ptr()] = hit
    return hit


def _nvidia_encoder():
    from triton.backends.nvidia.driver import make_tensordesc_arg

    return make_tensordesc_arg


# ----------------------------------------------------------------------------------------------
# The launcher
# ----------------------------------------------------------------------------------------------


class _Entry:
    __slots__ = ("function", "globals", "kwargs", "packed", "raw", "refs", "run", "tail", "tma")


class Launcher:
    """Launches of one ``@triton.jit`` / ``@gluon.jit`` kernel: ``launcher(grid, args,
    kwargs)`` is ``kernel[grid](*args, **kwargs)`` (``TmaArg`` arguments become their
    ``TensorDescriptor``), taken directly after the first launch of a key (module docstring).
    ``kwargs`` must be a dict from :func:`frozen` or :func:`merged` (or another cache), never
    changed after."""

    def __init__(self, fn, *, encode_tma=None):
        self.fn = fn
        self._entries: dict[tuple, Any] = {}
        self._encode_tma = encode_tma
        # Not a JITFunction (a test's stand-in with only kernel[grid]): always kernel[grid].
        self._plain = not hasattr(fn, "params")
        params = getattr(fn, "params", ())
        self._flags = tuple(
            (p.is_constexpr, p.is_const, not p.do_not_specialize,
             not p.do_not_specialize_on_alignment)
            for p in params
        )  # fmt: skip
        self._gen: dict[Any, Any] = {}  # backend -> the generated key of the first call's types

    # -- the key -------------------------------------------------------------------------------

    def _generate_key(self, args, backend):
        """:meth:`_key` as straight-line code for arguments of these types (a launch site passes
        the same types every call): the same tuple, without the loop. It returns None when an
        argument's type is not the one it was made for (then :meth:`_key` runs)."""
        n = len(args)
        if not 0 < n <= len(self._flags):
            return None
        guards, parts = [], []
        shortcut = backend.supports_native_tensor_specialization
        for i, (a, (is_cx, is_const, spec, align)) in enumerate(
            zip(args, self._flags, strict=False)
        ):
            t = type(a)
            if is_cx:
                return None  # a positional constexpr (none here): :meth:`_key` checks its hash
            if t is torch.Tensor and shortcut:
                guards.append(f"type(a{i}) is not _T")
                parts.append(f"(a{i}.dtype, not a{i}.data_ptr() & 15)")
            elif t is TmaArg:
                guards.append(f"type(a{i}) is not _TMA")
                parts.append(f"(_TMA, a{i}.tensor.dtype, a{i}.block_shape, _id(a{i}.layout), "
                             f"a{i}.padding)")  # fmt: skip
            else:
                parts.append(f"_ns(_B, a{i}, {is_const}, {spec}, {align})")
        names = ", ".join(f"a{i}" for i in range(n))
        src = (
            f"def key(args):\n"
            f"    if len(args) != {n}:\n        return None\n"
            f"    {names}, = args\n"
            + (f"    if {' or '.join(guards)}:\n        return None\n" if guards else "")
            + f"    try:\n        return ({', '.join(parts)},)\n"
            f"    except Exception:\n        return None\n"
        )
        ns = {"_T": torch.Tensor, "_TMA": TmaArg, "_id": id, "_ns": native_specialize_impl,
              "_B": backend}  # fmt: skip
        exec(src, ns)  # code built above from this kernel's parameter flags only
        return ns["key"]

    def _key(self, args, native, backend) -> tuple | None:
        """Each positional argument's part of the key (module docstring); None: not keyable."""
        flags = self._flags
        if len(args) > len(flags):
            return None
        tensor_shortcut = backend.supports_native_tensor_specialization
        out = []
        for a, (is_cx, is_const, spec, align) in zip(args, flags, strict=False):
            t = type(a)
            if is_cx:
                try:
                    hash(a)
                except TypeError:
                    return None
                out.append(("cx", t, a))
            elif t is torch.Tensor and tensor_shortcut:
                out.append((a.dtype, not a.data_ptr() & 15))
            elif t is TmaArg:
                out.append((TmaArg, a.tensor.dtype, a.block_shape, id(a.layout), a.padding))
            else:
                try:
                    out.append(native(backend, a, is_const, spec, align))
                except Exception:  # what the binder would raise on, it raises in kernel[grid]
                    return None
        return tuple(out)

    # -- the calls -----------------------------------------------------------------------------

    def __call__(self, grid, args: tuple, kwargs: dict):
        fn = self.fn
        if not _ENABLED[0] or self._plain or fn.pre_run_hooks or type(grid) is not tuple:
            return self._slow(grid, args, kwargs, None)
        rt = knobs.runtime
        if not (_no_hook(rt.launch_enter_hook) and _no_hook(rt.launch_exit_hook)):
            return self._slow(grid, args, kwargs, None)
        drv = driver.active
        device = drv.get_current_device()
        backend = fn.device_caches[device][3]  # run()'s (kernel_cache, ..., backend, binder)
        gen = self._gen.get(backend)
        if gen is None:
            gen = self._gen[backend] = self._generate_key(args, backend) or _no_key
        spec = gen(args)
        if spec is None:
            spec = self._key(args, native_specialize_impl, backend)
        if spec is None:
            return self._slow(grid, args, kwargs, None)
        key = (device, id(kwargs), fn.debug or rt.debug,
               knobs.compilation.instrumentation_mode, spec)  # fmt: skip
        e = self._entries.get(key)
        if e is None:
            return self._slow(grid, args, kwargs, key)
        if e is _NOT_FAST or e.kwargs is not kwargs:
            return self._slow(grid, args, kwargs, None)
        for g, name, val in e.globals:
            if g.get(name, _MISSING) is not val:  # rebound: Triton's check runs, then a new entry
                return self._slow(grid, args, kwargs, key)
        stream = drv.get_current_stream(device)
        n = len(grid)
        g0, g1, g2 = grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1
        _STATS["fast"] += 1
        rec = _RECORDING[0]
        if rec is not None and rec[0] == threading.get_ident():
            rec[1].append((self, e, key, (g0, g1, g2), args))
        if e.tma is None:
            e.run(g0, g1, g2, stream, e.function, e.packed, None, None, None, *args, *e.tail)
            return None
        metas, encode, coop, pdl = e.tma
        flat = []
        i = 0
        for a in args:
            if type(a) is TmaArg:
                meta, meta_key = metas[i]
                i += 1
                flat.extend(_tma_map(a, meta, meta_key, encode))
            else:
                flat.append(a)
        # CudaLauncher.__call__ with no scratch, then the launcher under wrap_handle_tensordesc.
        e.raw(g0, g1, g2, stream, e.function, coop, pdl, None, None, e.packed, None, None, None,
              *flat, *e.tail)  # fmt: skip
        return None

    def _slow(self, grid, args, kwargs, key):
        """``kernel[grid]``; with a key, keep what it resolved for the direct path."""
        _STATS["slow"] += 1
        rec = _RECORDING[0]
        if rec is not None and rec[0] == threading.get_ident():
            rec[1].append(None)  # not a direct launch: a recording with it is not replayable
        targs = jit_args(args)
        with runtime.compiling():  # it may compile: not while another thread interprets
            kernel = self.fn[grid](*targs, **kwargs)
        if key is None or kernel is None or not _ENABLED[0]:
            return kernel
        if hasattr(kernel, "result"):  # an async compile's future
            kernel = kernel.result()
        entry = self._entry(kernel, args, kwargs)
        if entry is None:
            self._entries.pop(key, None)
            _EPOCH[0] += 1
            return kernel
        if len(self._entries) >= MAX_ENTRIES:
            self._entries.clear()
        self._entries[key] = entry
        _EPOCH[0] += 1
        return kernel

    def _entry(self, kernel, args, kwargs):
        params = self.fn.params
        tail = []
        for p in params[len(args) :]:
            if not p.is_constexpr:
                return _NOT_FAST  # a runtime argument by keyword or default: kernel[grid] keys it
            if p.name in kwargs:
                tail.append(kwargs[p.name])
            elif p.default is not inspect.Parameter.empty:
                tail.append(p.default)
            else:
                return _NOT_FAST
        e = _Entry()
        e.run = kernel.run  # the launcher (loads the binary if kernel[grid] did not)
        e.function = kernel.function
        e.packed = kernel.packed_metadata
        e.tail = tuple(tail)
        e.kwargs = kwargs
        # Triton keeps a copy of each constexpr global the kernel read and compares it (!=) with
        # the global on every run; that check just passed, so the objects the globals hold now
        # pass it as long as they stay the same objects (checked by identity per call).
        glob = []
        for (name, _), (val, g) in self.fn.used_global_vals.items():
            cur = g.get(name, _MISSING)
            if cur is _MISSING or cur != val:
                return None  # not kept: a later call tries again
            glob.append((g, name, cur))
        e.globals = tuple(glob)
        e.refs = tuple(a.layout for a in args if type(a) is TmaArg)  # ids in the key stay valid
        e.tma = None
        e.raw = None
        if e.refs:
            tma = self._tma_launch(kernel, e.run, sum(1 for a in args if type(a) is TmaArg))
            if tma is None:
                return _NOT_FAST
            e.raw, e.tma = tma
        return e

    def _tma_launch(self, kernel, run, count):
        """(the launcher under Triton's descriptor wrapper, (per-descriptor meta, encoder,
        cooperative, pdl)) for a kernel with TMA descriptor arguments; None when it does not
        take them as CUtensorMap or needs scratch memory (kernel[grid] then runs it)."""
        metas = getattr(kernel.metadata, "tensordesc_meta", None)
        if not metas or len(metas) != count or not all(isinstance(m, dict) for m in metas):
            return None  # (a None meta: the launcher takes that descriptor decomposed)
        if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
            return None
        wrapped = getattr(run, "launch", None)
        code = getattr(wrapped, "__code__", None)
        if code is None or not wrapped.__closure__ or "launcher" not in code.co_freevars:
            return None
        raw = wrapped.__closure__[code.co_freevars.index("launcher")].cell_contents
        encode = self._encode_tma or _nvidia_encoder()
        keyed = tuple((m, tuple(sorted((k, _hashable(v)) for k, v in m.items()))) for m in metas)
        return raw, (keyed, encode, run.launch_cooperative_grid, run.launch_pdl)


# ----------------------------------------------------------------------------------------------
# Replays: the direct launches of one call, re-issued for a later call with other tensors
# ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def recording():
    """Record the launches this thread makes inside the block: yields a list that gets, per
    launch, ``(launcher, entry, key, grid, args)`` for a direct launch and None for one that
    took ``kernel[grid]`` (:func:`Replay.build` refuses a recording with a None). One thread
    records at a time: while another does, this yields None and records nothing."""
    me = threading.get_ident()
    if not _RECORDING_LOCK.acquire(blocking=False):
        rec = _RECORDING[0]
        if rec is not None and rec[0] == me:
            raise RuntimeError("fastlaunch.recording() does not nest")
        yield None
        return
    got: list = []
    run = JITFunction.run

    def marked_run(self, *args, **kwargs):
        # Any Triton launch of this thread that is not a direct one (kernel[grid] from
        # anywhere, the runtime.launch of another path): the recording is not replayable.
        if threading.get_ident() == me:
            got.append(None)
        return run(self, *args, **kwargs)

    _RECORDING[0] = (me, got)
    JITFunction.run = marked_run
    try:
        yield got
    finally:
        JITFunction.run = run
        _RECORDING[0] = None
        _RECORDING_LOCK.release()


class Replay:
    """The direct launches one call made (:func:`recording`), as one function of the next
    call's tensors: ``replay(inputs, scratch)`` issues the same launches (same compiled
    kernels, grids, keyword dicts, scalar arguments, constant tensors) with each argument that
    was ``inputs[i]`` (or ``scratch[j]``, a tensor the call allocated) taken from this call's,
    a tensor handed to the launcher as its address (:data:`_POINTER_INTS`).

    What makes that the launch the call itself would make is the caller's to guarantee (here:
    :mod:`sparse_mla.op`, which keys a replay on everything its kernels read but the tensors'
    addresses, and builds one only from a call that ran no torch op but ``torch.empty``). This
    class re-checks, per call (:meth:`valid`), what Launcher's direct path checks per launch:
    the direct path on, the launcher still the kernel's, its entry not dropped or replaced
    (:data:`_EPOCH`), the active driver and current device, no pre-run or launch hook,
    ``debug`` / ``instrumentation_mode`` as when recorded, every constexpr global the same
    object. Alignment of the input tensors is the caller's key (``data_ptr() % 16``), as the
    direct path's is; so are their dtypes, shapes and strides, on which a TMA descriptor
    argument's encoding is kept by address alone (:func:`_tma_slot`)."""

    __slots__ = ("_check", "_fire", "checks", "device", "driver", "epoch", "launches", "options")

    @classmethod
    def build(
        cls, recorded: list, inputs: tuple, n_scratch: int = 0, scratch: dict | None = None
    ) -> Replay | None:
        """A Replay of ``recorded`` (a :func:`recording`'s list), or None when it cannot be one:
        a launch that took ``kernel[grid]``, an input passed twice (object identity decides
        which input an argument is), a TMA kernel without its entry's encoding. ``scratch``:
        ``id(tensor) -> j`` for tensors the call allocated (``n_scratch`` of them; a replay
        gets ``scratch[j]`` from its caller, made anew)."""
        if any(r is None for r in recorded):
            return None
        ids = [id(t) for t in inputs if t is not None]
        if len(ids) != len(set(ids)) or set(ids) & set(scratch or {}):
            return None
        slot = {id(t): f"i{k}" for k, t in enumerate(inputs) if t is not None}
        slot.update({i: f"s{j}" for i, j in (scratch or {}).items()})
        ns: dict[str, Any] = {"_tma": _tma_slot}
        ints = _POINTER_INTS[0]
        body = []
        checks = []
        keys = set()
        for n, (lau, e, key, grid, args) in enumerate(recorded):
            device, _, debug, instr, _ = key
            keys.add((device, instr))
            checks.append((lau, e, debug))
            ns[f"run{n}"], ns[f"fn{n}"], ns[f"pk{n}"] = e.run, e.function, e.packed
            ns[f"tail{n}"] = e.tail
            parts = []
            tma_i = 0
            for j, a in enumerate(args):
                if type(a) is TmaArg:
                    if e.tma is None:
                        return None
                    metas, encode, _, _ = e.tma
                    meta, meta_key = metas[tma_i]
                    tma_i += 1
                    name = f"t{n}_{j}"
                    ns[name] = (a.block_shape, a.layout, a.padding, meta, meta_key, encode)
                    src = slot.get(id(a.tensor))
                    if src is None:
                        ns[f"c{n}_{j}"] = a.tensor
                        src = f"c{n}_{j}"
                    # the map by address alone: the rest of its key is fixed per slot here
                    ns[f"m{n}_{j}"] = {}
                    parts.append(f"*(m{n}_{j}.get({src}.data_ptr()) or _tma(m{n}_{j}, {src}, "
                                 f"*{name}))")  # fmt: skip
                elif isinstance(a, torch.Tensor) and id(a) in slot:
                    parts.append(f"{slot[id(a)]}.data_ptr()" if ints else slot[id(a)])
                elif isinstance(a, torch.Tensor) and ints:  # a tensor the call did not make
                    ns[f"k{n}_{j}"] = a  # (a cached dummy): kept alive with the replay
                    ns[f"c{n}_{j}"] = a.data_ptr()
                    parts.append(f"c{n}_{j}")
                else:  # a scalar, None, or a tensor the call did not make (a cached dummy)
                    ns[f"c{n}_{j}"] = a
                    parts.append(f"c{n}_{j}")
            g = ", ".join(str(int(x)) for x in grid)
            raw = _raw_launch(e.run) if e.tma is None else None
            if raw is not None:  # CudaLauncher.__call__ without scratch, inlined (as for TMA)
                ns[f"raw{n}"] = raw
                ns[f"coop{n}"] = e.run.launch_cooperative_grid
                ns[f"pdl{n}"] = e.run.launch_pdl
                body.append(f"    raw{n}({g}, stream, fn{n}, coop{n}, pdl{n}, None, None, pk{n}, "
                            f"None, None, None, {', '.join(parts)}, *tail{n})")  # fmt: skip
            elif e.tma is None:
                body.append(f"    run{n}({g}, stream, fn{n}, pk{n}, None, None, None, "
                            f"{', '.join(parts)}, *tail{n})")  # fmt: skip
            else:
                ns[f"raw{n}"] = e.raw
                _, _, coop, pdl = e.tma
                ns[f"coop{n}"], ns[f"pdl{n}"] = coop, pdl
                body.append(f"    raw{n}({g}, stream, fn{n}, coop{n}, pdl{n}, None, None, pk{n}, "
                            f"None, None, None, {', '.join(parts)}, *tail{n})")  # fmt: skip
        if len(keys) > 1:
            return None
        names = [f"i{k}" for k in range(len(inputs))] + [f"s{k}" for k in range(n_scratch)]
        src = f"def fire(stream, {', '.join(names) or '_'}):\n" + "\n".join(body or ["    pass"])
        exec(src, ns)  # code built above from the recorded launches only
        self = cls()
        self._fire = ns["fire"]
        self.launches = len(recorded)
        self.checks = tuple(checks)
        (self.device, self.options) = next(iter(keys)) if keys else (None, None)
        self.driver = driver.active if recorded else None
        self.epoch = _EPOCH[0]
        self._check = self._valid_fn()
        return self

    def _valid_fn(self):
        """:meth:`_valid` as straight-line code for these launches (the same tests in the same
        order, each launch's and each constexpr global's unrolled), what :meth:`valid` calls."""
        if not self.launches:
            return _always
        # the module's state read through the module, as _valid reads its globals
        ns: dict[str, Any] = {"_fl": sys.modules[__name__], "_HC": HookChain, "_M": _MISSING,
                              "drv": self.driver, "epoch": self.epoch, "opts": self.options,
                              "dev": self.device}  # fmt: skip
        conds = []
        for n, (lau, e, dbg) in enumerate(self.checks):
            ns[f"fn{n}"], ns[f"lau{n}"], ns[f"id{n}"], ns[f"dbg{n}"] = lau.fn, lau, id(lau.fn), dbg
            conds.append(f"fn{n}.pre_run_hooks or (fn{n}.debug or debug) != dbg{n} "
                         f"or _fl._LAUNCHERS.get(id{n}) is not lau{n}")  # fmt: skip
            for k, (g, name, val) in enumerate(e.globals):
                ns[f"g{n}_{k}"], ns[f"v{n}_{k}"] = g, val
                conds.append(f"g{n}_{k}.get({name!r}, _M) is not v{n}_{k}")
        src = "\n".join([
            "def valid():",
            "    if not _fl._ENABLED[0] or _fl._EPOCH[0] != epoch or _fl.driver.active is not drv:",
            "        return False",
            "    rt = _fl.knobs.runtime",
            "    h = rt.launch_enter_hook",
            "    if h is not None and (type(h) is not _HC or h.calls):",
            "        return False",
            "    h = rt.launch_exit_hook",
            "    if h is not None and (type(h) is not _HC or h.calls):",
            "        return False",
            "    if _fl.knobs.compilation.instrumentation_mode != opts:",
            "        return False",
            "    if drv.get_current_device() != dev:",
            "        return False",
            "    debug = rt.debug",
            *(f"    if {c}:\n        return False" for c in conds),
            "    return True",
        ])  # fmt: skip
        exec(src, ns)  # code built above from the recorded launches only
        return ns["valid"]

    def valid(self) -> bool:
        """Whether the recorded launches are still what Launcher's direct path would issue
        (class docstring); False: take the call's own path (which may record anew)."""
        return self._check()

    def _valid(self) -> bool:
        """:meth:`valid` as a loop (the reference the generated one unrolls)."""
        if not self.launches:
            return True
        if not _ENABLED[0] or _EPOCH[0] != self.epoch or driver.active is not self.driver:
            return False
        rt = knobs.runtime
        if not (_no_hook(rt.launch_enter_hook) and _no_hook(rt.launch_exit_hook)):
            return False
        if knobs.compilation.instrumentation_mode != self.options:
            return False
        if self.driver.get_current_device() != self.device:
            return False
        debug = rt.debug
        for lau, e, dbg in self.checks:
            fn = lau.fn
            if fn.pre_run_hooks or (fn.debug or debug) != dbg or _LAUNCHERS.get(id(fn)) is not lau:
                return False
            for g, name, val in e.globals:
                if g.get(name, _MISSING) is not val:
                    return False
        return True

    def __call__(self, inputs: tuple, scratch: tuple | Scratch = ()) -> None:
        """Issue the launches on the current stream (call :meth:`valid` first). ``scratch``:
        the tensors themselves, or a :class:`Scratch` that lends them for this stream."""
        if self.launches:
            _STATS["fast"] += self.launches
            stream = self.driver.get_current_stream(self.device)
            if type(scratch) is not Scratch:
                self._fire(stream, *inputs, *scratch)
                return
            key, bufs = scratch.take(stream)
            self._fire(stream, *inputs, *bufs)
            if key is not None:
                scratch.keep(key, bufs)


# Scratch tensors lent to replays: (layout of the set, stream, thread) -> the tensors, kept
# between replays (a few sets, a bounded number of bytes; see Scratch).
_SCRATCH: dict[tuple, tuple] = {}
_SCRATCH_SETS = 8
_SCRATCH_BYTES = 256 << 20
_SCRATCH_HELD = [0]


def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


class Scratch:
    """The scratch tensors a replay's launches use (``makers``: what the recorded call made
    with ``torch.empty``, e.g. the KV splits' fp32 partials), lent to each replay instead of
    made anew: a set is kept after a replay and the next replay with the same (set layout,
    current stream, thread) takes it; any other call makes its own (``torch.empty``, the
    caching allocator, as before). A tensor the call made with :func:`zeroed` is made with
    ``torch.zeros`` in a new set and lent as it is from a kept one: the launches that use it
    leave it zero.

    Why reuse is safe: the launches that write and read a set are issued in order on one
    stream by one thread, and a set goes back only after the replay issued them all, so the
    next replay's launches that touch it are queued behind them on that same stream (stream
    order, what the caching allocator relies on when it hands a freed block to the next
    allocation of its stream). Another stream or thread never gets it (a set made on stream
    A is only ever used on A: the allocator's rule too). Nothing made during a CUDA-graph
    capture is kept (its memory is the graph's), nor lent to one (a graph would keep using a
    set that later eager replays write). Kept: at most ``_SCRATCH_SETS`` sets and
    ``_SCRATCH_BYTES`` bytes in all (past either, every kept set is dropped, back to the
    allocator)."""

    __slots__ = ("cuda", "key", "makers", "nbytes")

    def __init__(self, makers: tuple, key: tuple, nbytes: int, cuda: bool):
        self.makers = makers  # callables, each making one tensor (torch.empty or torch.zeros)
        self.key = key  # hashable: the set's sizes, dtypes and devices
        self.nbytes = nbytes
        self.cuda = cuda

    def take(self, stream) -> tuple[tuple | None, tuple]:
        """(key, tensors) for a replay on ``stream``: the set kept for (this layout, stream,
        thread), else new tensors; key None: inside a graph capture (never kept)."""
        if self.cuda and _capturing():
            return None, tuple(f() for f in self.makers)
        key = (self.key, stream, threading.get_ident())
        bufs = _SCRATCH.pop(key, None)
        if bufs is None:
            return key, tuple(f() for f in self.makers)
        _SCRATCH_HELD[0] -= self.nbytes
        return key, bufs

    def keep(self, key: tuple, bufs: tuple) -> None:
        """Keep ``bufs`` for the next replay of ``key`` (after the launches that use them were
        issued)."""
        if self.nbytes > _SCRATCH_BYTES:
            return
        if len(_SCRATCH) >= _SCRATCH_SETS or _SCRATCH_HELD[0] + self.nbytes > _SCRATCH_BYTES:
            clear_scratch()
        _SCRATCH[key] = bufs
        _SCRATCH_HELD[0] += self.nbytes


# The thread making a zeroed scratch tensor (zeroed), else None: what a recording's op watcher
# (sparse_mla.op) checks to take a torch.zeros as scratch that stays zero at rest.
_ZEROING: list = [None]


def zeroed(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros(n)`` for scratch that every launch using it leaves zero again (zero at
    rest, e.g. the fused split reduce's arrival counters, which the last arrival resets). A
    recorded call may make it (:class:`Scratch` then makes a new set with ``torch.zeros`` and
    lends a kept set as it is); any other ``torch.zeros`` in a recorded call makes it not
    replayable (its tensor may be left non-zero)."""
    _ZEROING[0] = threading.get_ident()
    try:
        return torch.zeros(n, dtype=dtype, device=device)
    finally:
        _ZEROING[0] = None


def zeroing() -> bool:
    """Whether this thread is inside :func:`zeroed`."""
    return _ZEROING[0] == threading.get_ident()


def clear_scratch() -> None:
    """Drop every kept scratch set (:class:`Scratch`): its memory goes back to torch's
    caching allocator."""
    _SCRATCH.clear()
    _SCRATCH_HELD[0] = 0


def _no_key(args):
    return None


def _always() -> bool:
    return True


def _no_hook(h) -> bool:
    """Whether a launch hook does nothing: None, or Triton 3.6's default, an empty HookChain
    (``kernel[grid]`` then builds launch metadata and the C launcher calls both chains, which
    call nothing; the direct path passes None for the three, the same driver call)."""
    return h is None or (type(h) is HookChain and not h.calls)


def _hashable(v):
    return tuple(v) if isinstance(v, list) else v


# id(kernel) -> its Launcher, which holds the kernel (so the id stays its own). Not keyed by the
# kernel: a JITFunction hashes its source hash string (~3 us a lookup).
_LAUNCHERS: dict[int, Launcher] = {}


def clear() -> None:
    """Forget every direct-launch entry: each key's next call goes through ``kernel[grid]``
    again (for tests that count which path a call took: entries are per process)."""
    for lau in _LAUNCHERS.values():
        lau._entries.clear()
        lau._gen.clear()
    _EPOCH[0] += 1


def launcher(fn) -> Launcher:
    """The :class:`Launcher` of kernel ``fn`` (one per kernel)."""
    lau = _LAUNCHERS.get(id(fn))
    if lau is None or lau.fn is not fn:
        lau = _LAUNCHERS[id(fn)] = Launcher(fn)
    return lau
