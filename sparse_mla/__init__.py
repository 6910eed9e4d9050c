"""sparse_mla: DeepSeek-V4 sparse MLA prefill attention kernels, reference and workbook.

The public names load their module (and torch, Triton) on first use, so ``sparse-mla --help``
and ``import sparse_mla.cli`` stay fast.
"""

from __future__ import annotations

import importlib

# Public name -> the module that defines it.
_PUBLIC = {
    "FP8Cache": "fp8",
    "PrefillConfig": "prefill",
    "sparse_mla_prefill": "prefill",
    "check_against_reference": "reference",
    "mla_decode_ref": "reference",
    "sparse_mla_prefill_ref": "reference",
    "dense_to_csr": "indices",
    "dsv4_combined_indices": "indices",
    "dsv4_positions": "indices",
    "dsv4_token_lengths": "indices",
    "global_topk_from_block_table": "indices",
    "request_of_token": "indices",
    "mla_gluon": "gluon",  # imports triton.experimental.gluon
}

__all__ = sorted(_PUBLIC)
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'sparse_mla' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later look-ups (and a Recorder's patch) see a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
