"""Constants every layer shares (host code, Triton and Gluon kernels, the lab), importable
without torch."""

from __future__ import annotations

import math

LOG2E = math.log2(math.e)  # 1.4426950408889634: exp(x) = exp2(x * LOG2E)

# The bench's providers besides the package's registered kernels (sparse_mla.bench.PROVIDERS),
# here so that the lab's torch-free CSV analysis (sparse_mla.lab.grid) tells them apart too.
NON_KERNEL_PROVIDERS = ("default", "default_dense", "default_dense_len", "default_dense_wide",
                        "torch", "flashmla", "aiter")  # fmt: skip
