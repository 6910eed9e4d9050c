"""Numeric constants every layer shares (host code, Triton and Gluon kernels, the lab)."""

from __future__ import annotations

import math

LOG2E = math.log2(math.e)  # 1.4426950408889634: exp(x) = exp2(x * LOG2E)
