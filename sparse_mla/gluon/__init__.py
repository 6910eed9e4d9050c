"""Unified Gluon MLA kernel: MLA decode (with the 64-wide RoPE part) and DSv4 sparse prefill in
one algorithm (``algorithm.py``) with small arch pieces per target (``cdna4.py`` for gfx950,
``hopper.py`` for sm90) and a host side (``launch.py``)."""

from .launch import (
    GluonConfig,
    choose_num_splits,
    compile_args,
    compile_attrs,
    compile_for,
    default_config,
    mla_gluon,
)

__all__ = [
    "GluonConfig",
    "choose_num_splits",
    "compile_args",
    "compile_attrs",
    "compile_for",
    "default_config",
    "mla_gluon",
]
