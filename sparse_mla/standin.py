"""A stand-in Triton driver for one sm90 GPU, for the launch path on a machine without one.

With it active (``triton.runtime.driver.set_active(sm90_driver())``), kernels compile for sm90
(ptxas ships with Triton) and launch through Triton's own Python launcher
(``CudaLauncher.__call__``: scratch, the TMA descriptor wrapper) around a C launch that does
nothing, or records its arguments: the package's whole host path of a call, all but the driver
call. ``scripts/host_cost.py --cpu-launch`` times that path; the tests compare what two paths
hand the C launcher (``tests/test_fastlaunch.py``, ``tests/test_plans*.py``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["NUM_SMS", "STREAM", "sm90_driver", "sm90_patches"]

NUM_SMS = 132  # an H100/H200 SXM's SMs
STREAM = 77  # the stand-in's current stream (recorded launches show it)
_LAUNCHER_ATTRS = ("global_scratch_size", "global_scratch_align", "profile_scratch_size",
                   "profile_scratch_align", "launch_cooperative_grid", "launch_pdl")  # fmt: skip


def sm90_driver(calls: list | None = None) -> Any:
    """The stand-in driver. ``calls``: a list each C launch appends its argument tuple to (a TMA
    map then stands as the tuple of what would be encoded, so two launches compare equal exactly
    when they would encode the same bytes); None: launches do nothing (a TMA map is a fresh
    object), for timing."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia import driver as nvd

    record = calls is not None

    class Utils:
        def get_device_properties(self, device):
            return {"max_shared_mem": 232448, "multiprocessor_count": NUM_SMS}

        def load_binary(self, name, kernel, shared, device):
            return (None, 0xF00, 0, 0, 1024)

        def fill_tma_descriptor(self, *a):
            if not record:
                return object()
            return ("tma", *(tuple(x) if isinstance(x, list) else x for x in a))

    def launch(*a):
        if record:
            calls.append(a)

    class Launcher:
        __call__ = nvd.CudaLauncher.__call__

        def __init__(self, src, metadata):
            meta = getattr(metadata, "tensordesc_meta", None)
            self.num_ctas = getattr(metadata, "num_ctas", 1)
            self.launch = nvd.wrap_handle_tensordesc(launch, dict(src.signature), meta)
            for k in _LAUNCHER_ATTRS:
                setattr(self, k, getattr(metadata, k))

    class Driver:
        launcher_cls = Launcher
        utils = Utils()

        def get_current_device(self):
            return 0

        def get_current_stream(self, device):
            return STREAM

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    return Driver()


def sm90_patches() -> list[tuple[Any, str, Any]]:
    """``(owner, name, value)`` for each of the package's arch queries, answered as one sm90 GPU
    of :data:`NUM_SMS` SMs whatever the tensors' device (CPU tensors then take the compiled
    sm90 path, not the interpreter): set them with the stand-in driver active (``setattr``, or
    a test's ``monkeypatch.setattr``)."""
    from . import prefill, runtime
    from .gluon import launch as gluon_launch

    return [
        (runtime, "runs_interpreted", lambda t: False),
        (runtime, "arch", lambda device=0: "sm90"),
        (gluon_launch, "_num_compute_units", lambda device: NUM_SMS),
        (prefill, "_arch_of", lambda q: "sm90"),
    ]
