"""Launch of the sm90 Gluon kernels that read the FP8 KV cache (:mod:`hopper_fp8`,
:mod:`hopper_ws_fp8`), and what the dispatch registry needs to know about them
(``gluon_ws_small_fp8``, ``gluon_ws_fp8``; :mod:`sparse_mla.kernels` registers them with
``kv_format`` "fp8_model1").

``gluon_ws_small_fp8``'s launch mirrors the bf16 heads-on-N kernel's: persistent, one program
per SM over R x cdiv(H, 16 x HEAD_GROUPS) work items, 4 warps in the default partition (the
consumer) + 4 in each of the PRODUCERS producer partitions; CSR lists or dense ids (with or
without the rows' lengths), read as they are. ``gluon_ws_fp8`` is launched as the
bf16 heads-on-M kernel is (:func:`launch._launch_persistent`: R x cdiv(H, 64) items, Q and O
by TMA, the small-call order, dense ids), with the cache's bytes for the pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .. import dispatch, fastlaunch, runtime
from .._consts import LOG2E
from ..fp8 import HEAD_DIM, KV_FORMAT, FP8Cache
from ..validation import dense_ids_value, dense_launch
from . import hopper_fp8, hopper_ws, hopper_ws_fp8, hopper_ws_small
from . import launch as _launch
from .launch import SmallWSConfig, WSConfig, _regs_field, get_target

NAME = "gluon_ws_small_fp8"  # its name in the registry (sparse_mla/kernels.py)
WS_NAME = "gluon_ws_fp8"


@dataclass(frozen=True)
class FP8SmallConfig:
    """Launch of ``gluon_ws_small_fp8``: ``HEAD_GROUPS`` and ``STAGES`` as in
    :class:`~sparse_mla.gluon.launch.SmallWSConfig` (the same shared-memory tiles);
    ``PRODUCERS``: producer warpgroups, taking the ring's tiles round-robin (each holds one
    tile's bytes in registers, so this is how many tiles a program has in flight);
    ``PRODUCER_REGS``: each one's registers a thread (:func:`hopper_fp8.register_split`);
    ``PIPELINE`` (one producer only): it issues the next tile's loads before it dequantizes
    the current one."""

    HEAD_GROUPS: int = 1
    STAGES: int | None = None
    PRODUCERS: int = 2
    PRODUCER_REGS: int = hopper_fp8.PRODUCER_REGS.value
    PIPELINE: bool = False

    def _tiles(self) -> SmallWSConfig:
        """The heads-on-N kernel's launch with the same tiles: its checks and its shared
        memory are this kernel's (the producers' registers are checked here)."""
        return SmallWSConfig(HEAD_GROUPS=self.HEAD_GROUPS, STAGES=self.STAGES)

    def stages(self) -> int:
        return self._tiles().stages()

    def smem_bytes(self) -> int:
        """Q, the bf16 KV ring, P^T and the barriers, as the kernel allocates."""
        return self._tiles().smem_bytes()

    def validate(self) -> None:
        if type(self.HEAD_GROUPS) is not int or self.HEAD_GROUPS not in (1, 2):
            raise ValueError(f"config: HEAD_GROUPS must be 1 or 2, got {self.HEAD_GROUPS!r}")
        self._tiles().validate()  # STAGES, and the tiles' shared memory
        _regs_field("PRODUCER_REGS", self.PRODUCER_REGS)
        if type(self.PRODUCERS) is not int or self.PRODUCERS not in (1, 2, 3):
            raise ValueError(f"config: PRODUCERS must be 1, 2 or 3, got {self.PRODUCERS!r}")
        try:
            hopper_fp8.register_split(self.PRODUCERS, self.PRODUCER_REGS, self.HEAD_GROUPS)
        except ValueError as e:
            raise ValueError(f"config: {e}") from None
        if type(self.PIPELINE) is not bool:
            raise ValueError(f"config: PIPELINE must be True or False, got {self.PIPELINE!r}")
        if self.PIPELINE and self.PRODUCERS != 1:
            raise ValueError("config: PIPELINE needs PRODUCERS=1")
        if self.stages() < self.PRODUCERS:
            # A producer's wait on a tile's free barrier is by phase parity: it is unambiguous
            # only while no producer runs more than a lap of the ring ahead of the consumer.
            raise ValueError(
                f"config: PRODUCERS={self.PRODUCERS} needs at least as many ring tiles, got "
                f"{self.stages()} (STAGES)"
            )


@dataclass(frozen=True)
class FP8WSConfig:
    """Launch of ``gluon_ws_fp8`` (:mod:`hopper_ws_fp8`: 64 heads on wgmma's M, two consumer
    warpgroups and one FP8 producer; the tiles and the ring are :mod:`hopper_ws`'s).

    ``CONSUMER_REGS`` (consumer 1) and ``PRODUCER_REGS``: registers a thread; consumer 0 takes
    the rest of the 504 the three warpgroups share (:func:`hopper_ws.register_split`). The
    default, 192 / 88 (consumer 0: 224), is the largest producer share with which the kernel
    cross-compiles without spills for int32 and int64 CSR ids (docs/PERF_NOTES.md, "The FP8
    cache on Hopper at 33-128 heads"). ``AHEAD``: 64-byte chunks of the tile's 64 rows (4 KiB,
    4 words a lane) the producer keeps loaded ahead of the one it stores (4: the most that fit
    in 88 registers without spills for int32 CSR ids and a power-of-two block size; 3 with
    int64 ids or another block size)."""

    CONSUMER_REGS: int = hopper_ws_fp8.CONSUMER_REGS.value
    PRODUCER_REGS: int = hopper_ws_fp8.PRODUCER_REGS.value
    AHEAD: int = hopper_ws_fp8.AHEAD.value

    def validate(self) -> None:
        # The register split as gluon_ws's (the same three warpgroups and the same pool).
        WSConfig(CONSUMER_REGS=self.CONSUMER_REGS, PRODUCER_REGS=self.PRODUCER_REGS).validate()
        top = hopper_ws_fp8.MAX_AHEAD
        if type(self.AHEAD) is not int or not 1 <= self.AHEAD <= top:
            raise ValueError(
                f"config: AHEAD must be an int in [1, {top}] (64-byte chunks of 64 rows the "
                f"producer holds in registers ahead of its stores), got {self.AHEAD!r}"
            )


def default_config(num_heads: int) -> FP8SmallConfig:
    """One head group up to 16 heads, two above (more heads: several items a token); two
    producers."""
    return FP8SmallConfig(HEAD_GROUPS=1 if num_heads <= 16 else 2)


def _resolved(name: str, cls: type, default: Any, launch: Any) -> Any:
    """``launch`` (None: ``default``; a dict of ``cls``'s fields; a ``cls``) as a checked
    ``cls``, for kernel ``name``."""
    if launch is None:
        cfg = default
    elif isinstance(launch, cls):
        cfg = launch
    elif isinstance(launch, dict):
        unknown = sorted(set(launch) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(
                f"config: unknown field(s) {unknown} for {name}; it takes "
                f"{sorted(cls.__dataclass_fields__)}"
            )
        cfg = cls(**launch)
    else:
        raise TypeError(f"{name} takes an {cls.__name__} or a dict, got {type(launch).__name__}")
    cfg.validate()
    return cfg


def resolve(launch: Any, call: dispatch.Call) -> FP8SmallConfig:
    """The launch (None: :func:`default_config`; a dict of its fields; the config), checked."""
    default = default_config(call.num_heads) if launch is None else None
    return _resolved(NAME, FP8SmallConfig, default, launch)


def resolve_ws(launch: Any, call: dispatch.Call) -> FP8WSConfig:
    """``gluon_ws_fp8``'s launch (None: ``FP8WSConfig()``; a dict of its fields; the config),
    checked."""
    return _resolved(WS_NAME, FP8WSConfig, FP8WSConfig(), launch)


def unavailable(call: dispatch.Call) -> str | None:
    """Why the kernels cannot run ``call`` (None: they can): an FP8 cache whose blocks start
    16-byte aligned, an sm90 GPU, head_dim 512, bf16 q (both kernels take any head count)."""
    if call.kv_format != KV_FORMAT:
        return "reads an FP8 KV cache (sparse_mla.FP8Cache, MODEL1 layout), not a dense pool"
    if call.arch is None or (call.kv is not None and call.kv.device.type == "cpu"):
        return "Gluon kernels need a GPU (they do not run in the interpreter)"
    if call.arch != "sm90":
        return f"needs sm90 (wgmma, warp specialisation), the target is {call.arch}"
    if call.head_dim != HEAD_DIM:
        return f"needs head_dim {HEAD_DIM} (448 NoPE + 64 RoPE), got {call.head_dim}"
    if call.dtype is not None and call.dtype != torch.bfloat16:
        return f"takes bf16 queries, got {call.dtype}"
    cache = call.kv
    if isinstance(cache, FP8Cache) and cache.num_blocks > 0:
        if cache.as_bytes().data_ptr() % 16 or cache.block_stride % 16:
            return "the cache's blocks do not start 16-byte aligned"
        if cache.num_slots >= 2**31:
            return f"slots are int32 in the kernel; the cache has {cache.num_slots}"
    return None


def _constexprs(cfg: FP8SmallConfig, block_size: int) -> dict[str, Any]:
    return {
        "HEAD_GROUPS": cfg.HEAD_GROUPS,
        "STAGES": cfg.STAGES,
        "PRODUCERS": cfg.PRODUCERS,
        "PRODUCER_REGS": cfg.PRODUCER_REGS,
        "POW2": block_size & (block_size - 1) == 0,
        "PIPELINE": cfg.PIPELINE,
    }


def run(q, cache: FP8Cache, kv_indices, kv_indptr, softmax_scale, attn_sink, out, cfg, nnz=None):
    """Launch on validated inputs (T > 0, at least one block): CSR, dense [T, K] ids
    (``kv_indptr`` None) or dense ids with their rows' lengths in ``kv_indptr``'s place, read
    as they are (:func:`~sparse_mla.validation.dense_launch`). ``nnz`` plans nothing here (no
    KV split)."""
    R, H, _ = q.shape
    if q.data_ptr() % 16 or q.stride(0) % 8 or q.stride(1) % 8 or q.stride(2) != 1:
        q = q.contiguous()  # the producer copies Q rows with 16-byte cp.async
    sink = _launch._no_sink(H, q.device) if attn_sink is None else attn_sink.contiguous()
    heads = hopper_ws_small.BLOCK_H.value * cfg.HEAD_GROUPS
    items = R * runtime.cdiv(H, heads)
    # Through the module: one cached SM count for every launcher (and one place to stub it).
    grid = (min(items, _launch._num_compute_units(q.device.index or 0)),)
    bs = cache.block_size
    consts = _constexprs(cfg, bs)
    dense, kv_indptr, per_row = dense_launch(kv_indices, kv_indptr)
    if dense:  # passed only when set: a CSR launch is the kernel it always was
        consts["DENSE_IDS"] = dense
    kwargs = fastlaunch.frozen(**consts, num_warps=4, num_stages=1)
    dst = out
    if out.stride(2) != 1 or out.data_ptr() % 16 or out.stride(0) % 8 or out.stride(1) % 8:
        dst = torch.empty(out.shape, dtype=out.dtype, device=out.device)
    fastlaunch.launcher(hopper_fp8._prefill_ws_small_fp8_kernel)(
        grid,
        (q, cache.kernel_bytes(), kv_indices, kv_indptr, sink, dst, q.stride(0), q.stride(1),
         cache.block_stride, dst.stride(0), dst.stride(1), H, cache.num_slots,
         kv_indices.numel(), float(softmax_scale) * LOG2E, items, bs,
         int(math.log2(bs)) if bs & (bs - 1) == 0 else 0, per_row),
        kwargs,
    )  # fmt: skip
    if dst is not out:
        out.copy_(dst)
    return out


def _compile_setup(name: str, resolve_fn, target: str, num_heads: int, config, index_dtype):
    """The checked launch and the ids' pointer type of a cross-compile of kernel ``name``: the
    target must be one it runs on (the registry's reason otherwise)."""
    t = get_target(target)
    call = dispatch.Call(t.name, num_heads, HEAD_DIM, kv_format=KV_FORMAT)
    why = unavailable(call)
    if why and call.arch is not None:
        raise ValueError(f"{name} cannot compile for {t.name}: {why}")
    return resolve_fn(config, call), "*i64" if index_dtype == torch.int64 else "*i32"


def compile_args(target: str, *, num_heads: int = 16, config=None, index_dtype=torch.int32,
                 block_size: int = 64, dense: bool | int = False, **_ignored):  # fmt: skip
    """(kernel, signature, constexprs, options) to cross-compile the kernel for ``target`` as a
    launch at ``num_heads`` would (:func:`sparse_mla.inspect.compile_kernel`; ``dense``: dense
    [R, K] ids, 2: with the rows' lengths)."""
    cfg, ix = _compile_setup(NAME, resolve, target, num_heads, config, index_dtype)
    sig = {
        "q_ptr": "*bf16", "cache_ptr": "*u8", "idx_ptr": ix, "indptr_ptr": ix,
        "sink_ptr": "*fp32", "out_ptr": "*bf16", "stride_qr": "i32", "stride_qh": "i32",
        "stride_block": "i64", "stride_or": "i32", "stride_oh": "i32", "num_heads": "i32",
        "num_slots": "i32", "nnz": "i32", "qk_scale": "fp32", "num_items": "i32",
        "block_size": "i32", "block_shift": "i32", "ids_per_row": "i32",
    }  # fmt: skip
    consts = _constexprs(cfg, block_size)
    if dense:
        consts["DENSE_IDS"] = dense_ids_value(dense)
    sig.update({k: "constexpr" for k in consts})
    return hopper_fp8._prefill_ws_small_fp8_kernel, sig, consts, {"num_warps": 4, "num_stages": 1}


def _ws_constexprs(cfg: FP8WSConfig, block_size: int) -> dict[str, Any]:
    return {
        "CONSUMER_REGS": cfg.CONSUMER_REGS,
        "PRODUCER_REGS": cfg.PRODUCER_REGS,
        "POW2": block_size & (block_size - 1) == 0,
        "AHEAD": cfg.AHEAD,
    }


def run_ws(q, cache: FP8Cache, kv_indices, kv_indptr, softmax_scale, attn_sink, out, cfg,
           nnz=None):  # fmt: skip
    """Launch ``gluon_ws_fp8`` on validated inputs (T > 0, at least one block; ``kv_indptr``
    None: dense [T, K] ids, read as they are). ``nnz`` plans nothing here (no KV split)."""
    bs = cache.block_size
    _launch._launch_persistent(
        hopper_ws_fp8._prefill_ws_fp8_kernel, hopper_ws.BLOCK_H.value, q, cache.kernel_bytes(),
        kv_indices, kv_indptr, attn_sink, out, softmax_scale, q.device.index or 0,
        out_tma=True, single_direct=True, q_tma=True, constexprs=_ws_constexprs(cfg, bs),
        small_call=hopper_ws.small_call, num_kv=cache.num_slots, stride_kvn=cache.block_stride,
        extra_args=(bs, int(math.log2(bs)) if bs & (bs - 1) == 0 else 0), pos_scale=True,
    )  # fmt: skip
    return out


def compile_args_ws(target: str, *, num_heads: int = 64, config=None, index_dtype=torch.int32,
                    block_size: int = 64, small: bool = False, single: bool = False,
                    dense: bool | int = False, pos_scale: bool = True, **_ignored):  # fmt: skip
    """(kernel, signature, constexprs, options) to cross-compile ``gluon_ws_fp8`` for
    ``target`` as a launch at ``num_heads`` would (``small``: the small-call order;
    ``single``: at most one item a program, O by the consumers' own stores,
    :func:`launch.single_item`; ``dense``: dense [R, K] ids, 2: with the rows' lengths;
    ``pos_scale``: a softmax scale > 0, every model's)."""
    cfg, ix = _compile_setup(WS_NAME, resolve_ws, target, num_heads, config, index_dtype)
    m = hopper_ws
    q_box = [1, m.BLOCK_H.value, m.Q_BLOCK.value]
    out_box = [1, m.BLOCK_H.value, m.OUT_BLOCK.value]
    # One item a program: O by the consumers' own stores (OUT_DIRECT: out's pointer), else by
    # TMA (a descriptor).
    out_sig = "*bf16" if single else f"tensordesc<bf16{out_box},{m.OUT_SMEM.value!r}>"
    sig = {
        "q_desc": f"tensordesc<bf16{q_box},{m.Q_SMEM.value!r}>", "cache_ptr": "*u8",
        "idx_ptr": ix, "indptr_ptr": ix, "sink_ptr": "*fp32", "out": out_sig,
        "stride_qr": "i32", "stride_qh": "i32", "stride_block": "i32", "stride_or": "i32",
        "stride_oh": "i32", "num_heads": "i32", "num_slots": "i32", "nnz": "i32",
        "qk_scale": "fp32", "num_items": "i32", "ids_per_row": "i32", "block_size": "i32",
        "block_shift": "i32",
    }  # fmt: skip
    consts = _ws_constexprs(cfg, block_size)
    consts["SMALL"] = bool(small)
    consts["OUT_DIRECT"] = bool(single)
    if dense:
        consts["DENSE_IDS"] = dense_ids_value(dense)
    if pos_scale:
        consts["POS_SCALE"] = True
    sig.update({k: "constexpr" for k in consts})
    return hopper_ws_fp8._prefill_ws_fp8_kernel, sig, consts, {"num_warps": 4, "num_stages": 1}
