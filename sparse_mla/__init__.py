"""sparse_mla: DeepSeek-V4 sparse MLA prefill attention kernels, reference and workbook."""

from .prefill import PrefillConfig, sparse_mla_prefill
from .reference import check_against_reference, sparse_mla_prefill_ref

__all__ = [
    "PrefillConfig",
    "check_against_reference",
    "sparse_mla_prefill",
    "sparse_mla_prefill_ref",
]
__version__ = "0.1.0"
