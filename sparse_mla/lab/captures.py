"""Notebook 04's figures and helpers: the slot pattern of a captured call, and replays.

A capture (:mod:`sparse_mla.capture`) or any :class:`~sparse_mla.workloads.Workload` has a CSR
slot list per token. :func:`slot_pattern_figure` draws three views of it: slots per token
(valid and invalid), a token x pool-row heatmap, and how much neighbouring tokens' slot sets
overlap (Jaccard index; high overlap is what makes an L2-resident gather cheap).
:func:`replay_all` runs captures through several kernels and returns tidy rows.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure

from .figures import html_table

__all__ = [
    "neighbour_overlap",
    "replay_all",
    "replay_kernels",
    "replay_rows_html",
    "slot_heatmap",
    "slot_pattern_figure",
    "slots_per_token",
]


def _csr(obj) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(kv_indices int64, kv_indptr int64, N) of a Capture or a Workload."""
    idx, ptr = obj.kv_indices.cpu().to(torch.int64), obj.kv_indptr.cpu().to(torch.int64)
    n = obj.num_kv if hasattr(obj, "num_kv") else obj.kv.shape[0]
    return idx, ptr, int(n)


def slots_per_token(kv_indices, kv_indptr, num_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([T] valid slots, [T] invalid slots) per token."""
    idx, ptr = kv_indices.to(torch.int64), kv_indptr.to(torch.int64)
    valid = ((idx >= 0) & (idx < num_kv)).to(torch.int64)
    csum = torch.zeros(idx.numel() + 1, dtype=torch.int64)
    csum[1:] = valid.cumsum(0)
    n_valid = csum[ptr[1:]] - csum[ptr[:-1]]
    return n_valid, (ptr[1:] - ptr[:-1]) - n_valid


def slot_heatmap(kv_indices, kv_indptr, num_kv: int, max_cols: int = 512) -> torch.Tensor:
    """[T, bins] count of each token's valid slots per pool-row bin (N rows in <= max_cols
    bins, so a large pool still fits on screen)."""
    idx, ptr = kv_indices.to(torch.int64), kv_indptr.to(torch.int64)
    T = ptr.numel() - 1
    bins = max(1, min(max_cols, num_kv))
    per_bin = -(-max(num_kv, 1) // bins)
    token = torch.repeat_interleave(torch.arange(T), ptr[1:] - ptr[:-1])
    valid = (idx >= 0) & (idx < num_kv)
    out = torch.zeros(T, bins, dtype=torch.int64)
    out.index_put_((token[valid], idx[valid] // per_bin), torch.ones(()).long(), accumulate=True)
    return out


def neighbour_overlap(kv_indices, kv_indptr, num_kv: int) -> torch.Tensor:
    """[T-1] Jaccard index |S_t ∩ S_t+1| / |S_t ∪ S_t+1| of neighbouring tokens' valid slot
    sets (1 when both are empty)."""
    idx, ptr = kv_indices.to(torch.int64), kv_indptr.to(torch.int64)
    sets = []
    for t in range(ptr.numel() - 1):
        s = idx[ptr[t] : ptr[t + 1]]
        sets.append(set(s[(s >= 0) & (s < num_kv)].tolist()))
    out = []
    for a, b in itertools.pairwise(sets):
        union = len(a | b)
        out.append(len(a & b) / union if union else 1.0)
    return torch.tensor(out, dtype=torch.float64)


def slot_pattern_figure(obj, *, title: str | None = None) -> Figure:
    """Slots per token, the slot heatmap and neighbour overlap of a Capture or Workload."""
    idx, ptr, n = _csr(obj)
    n_valid, n_invalid = slots_per_token(idx, ptr, n)
    T = ptr.numel() - 1
    fig = Figure(figsize=(13, 3.2))
    ax1, ax2, ax3 = (fig.add_subplot(1, 3, i) for i in (1, 2, 3))
    x = list(range(T))
    ax1.bar(x, n_valid.tolist(), width=1.0, label="valid")
    ax1.bar(x, n_invalid.tolist(), width=1.0, bottom=n_valid.tolist(), color="C3",
            label="invalid")  # fmt: skip
    ax1.set_xlabel("token")
    ax1.set_ylabel("slots")
    ax1.set_title("slots per token", fontsize=9)
    ax1.legend(fontsize=7)
    heat = slot_heatmap(idx, ptr, n)
    per_bin = -(-max(n, 1) // heat.shape[1])
    ax2.imshow((heat > 0).numpy(), aspect="auto", interpolation="nearest", cmap="Greys",
               extent=(0, heat.shape[1] * per_bin, T - 0.5, -0.5))  # fmt: skip
    ax2.set_xlabel(f"pool row (N={n})")
    ax2.set_ylabel("token")
    ax2.set_title("which rows each token reads", fontsize=9)
    ov = neighbour_overlap(idx, ptr, n)
    ax3.plot(range(1, T), ov.tolist(), ".-", ms=3)
    ax3.set_ylim(-0.02, 1.02)
    ax3.set_xlabel("token t")
    ax3.set_ylabel("Jaccard(slots of t-1, slots of t)")
    ax3.set_title(f"overlap with the previous token (mean {float(ov.mean()):.2f})"
                  if ov.numel() else "overlap", fontsize=9)  # fmt: skip
    fig.suptitle(title or getattr(obj, "name", ""), fontsize=10)
    fig.tight_layout()
    return fig


def replay_kernels() -> dict[str, Callable[..., torch.Tensor]]:
    """Kernels to replay through, by name: the Triton kernel, plain PyTorch in the input dtype
    (the tolerance rule's baseline), and each registered Gluon kernel that serves the local GPU,
    forced by name."""
    from .. import runtime
    from ..prefill import sparse_mla_prefill
    from ..reference import sparse_mla_prefill_ref

    def torch_same_dtype(q, kv, kv_indices, kv_indptr, softmax_scale, *, attn_sink=None):
        return sparse_mla_prefill_ref(
            q, kv, kv_indices, kv_indptr, softmax_scale, attn_sink=attn_sink, upcast=False
        )

    torch_same_dtype.__name__ = "torch_same_dtype"
    kernels = {"triton": sparse_mla_prefill, "torch (same dtype)": torch_same_dtype}
    arch = runtime.arch() if runtime.has_gpu() else None
    if arch is not None:
        # Every other registered kernel that serves this GPU, forced by name.
        from .. import dispatch

        for name, k in dispatch.KERNELS.items():
            if name == dispatch.FALLBACK or k.unavailable(dispatch.Call(arch, 64, 512)):
                continue

            def forced(q, kv, kv_indices, kv_indptr, softmax_scale, *, attn_sink=None, name=name):
                choice = dispatch.Choice(name)
                return sparse_mla_prefill(q, kv, kv_indices, kv_indptr, softmax_scale,
                                          attn_sink=attn_sink, config=choice)  # fmt: skip

            forced.__name__ = name
            kernels[name] = forced
    return kernels


def replay_all(
    paths: Iterable[str | Path],
    kernels: Mapping[str, Callable[..., torch.Tensor]] | None = None,
    *,
    device: str | None = None,
) -> list[dict[str, Any]]:
    """Replay every capture through every kernel: one row per (capture, kernel) with the error
    report against fp32 and the time (``do_bench`` median on a GPU; on CPU the wall time of one
    interpreted call, which says nothing about GPU speed)."""
    from .. import runtime
    from ..capture import load_capture, replay

    kernels = dict(kernels or replay_kernels())
    gpu = runtime.has_gpu() if device is None else device != "cpu"
    rows = []
    for path in paths:
        cap = load_capture(path)
        for name, fn in kernels.items():
            t0 = time.perf_counter()
            rep = replay(cap, fn, device=device, time=gpu)
            wall = time.perf_counter() - t0
            rows.append({
                "capture": cap.name, "kernel": name, "T": rep.T, "H": rep.H, "N": rep.num_kv,
                "nnz": rep.nnz, "ok": rep.ok, "rel_l2": rep.error.rel_l2,
                "max_abs": rep.error.max_abs, "nan_outputs": rep.nan_outputs,
                "time_ms": rep.time_ms, "wall_s": wall, "device": rep.device,
            })  # fmt: skip
    return rows


def replay_rows_html(rows: Iterable[Mapping[str, Any]]) -> str:
    """The replay rows as an HTML table (errors in scientific notation)."""

    def fmt(k, v):
        if isinstance(v, float):
            return f"{v:.3e}" if k in ("rel_l2", "max_abs") else f"{v:.3f}"
        return v

    cols = ["capture", "kernel", "T", "H", "N", "nnz", "ok", "rel_l2", "max_abs", "nan_outputs",
            "time_ms", "wall_s", "device"]  # fmt: skip
    return html_table([[fmt(c, r.get(c)) for c in cols] for r in rows], cols,
                      cls="sml-replay-table")  # fmt: skip
