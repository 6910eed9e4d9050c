"""Engine-like inputs for the sparse prefill: DSv4 CSA / HCA layers, GLM full top-k, FlashMLA.

Every generator returns a :class:`Workload` (the five positional operands plus the sink, ready
for ``sparse_mla_prefill(*w.args(), **w.kwargs())``) and builds its slot lists with
:mod:`sparse_mla.indices`, the same packing an engine integration uses.

Layouts
-------
- **DSv4 CSA / HCA** (:func:`dsv4_csa`, :func:`dsv4_hca`): the prompt is split into requests;
  request r owns pool block ``[r*M, (r+1)*M)`` holding its compressed rows first and its window
  (raw token) rows after them (:func:`sparse_mla.indices.dsv4_combined_indices`). The token at
  position p sees ``min((p+1)//ratio, topk)`` compressed rows, drawn at random among the
  ``(p+1)//ratio`` visible ones (all of them when they fit), plus ``min(p+1, window)`` window
  rows. HCA (ratio 128) sees every compressed row.
- **GLM-style full top-k** (:func:`glm_full_topk`): one latent row per prompt token in a paged
  pool (blocks of ``block_size`` rows, scattered at random as an engine's block table does);
  token p sees ``min(p+1, topk)`` of its request's rows ``0..p``.
- **FlashMLA-style uniform** (:func:`flashmla_uniform`): each token gets ``slots`` slot ids drawn
  uniformly from a pool of ``pool`` rows.

Seeds and devices: each generator draws from ``torch.Generator(device).manual_seed(seed)``, so a
workload is reproducible on one device type (CPU and GPU streams differ). Everything is built
with tensor ops on that device, a chunk of tokens at a time (no per-token Python loop): on a
2-core CPU a 16k-token CSA workload at H=8 takes about 2 s, mostly drawing q and the top-k
lists. Sizes from a 1k to a 64k-token prompt with H in {8, 16, 64, 128} work on a GPU; on CPU
keep T small (the kernel runs in Triton's interpreter).

``big_buffer=True`` places the KV pool at the end of a >2 GiB allocation, as an engine's KV
cache is one large tensor with per-layer views; benchmark that way (aiter #6002's review: on AMD
a pool in a small allocation compiles to a different, buffer-op, variant). It defaults to False:
on CPU the 2 GiB are only reserved (never touched) but still count against memory limits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import indices as _indices

__all__ = [
    "STANDARD_TOKENS",
    "WORKLOADS",
    "Workload",
    "by_name",
    "dsv4_csa",
    "dsv4_hca",
    "flashmla_uniform",
    "glm_full_topk",
    "pool_tensor",
    "standard_names",
]

# Prompt lengths the benchmarks sweep (tokens) and the DSv4 constants (DESIGN.md §2).
STANDARD_TOKENS = (1024, 4096, 16384, 65536)
DSV4_HEAD_DIM = 512
DSV4_WINDOW = 128
BIG_BUFFER_BYTES = 2**31 + 2**21  # "> 2 GiB": 2 GiB plus 2 MiB


@dataclass(frozen=True, eq=False)
class Workload:
    """One prefill call's inputs plus a description.

    ``q`` [T, H, D], ``kv`` [N, D] (a view into a larger buffer when ``meta["big_buffer"]``),
    ``kv_indices`` [nnz], ``kv_indptr`` [T+1], ``softmax_scale``, ``attn_sink`` [H] fp32 or None.
    ``meta`` holds at least kind, T, H, D, pool_rows and nnz; DSv4 kinds add topk, ratio, window.
    """

    name: str
    q: torch.Tensor
    kv: torch.Tensor
    kv_indices: torch.Tensor
    kv_indptr: torch.Tensor
    softmax_scale: float
    attn_sink: torch.Tensor | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def args(self) -> tuple:
        """(q, kv, kv_indices, kv_indptr, softmax_scale): the positional operands."""
        return self.q, self.kv, self.kv_indices, self.kv_indptr, self.softmax_scale

    def kwargs(self) -> dict[str, Any]:
        """{"attn_sink": ...}: the keyword operands."""
        return {"attn_sink": self.attn_sink}

    @property
    def valid_slots(self) -> int:
        """Number of (token, slot) pairs with a valid slot: the work the kernel does."""
        idx = self.kv_indices
        return int(((idx >= 0) & (idx < self.kv.shape[0])).sum())

    def flops(self) -> int:
        """Useful FLOPs: 2 (QK) + 2 (PV) multiply-adds per head, dim and valid slot."""
        return 4 * self.q.shape[1] * self.q.shape[2] * self.valid_slots

    def __repr__(self) -> str:
        m = self.meta
        keys = ("kind", "T", "H", "D", "topk", "ratio", "window", "pool_rows", "nnz")
        desc = " ".join(f"{k}={m[k]}" for k in keys if k in m)
        return f"Workload({self.name!r}: {desc}, {self.q.dtype}, {self.q.device})"


def pool_tensor(
    num_rows: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str | torch.device,
    *,
    big_buffer: bool = False,
    buffer_bytes: int = BIG_BUFFER_BYTES,
) -> torch.Tensor:
    """An uninitialised [num_rows, head_dim] pool; with ``big_buffer`` a view at the end of an
    allocation of at least ``buffer_bytes`` (> 2 GiB by default) plus the pool itself."""
    if num_rows < 0 or head_dim <= 0:
        raise ValueError(f"pool: need num_rows >= 0 and head_dim > 0, got {num_rows}, {head_dim}")
    n = num_rows * head_dim
    if not big_buffer:
        return torch.empty(num_rows, head_dim, dtype=dtype, device=device)
    elt = torch.empty(0, dtype=dtype).element_size()
    total = -(-buffer_bytes // elt) + n
    buf = torch.empty(total, dtype=dtype, device=device)
    return buf[total - n :].view(num_rows, head_dim)


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def _check_common(T, H, D, dtype, num_requests):
    for name, v, lo in (("T", T, 0), ("H", H, 1), ("D", D, 1), ("num_requests", num_requests, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    if dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    if num_requests > max(T, 1):
        raise ValueError(f"num_requests ({num_requests}) must not exceed T ({T})")


def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _split(T: int, num_requests: int) -> list[int]:
    """Split T tokens into ``num_requests`` near-equal request lengths (first ones longer)."""
    base, rem = divmod(T, num_requests)
    return [base + (1 if r < rem else 0) for r in range(num_requests)]


def _requests(q_lens: list[int], context: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """query_start_loc [R+1] and seq_lens [R] (context + new tokens), int32 as engines keep."""
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens, dtype=torch.int32).cumsum(0)
    seq = torch.tensor([context + n for n in q_lens], dtype=torch.int32)
    return qsl.to(device), seq.to(device)


def _draw_subset(
    visible: torch.Tensor, k: int, gen: torch.Generator, *, shuffle: bool, chunk: int = 8192
) -> torch.Tensor:
    """[T, k] int64: for each token min(visible, k) distinct ids in [0, visible), -1 after.

    Tokens with visible <= k get every id in order; others get one id drawn uniformly from each of
    k equal strata of [0, visible) (distinct by construction), in random order when ``shuffle``.
    Built with tensor ops on ``visible``'s device, ``chunk`` tokens at a time. Each chunk draws
    its uniforms (and shuffle keys) for every token, so the stream, and the result, does not
    depend on how many tokens are capped; only the capped tokens' rows are computed from them.
    """
    T = visible.numel()
    device = visible.device
    out = torch.empty(T, k, dtype=torch.int64, device=device)
    j = torch.arange(k, device=device, dtype=torch.int64)[None, :]  # [1, k]
    for t0 in range(0, T, chunk):
        v = visible[t0 : t0 + chunk].to(torch.int64)  # [t]
        u = torch.rand(v.shape[0], k, generator=gen, device=device, dtype=torch.float64)
        keys = torch.rand(v.shape[0], k, generator=gen, device=device) if shuffle else None
        rows = out[t0 : t0 + chunk]
        rows.copy_(torch.where(j < v[:, None], j, -1))  # every visible id, in order
        capped = (v > k).nonzero().squeeze(1)
        if capped.numel():
            vc = v[capped, None]  # [c, 1]
            lo = j * vc // k
            width = (j + 1) * vc // k - lo
            offset = (u[capped] * width).to(torch.int64)  # u < 1, but fp64 rounding may reach 1
            drawn = lo + torch.minimum(offset, (width - 1).clamp(min=0))
            if shuffle:
                drawn = torch.gather(drawn, 1, keys[capped].argsort(dim=1))
            rows[capped] = drawn
    return out


def _finish(
    name, kind, q, kv, kv_indices, kv_indptr, scale, sink, gen, *, big_buffer, meta
) -> Workload:
    kv.normal_(generator=gen)
    meta = {
        "kind": kind,
        "T": q.shape[0],
        "H": q.shape[1],
        "D": q.shape[2],
        **meta,
        "pool_rows": kv.shape[0],
        "nnz": kv_indices.numel(),
        "dtype": str(q.dtype).removeprefix("torch."),
        "big_buffer": big_buffer,
    }
    return Workload(name, q, kv, kv_indices, kv_indptr, scale, sink, meta)


def _qk_sink(T, H, D, dtype, device, gen, sink):
    q = torch.randn(T, H, D, generator=gen, device=device, dtype=torch.float32).to(dtype)
    s = torch.randn(H, generator=gen, device=device, dtype=torch.float32) if sink else None
    return q, s


# ----------------------------------------------------------------------------------------------
# Generators
# ----------------------------------------------------------------------------------------------


def dsv4_csa(
    T: int,
    H: int,
    *,
    topk: int | None = 512,
    window: int = DSV4_WINDOW,
    ratio: int = 4,
    num_requests: int = 1,
    context: int = 0,
    D: int = DSV4_HEAD_DIM,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    seed: int = 0,
    sink: bool = True,
    shuffle: bool = True,
    big_buffer: bool = False,
    index_dtype: torch.dtype = torch.int32,
    name: str | None = None,
    kind: str = "dsv4_csa",
) -> Workload:
    """A DSv4 compressed-sparse-attention layer's prefill call (module docstring: layout).

    Args:
        T: prompt tokens in this call, split into ``num_requests`` near-equal requests.
        H: query heads (64 Flash / 128 Pro without TP; 8 or 16 per rank under TP).
        topk: compressed rows per token at most (512 V4-Flash, 1024 V4-Pro); None: every
            visible compressed row (the HCA layers).
        window: sliding-window rows (128).
        ratio: compression ratio (4 for CSA, 128 for HCA).
        context: tokens already in each request's cache before this chunk (positions start there).
        D: head dim (512). ``dtype``: bf16 or fp16. ``sink``: draw a [H] fp32 sink.
        shuffle: top-k ids in random order (as an indexer returns them) instead of ascending.
        index_dtype: dtype of kv_indices and kv_indptr (int32 or int64).

    Returns:
        A :class:`Workload`; the token at position p has ``min((p+1)//ratio, topk) +
        min(p+1, window)`` slots; scale ``D**-0.5``; pool ``num_requests`` blocks of
        ``meta["pool_block_rows"]`` rows.
    """
    _check_common(T, H, D, dtype, num_requests)
    for nm, v in (("topk", topk), ("window", window), ("ratio", ratio)):
        if v is None and nm == "topk":
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{nm} must be an int >= 1, got {v!r}")
    if isinstance(context, bool) or not isinstance(context, int) or context < 0:
        raise ValueError(f"context must be an int >= 0, got {context!r}")
    if index_dtype not in (torch.int32, torch.int64):
        raise TypeError(f"index_dtype must be torch.int32 or torch.int64, got {index_dtype}")
    device = torch.device(device)
    gen = _generator(device, seed)
    q, s = _qk_sink(T, H, D, dtype, device, gen, sink)

    q_lens = _split(T, num_requests)
    qsl, seq_lens = _requests(q_lens, context, device)
    num_compressed = max(1, (context + max(q_lens)) // ratio)
    # Request r's block: C compressed rows, then window + q_len window rows (indices.py layout).
    block_rows = -(-(num_compressed + window + max(q_lens)) // 64) * 64
    if topk is None:
        topk_ids = None  # every visible compressed row
    else:
        positions = _indices.dsv4_positions(qsl, seq_lens)  # [T]
        visible = (positions.to(torch.int64) + 1) // ratio
        topk_ids = _draw_subset(visible, topk, gen, shuffle=shuffle).to(index_dtype)
    kv_indices, kv_indptr = _indices.dsv4_combined_indices(
        topk_ids,
        qsl,
        seq_lens,
        ratio=ratio,
        topk=topk,
        window=window,
        pool_block_rows=block_rows,
        num_compressed=num_compressed,
        num_tokens=T,
        dtype=index_dtype,
        indptr_dtype=index_dtype,
    )
    kv = pool_tensor(block_rows * num_requests, D, dtype, device, big_buffer=big_buffer)
    meta = {
        "topk": topk,
        "ratio": ratio,
        "window": window,
        "num_requests": num_requests,
        "context": context,
        "num_compressed": num_compressed,
        "pool_block_rows": block_rows,
        "seed": seed,
    }
    if name is None:
        name = f"csa_h{H}_topk{topk}_t{T}" if topk is not None else f"hca_h{H}_t{T}"
    return _finish(
        name, kind, q, kv, kv_indices, kv_indptr, D**-0.5, s, gen, big_buffer=big_buffer, meta=meta
    )


def dsv4_hca(T: int, H: int, *, ratio: int = 128, **kw) -> Workload:
    """A DSv4 heavily compressed layer (ratio 128): every visible compressed row plus the window.

    Same keyword arguments as :func:`dsv4_csa`, without ``topk`` (there is no cap).
    """
    if "topk" in kw:
        raise TypeError("dsv4_hca takes no topk: an HCA token sees every compressed row")
    kw.setdefault("kind", "dsv4_hca")
    return dsv4_csa(T, H, ratio=ratio, topk=None, **kw)


def glm_full_topk(
    T: int,
    H: int,
    *,
    topk: int = 2048,
    num_requests: int = 1,
    block_size: int = 64,
    D: int = DSV4_HEAD_DIM,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    seed: int = 0,
    sink: bool = False,
    shuffle: bool = True,
    big_buffer: bool = False,
    index_dtype: torch.dtype = torch.int32,
    name: str | None = None,
) -> Workload:
    """GLM-style (DSA) full top-k: token p attends ``min(p+1, topk)`` of its request's rows 0..p.

    The pool holds one row per prompt token in pages of ``block_size`` rows; each request's pages
    are scattered over the pool by a random block table, and the indexer's request-local ids are
    mapped to pool slots by :func:`sparse_mla.indices.global_topk_from_block_table`.
    """
    _check_common(T, H, D, dtype, num_requests)
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk must be an int >= 1, got {topk!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    device = torch.device(device)
    gen = _generator(device, seed)
    q, s = _qk_sink(T, H, D, dtype, device, gen, sink)

    q_lens = _split(T, num_requests)
    qsl, seq_lens = _requests(q_lens, 0, device)
    positions = _indices.dsv4_positions(qsl, seq_lens)
    local = _draw_subset(positions.to(torch.int64) + 1, topk, gen, shuffle=shuffle)  # [T, topk]

    blocks_per_req = max(1, -(-max(q_lens) // block_size))
    num_blocks = blocks_per_req * num_requests
    perm = torch.randperm(num_blocks, generator=gen, device=device)
    block_table = perm.view(num_requests, blocks_per_req).to(torch.int32)
    req_of_token = torch.repeat_interleave(
        torch.arange(num_requests, device=device), torch.tensor(q_lens, device=device)
    )
    slots = _indices.global_topk_from_block_table(
        local.to(index_dtype), block_table, req_of_token, block_size
    )
    lengths = torch.clamp(positions.to(torch.int64) + 1, max=topk)
    kv_indices, kv_indptr = _indices.dense_to_csr(slots, lengths, indptr_dtype=index_dtype)
    kv = pool_tensor(num_blocks * block_size, D, dtype, device, big_buffer=big_buffer)
    meta = {
        "topk": topk,
        "num_requests": num_requests,
        "block_size": block_size,
        "block_table": block_table.tolist(),
        "seed": seed,
    }
    name = name or f"glm_h{H}_topk{topk}_t{T}"
    return _finish(
        name, "glm_full_topk", q, kv, kv_indices, kv_indptr, D**-0.5, s, gen,
        big_buffer=big_buffer, meta=meta,
    )  # fmt: skip


def flashmla_uniform(
    T: int,
    H: int,
    slots: int = 2048,
    pool: int = 65536,
    *,
    invalid_frac: float = 0.0,
    D: int = DSV4_HEAD_DIM,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    seed: int = 0,
    sink: bool = False,
    big_buffer: bool = False,
    index_dtype: torch.dtype = torch.int32,
    name: str | None = None,
) -> Workload:
    """FlashMLA-style sparse prefill test input: ``slots`` uniform random slot ids per token
    in a pool of ``pool`` rows; a fraction ``invalid_frac`` of them is -1."""
    _check_common(T, H, D, dtype, 1)
    if not isinstance(slots, int) or slots < 0 or not isinstance(pool, int) or pool < 1:
        raise ValueError(f"need slots >= 0 and pool >= 1, got slots={slots!r}, pool={pool!r}")
    if not 0.0 <= invalid_frac <= 1.0:
        raise ValueError(f"invalid_frac must be in [0, 1], got {invalid_frac!r}")
    device = torch.device(device)
    gen = _generator(device, seed)
    q, s = _qk_sink(T, H, D, dtype, device, gen, sink)
    ids = torch.randint(0, pool, (T, slots), generator=gen, device=device, dtype=torch.int64)
    if invalid_frac > 0:
        drop = torch.rand(T, slots, generator=gen, device=device) < invalid_frac
        ids = torch.where(drop, torch.full_like(ids, -1), ids)
    kv_indices, kv_indptr = _indices.dense_to_csr(
        ids.to(index_dtype), lengths=[slots] * T, indptr_dtype=index_dtype
    )
    kv = pool_tensor(pool, D, dtype, device, big_buffer=big_buffer)
    meta = {"topk": slots, "invalid_frac": invalid_frac, "seed": seed}
    name = name or f"flashmla_h{H}_slots{slots}_t{T}"
    return _finish(
        name, "flashmla_uniform", q, kv, kv_indices, kv_indptr, D**-0.5, s, gen,
        big_buffer=big_buffer, meta=meta,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Named standard workloads
# ----------------------------------------------------------------------------------------------


def _entry(fn: Callable[..., Workload], **defaults) -> tuple[Callable[..., Workload], dict]:
    return fn, defaults


WORKLOADS: dict[str, tuple[Callable[..., Workload], dict[str, Any]]] = {}
for _h in (8, 16, 64, 128):
    for _k in (512, 1024):
        WORKLOADS[f"csa_h{_h}_topk{_k}"] = _entry(dsv4_csa, H=_h, topk=_k, T=16384)
    WORKLOADS[f"hca_h{_h}"] = _entry(dsv4_hca, H=_h, T=16384)
    WORKLOADS[f"glm_h{_h}_topk2048"] = _entry(glm_full_topk, H=_h, topk=2048, T=16384)
for _h in (64, 128):
    WORKLOADS[f"flashmla_h{_h}_slots2048"] = _entry(
        flashmla_uniform, H=_h, slots=2048, pool=65536, T=4096
    )
del _h, _k


def standard_names() -> list[str]:
    """Names accepted by :func:`by_name`."""
    return sorted(WORKLOADS)


def by_name(name: str, **overrides) -> Workload:
    """A named standard workload; keyword ``overrides`` replace its defaults (e.g. ``T=256``,
    ``device="cuda"``, ``big_buffer=True``). Default sizes are the benchmark's (16k tokens).
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(standard_names())}")
    fn, defaults = WORKLOADS[name]
    kw = {**defaults, **overrides}
    T, H = kw.pop("T"), kw.pop("H")
    if defaults["H"] == H:  # otherwise the generator names it after the H it was given
        kw.setdefault("name", f"{name}_t{T}")
    return fn(T, H, **kw)
