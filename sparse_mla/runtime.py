"""Where a kernel runs: hardware queries and Triton's CPU interpreter.

Hardware questions are tiny cached functions so tests can fake them. Nothing here reads the
environment or touches a GPU at import.

The interpreter shim
--------------------
Triton decides interpreter-or-compiler once, when ``@triton.jit`` decorates a function, from
``TRITON_INTERPRET`` at import time. A workbook wants both in one process: run a kernel on CPU
tensors (numerics) *and* cross-compile the same kernel for gfx950 or sm90 (ISA, registers).
So the package keeps its kernels as ordinary ``JITFunction`` objects (compilable) and, for a
launch on CPU tensors, wraps them in Triton's ``InterpretedFunction``. Device functions called
from an interpreted kernel (our helpers and ``tl.zeros``, ``tl.max`` and friends from
``triton.language.standard``) are ``JITFunction`` objects too, whose ``__call__`` refuses to run
outside a compiled kernel; during an interpreted launch :func:`interpreting` routes those calls
to the interpreter, and restores everything afterwards so later compiles are unaffected.

During an interpreted launch the shim also mends one numpy incompatibility of Triton 3.6's
interpreter: it turns a tensor into a Python int (``range`` over a runtime bound such as a
slot count loaded through a pointer) with ``int(array)`` on a 1-element array of rank 1, which
numpy 2.3 and later refuse. The shim takes the element instead, so the CPU path works with any
numpy the installed torch accepts.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
import triton
from triton.runtime import interpreter as _interpreter
from triton.runtime.interpreter import InterpretedFunction, _patch_lang
from triton.runtime.jit import JITFunction

__all__ = [
    "arch",
    "compiling",
    "device_name",
    "has_gpu",
    "interpreted",
    "interpreting",
    "is_amd",
    "runs_interpreted",
]


@functools.cache
def has_gpu() -> bool:
    """True when torch sees a CUDA or ROCm device."""
    return torch.cuda.is_available()


@functools.cache
def is_amd() -> bool:
    """True when the GPU torch sees is an AMD one (ROCm build of torch)."""
    return has_gpu() and torch.version.hip is not None


@functools.cache
def arch(device_index: int = 0) -> str | None:
    """Architecture id of the local GPU: ``"sm90"``, ``"gfx942"``, ...; None without a GPU."""
    if not has_gpu():
        return None
    if is_amd():
        name = torch.cuda.get_device_properties(device_index).gcnArchName
        return name.split(":")[0]
    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm{major}{minor}"


@functools.cache
def device_name(device_index: int = 0) -> str:
    """Human-readable device name: the GPU's name, or ``"cpu (Triton interpreter)"``."""
    if not has_gpu():
        return "cpu (Triton interpreter)"
    return torch.cuda.get_device_name(device_index)


def runs_interpreted(t: torch.Tensor) -> bool:
    """A launch on CPU tensors runs in Triton's interpreter; on GPU tensors it is compiled.
    (``is_cpu``, not ``device.type``: asked on every call, and making the device object costs
    several times more.)"""
    return t.is_cpu


# Keyed by the Python function: hashing a JITFunction parses its source, which fails mid-launch.
_interpreted_cache: dict[object, InterpretedFunction] = {}
# The interpreter patches triton.language for the whole process while a kernel runs, and a
# compile reads triton.language: one lock, held by every interpreted launch and every compile
# this package starts (compiling(), launch()), keeps the two apart across threads.
_triton_lock = threading.RLock()


def compiling() -> threading.RLock:
    """Hold this (``with compiling():``) around any Triton/Gluon compile (``triton.compile``, a
    JIT launch or warmup) that may run while another thread interprets a kernel: it waits for
    the interpreted launch to finish, and an interpreted launch waits for it. Re-entrant. It is
    the lock itself (a C context manager: a launch pays well under a microsecond for it)."""
    return _triton_lock


def interpreted(kernel: JITFunction) -> InterpretedFunction:
    """The interpreter's version of a ``@triton.jit`` kernel (cached)."""
    if isinstance(kernel, InterpretedFunction):
        return kernel
    fn = _interpreted_cache.get(kernel.fn)
    if fn is None:
        fn = _interpreted_cache[kernel.fn] = InterpretedFunction(kernel.fn)
    return fn


def _call_device_function(self: JITFunction, *args, **kwargs):
    # Same as InterpretedFunction.__call__, except that the language patch is undone afterwards
    # (Triton 3.6 leaves it in place, which breaks the next real compile in this process).
    fn = interpreted(self)
    scope = _patch_lang(self.fn)
    try:
        return fn.rewrite()(*args, **kwargs)
    finally:
        scope.restore()


def _tensor_index(self) -> int:
    # Triton 3.6: ``int(self.handle.data)``, which numpy >= 2.3 refuses for shape (1,).
    data = self.handle.data
    return int(data.item() if getattr(data, "size", 0) == 1 else data)


_original_patch_lang_tensor = _interpreter._patch_lang_tensor


def _patch_lang_tensor(tensor, scope) -> None:
    _original_patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", _tensor_index)  # restored with the rest of the scope


@contextlib.contextmanager
def interpreting():
    """Inside this block, device-function calls from an interpreted kernel are interpreted."""
    # Gluon copies triton.language.math builtins when first imported; if that import happened
    # while the interpreter has the language patched, Gluon would keep the patched copies for
    # good and every later Gluon compile would fail. Import it before patching anything.
    import triton.experimental.gluon.language  # noqa: F401

    with _triton_lock:
        original = JITFunction.__call__
        JITFunction.__call__ = _call_device_function
        _interpreter._patch_lang_tensor = _patch_lang_tensor
        try:
            yield
        finally:
            JITFunction.__call__ = original
            _interpreter._patch_lang_tensor = _original_patch_lang_tensor


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` for host ints: Triton 3.6's is a ConstexprFunction (~5 us a call)."""
    return -(-a // b)


def launch(kernel: JITFunction, grid, *args, interpret: bool, **kwargs):
    """Launch ``kernel`` compiled (GPU tensors) or interpreted (CPU tensors)."""
    if not interpret:
        with compiling():  # the first launch of a specialisation compiles
            return kernel[grid](*args, **kwargs)
    # Launch options mean nothing to the interpreter.
    for key in ("num_warps", "num_stages", "kpack", "waves_per_eu", "num_ctas", "maxnreg"):
        kwargs.pop(key, None)
    with interpreting():
        return interpreted(kernel)[grid](*args, **kwargs)


def triton_version() -> str:
    return triton.__version__
