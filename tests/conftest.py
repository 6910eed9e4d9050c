"""Shared fixtures: GPU skipping and random sparse-prefill cases with poisoned memory."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from dataclasses import dataclass

import pytest
import torch

# Keep the interpreter's numpy warnings out of the way and make every run reproducible per test.
os.environ.setdefault("PYTHONHASHSEED", "0")
# The tests read the shipped tuned configs only: an empty user config root (sparse_mla.configs)
# for this process and the CLI / notebook processes it starts, whatever the machine's
# ~/.config/sparse-mla or SPARSE_MLA_CONFIG_DIR hold.
os.environ["SPARSE_MLA_CONFIG_DIR"] = tempfile.mkdtemp(prefix="sparse_mla_test_user_configs_")
atexit.register(shutil.rmtree, os.environ["SPARSE_MLA_CONFIG_DIR"], ignore_errors=True)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "sm90: needs an sm90 (Hopper) GPU: the Gluon kernels; skipped on any other"
    )


def _is_sm90() -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability() == (9, 0)


def pytest_collection_modifyitems(config, items):
    """GPU tests (``gpu``) skip without a GPU; sm90-only tests (``sm90``: the Gluon kernels,
    written for Hopper) skip on any other GPU (an A100, an MI300) instead of failing."""
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a GPU (run with -m gpu on a GPU machine)")
        for item in items:
            if item.get_closest_marker("gpu") or item.get_closest_marker("sm90"):
                item.add_marker(skip)
        return
    if not _is_sm90():
        skip = pytest.mark.skip(reason="needs an sm90 (Hopper) GPU")
        for item in items:
            if item.get_closest_marker("sm90"):  # a marker, not a test id: "sm90" is a target
                item.add_marker(skip)


@dataclass
class Case:
    q: torch.Tensor
    kv: torch.Tensor
    kv_indices: torch.Tensor
    kv_indptr: torch.Tensor
    softmax_scale: float
    attn_sink: torch.Tensor | None

    def args(self):
        return self.q, self.kv, self.kv_indices, self.kv_indptr, self.softmax_scale


def make_case(
    T: int,
    H: int,
    D: int,
    *,
    N: int = 200,
    max_slots: int = 70,
    dtype=torch.bfloat16,
    index_dtype=torch.int32,
    sink: bool = True,
    device: str = "cpu",
    seed: int = 0,
    invalid: bool = True,
    empty_rows: bool = True,
    poison_unused: bool = True,
) -> Case:
    """Random inputs: ragged slot lists (some empty), invalid slots of every kind, and every pool
    row that no valid slot references set to NaN or Inf (so a stray read shows in the output).
    The pool lives inside a larger buffer whose rows past N are NaN too."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    lengths = torch.randint(0, max_slots + 1, (T,), generator=g)
    if empty_rows and T > 1:
        lengths[torch.randint(0, T, (max(1, T // 4),), generator=g)] = 0
    indptr = torch.zeros(T + 1, dtype=torch.int64)
    indptr[1:] = lengths.cumsum(0)
    nnz = int(indptr[-1])
    idx = torch.randint(0, max(N, 1), (nnz,), generator=g, dtype=torch.int64)
    if N == 0:
        idx.fill_(-1)
    if invalid and nnz:
        bad = [-1, N, 2**31 - 1, -(2**31)]
        if index_dtype == torch.int64:
            bad += [2**31, 2**33 + 5, 2**62, -(2**40)]
        where = torch.rand(nnz, generator=g) < 0.2
        choice = torch.randint(0, len(bad), (nnz,), generator=g)
        idx = torch.where(where, torch.tensor(bad, dtype=torch.int64)[choice], idx)
    idx = idx.to(index_dtype)
    # Pool inside a bigger buffer: 7 leading rows and 9 trailing rows of NaN.
    buf = torch.full((N + 16, D), float("nan"), dtype=torch.float32)
    buf[7 : 7 + N] = torch.randn(N, D, generator=g)
    if poison_unused and N:
        used = torch.zeros(N, dtype=torch.bool)
        valid = idx[(idx >= 0) & (idx < N)].long()
        used[valid] = True
        unused = (~used).nonzero().flatten()
        for i, r in enumerate(unused.tolist()):
            buf[7 + r] = float("nan") if i % 2 == 0 else float("inf")
    kv = buf.to(dtype)[7 : 7 + N]
    attn_sink = torch.randn(H, generator=g) * 2 if sink else None
    case = Case(q, kv, idx, indptr.to(index_dtype), D**-0.5, attn_sink)
    if device != "cpu":
        case = Case(
            q.to(device),
            buf.to(dtype).to(device)[7 : 7 + N],
            case.kv_indices.to(device),
            case.kv_indptr.to(device),
            case.softmax_scale,
            None if attn_sink is None else attn_sink.to(device),
        )
    return case


def poisoned_like(q: torch.Tensor) -> torch.Tensor:
    return torch.full_like(q, float("nan"))


def runnable_everywhere(monkeypatch, names=None) -> None:
    """The registered kernels ``names`` (default: every one) say they can run any call, as on
    an sm90 GPU, for tests of the choice and the launch path on a CPU."""
    from dataclasses import replace

    from sparse_mla import dispatch

    for name in list(dispatch.KERNELS) if names is None else names:
        k = dispatch.KERNELS[name]
        monkeypatch.setitem(dispatch.KERNELS, name, replace(k, unavailable=lambda call: None))
