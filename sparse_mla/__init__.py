"""sparse_mla: DeepSeek-V4 sparse MLA prefill attention kernels, reference and workbook."""

from .indices import (
    dense_to_csr,
    dsv4_combined_indices,
    dsv4_positions,
    dsv4_token_lengths,
    global_topk_from_block_table,
    request_of_token,
)
from .prefill import PrefillConfig, sparse_mla_prefill
from .reference import check_against_reference, mla_decode_ref, sparse_mla_prefill_ref

__all__ = [
    "PrefillConfig",
    "check_against_reference",
    "dense_to_csr",
    "dsv4_combined_indices",
    "dsv4_positions",
    "dsv4_token_lengths",
    "global_topk_from_block_table",
    "mla_decode_ref",
    "mla_gluon",
    "request_of_token",
    "sparse_mla_prefill",
    "sparse_mla_prefill_ref",
]
__version__ = "0.1.0"


def __getattr__(name):
    # The Gluon kernel imports triton.experimental.gluon: load it only when asked for.
    if name == "mla_gluon":
        from .gluon import mla_gluon

        return mla_gluon
    raise AttributeError(f"module 'sparse_mla' has no attribute {name!r}")
