"""The package's kernels as entries of the dispatch registry (:data:`sparse_mla.dispatch.KERNELS`).

:mod:`sparse_mla.dispatch` imports this module at its end, so the registry is whole once
dispatch is imported, whichever module imports it first. The entries' callables name their
functions in the kernels' modules lazily (:func:`_lazy`): importing this module imports the
Gluon launch table (its kernels' targets, knobs and summaries) and the FP8 layout constants,
but not :mod:`sparse_mla.prefill` or :mod:`sparse_mla.fp8_prefill`, which import dispatch
themselves. So the dependencies run one way at import: entry -> dispatch -> (configs, kernels
-> gluon.launch), and a kernel's module is imported on its first use.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import asdict
from typing import Any

from . import dispatch
from .configs import PrefillConfig
from .fp8 import KV_FORMAT as FP8_FORMAT
from .gluon import launch as gluon_launch

FP8_NAME = "triton_fp8"  # sparse_mla.fp8_prefill.NAME

# Triton's launch knobs (the Triton kernel and the FP8-cache kernel share PrefillConfig).
TRITON_KNOBS = {
    "BLOCK_H": (16, 32, 64),
    "BLOCK_K": (16, 32, 64),
    "num_warps": (4, 8),
    "num_stages": (1, 2, 3, 4),
    "EVEN_HD": (None, True, False),
    "USE_EXP2": (True, False),
    "PREFETCH_KV": (False, True),
}


def _lazy(module: str, name: str) -> Any:
    """A function that calls ``sparse_mla.<module>.<name>``, importing the module on the first
    call (then one attribute lookup saved: the function is kept)."""
    fn = None

    def call(*args, **kwargs):
        nonlocal fn
        if fn is None:
            fn = getattr(importlib.import_module(f"{__package__}.{module}"), name)
        return fn(*args, **kwargs)

    call.__name__ = call.__qualname__ = f"{module}.{name}"
    return call


def _register_all() -> None:
    dispatch.register(
        dispatch.Kernel(
            "triton",
            run=_lazy("prefill", "_run_triton"),
            resolve=_lazy("prefill", "_resolve_triton"),
            unavailable=lambda call: None,
            config_type="sparse_mla.configs:PrefillConfig",
            to_dict=PrefillConfig.to_dict,
            summary="Triton sparse prefill (prefill.py): one program per (token, head block), "
            "every target and the CPU interpreter",
            targets=("*",),
            knobs=dict(TRITON_KNOBS),
            dense_ids=True,
        )
    )
    for spec in gluon_launch.KERNELS.values():
        t = spec.config_type
        dispatch.register(
            dispatch.Kernel(
                spec.name,
                run=functools.partial(_lazy("prefill", "_run_gluon"), spec.name),
                resolve=functools.partial(_lazy("prefill", "_resolve_gluon"), spec.name),
                unavailable=functools.partial(_lazy("prefill", "_gluon_unavailable"), spec.name),
                # GluonConfig forces the shared algorithm; the wgmma ring shares its config
                # class, so it is forced by name (dispatch.Choice) only.
                config_type=None if spec.name == "gluon_wgmma" else f"{t.__module__}:{t.__name__}",
                to_dict=asdict,
                per_call_keys=("num_kv_splits", "split_BLOCK_H") if spec.splits else (),
                summary=spec.summary,
                targets=spec.targets,
                knobs=dict(spec.knobs),
                compile_args=functools.partial(_lazy("prefill", "_compile_gluon"), spec.name),
                dense_ids=spec.dense_ids,
            )
        )
    dispatch.register(
        dispatch.Kernel(
            FP8_NAME,
            run=_lazy("fp8_prefill", "_run"),
            resolve=_lazy("fp8_prefill", "_resolve"),
            unavailable=_lazy("fp8_prefill", "_unavailable"),
            config_type="sparse_mla.configs:PrefillConfig",
            to_dict=PrefillConfig.to_dict,
            summary="Triton sparse prefill from the FP8 cache (fp8_prefill.py): gathers 576 + 8 "
            "bytes a slot, dequantizes in registers; every target and the CPU interpreter",
            targets=("*",),
            knobs=dict(TRITON_KNOBS),
            compile_args=_lazy("fp8_prefill", "compile_args"),
            kv_format=FP8_FORMAT,
        )
    )

    dispatch.register(
        dispatch.Kernel(
            "gluon_ws_small_fp8",
            run=_lazy("gluon.launch_fp8", "run"),
            resolve=_lazy("gluon.launch_fp8", "resolve"),
            unavailable=_lazy("gluon.launch_fp8", "unavailable"),
            config_type="sparse_mla.gluon.launch_fp8:FP8SmallConfig",
            to_dict=asdict,
            summary=(
                "sm90 warp-specialised sparse prefill from the FP8 cache (hopper_fp8.py): the "
                "heads-on-N kernel's consumer, a producer that loads 576 + 7 bytes a slot into "
                "registers and dequantizes them into the bf16 tile, persistent"
            ),
            targets=("sm90",),
            knobs={
                "HEAD_GROUPS": (1, 2),
                "STAGES": (2, 3),
                "PRODUCERS": (1, 2, 3),
                "PRODUCER_REGS": (112, 120, 128, 136, 224, 256),
                "PIPELINE": (False, True),
            },
            compile_args=_lazy("gluon.launch_fp8", "compile_args"),
            kv_format=FP8_FORMAT,
            dense_ids=True,
        )
    )

    dispatch.register(
        dispatch.Kernel(
            "gluon_ws_fp8",
            run=_lazy("gluon.launch_fp8", "run_ws"),
            resolve=_lazy("gluon.launch_fp8", "resolve_ws"),
            unavailable=_lazy("gluon.launch_fp8", "unavailable"),
            config_type="sparse_mla.gluon.launch_fp8:FP8WSConfig",
            to_dict=asdict,
            summary=(
                "sm90 warp-specialised sparse prefill from the FP8 cache (hopper_ws_fp8.py): "
                "gluon_ws's two consumers (64 heads on wgmma's M), a producer that streams 64-byte "
                "chunks of 576 + 8 bytes a slot through registers and dequantizes them into the "
                "bf16 tile halves, persistent"
            ),
            targets=("sm90",),
            knobs={
                "CONSUMER_REGS": (184, 192, 200, 208),
                "PRODUCER_REGS": (72, 80, 88, 96, 104),
                "AHEAD": (1, 2, 3, 4, 5, 6),
            },
            compile_args=_lazy("gluon.launch_fp8", "compile_args_ws"),
            kv_format=FP8_FORMAT,
            dense_ids=True,
        )
    )


_register_all()
