"""DSv4's FP8 KV cache (FlashMLA's MODEL1 layout): the cache object, quantize and dequantize.

Layout (FlashMLA ``tests/quant.py``, ``MODEL1_FP8Sparse``; DESIGN.md section 9). One token's
row is K = V = [NoPE | RoPE], 512 wide: 448 NoPE values stored as OCP e4m3fn bytes in 7 tiles
of 64, each tile with one ue8m0 scale (a power of two, the byte is its biased exponent), and 64
RoPE values stored as bf16. A block of ``block_size`` tokens is::

    [block_size x 576 bytes: NoPE (448 e4m3fn) | RoPE (64 bf16, 128 bytes)]
    [block_size x   8 bytes: 7 ue8m0 scales + 1 pad byte]
    [pad up to a multiple of 576 bytes]

Slot s is token ``s % block_size`` of block ``s // block_size``; its scale bytes sit at block
base + block_size * 576 + (s % block_size) * 8. FlashMLA returns the cache as a
``[num_blocks, block_size, 1, 584]`` float8_e4m3fn view whose block stride is the padded block
size; :class:`FP8Cache` wraps that tensor (or the same bytes as uint8, or as
``[num_blocks, bytes]``) without copying it.

Quantization (what :func:`quantize` computes, byte for byte the same as FlashMLA's reference
quantizer): per 64-wide NoPE tile, ``amax = max |x|`` (x bf16, taken to fp32),
``scale = 2 ** ceil(log2(max(amax / 448, 1e-4)))`` (the ue8m0 scale, never below 2^-13), then
each value is ``fp8_e4m3fn(x / scale)`` (round to nearest even). Dequantization is
``e4m3fn(byte) * scale``, exact in bf16 (4 significant bits times a power of two).

This module holds only torch code; the kernel that reads the cache is
:mod:`sparse_mla.fp8_prefill`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

__all__ = [
    "BLOCK_ALIGN",
    "D_NOPE",
    "D_ROPE",
    "HEAD_DIM",
    "KV_FORMAT",
    "NUM_TILES",
    "ROW_BYTES",
    "SCALE_BYTES",
    "TILE",
    "TOKEN_BYTES",
    "FP8Cache",
    "block_bytes",
    "dequantize",
    "quantize",
]

D_NOPE = 448  # e4m3fn NoPE values per token
D_ROPE = 64  # bf16 RoPE values per token
HEAD_DIM = D_NOPE + D_ROPE  # 512: the row a kernel uses
TILE = 64  # NoPE values per ue8m0 scale
NUM_TILES = D_NOPE // TILE  # 7
ROW_BYTES = D_NOPE + 2 * D_ROPE  # 576: [NoPE | RoPE] bytes of one token
SCALE_BYTES = NUM_TILES + 1  # 8: 7 scales and one pad byte per token
TOKEN_BYTES = ROW_BYTES + SCALE_BYTES  # 584
BLOCK_ALIGN = 576  # each block is padded to a multiple of this many bytes
FP8_MAX = 448.0  # largest finite e4m3fn value
MIN_SCALE = 1e-4  # amax / 448 is clamped to this before rounding up to a power of two
KV_FORMAT = "fp8_model1"  # the name sparse_mla.dispatch gives this pool format


def block_bytes(block_size: int) -> int:
    """Bytes of one block: block_size x 584, rounded up to a multiple of 576."""
    return -(-block_size * TOKEN_BYTES // BLOCK_ALIGN) * BLOCK_ALIGN


@dataclass(frozen=True)
class FP8Cache:
    """An FP8 KV cache in FlashMLA's MODEL1 layout, over the engine's own tensor (no copy).

    Args:
        data: ``[num_blocks, block_size, 1, 584]`` float8_e4m3fn (or uint8) as FlashMLA returns
            it: each block's bytes contiguous, any block stride >= block_size x 584 bytes (the
            padded block size, usually); or the same bytes as ``[num_blocks, bytes]`` with
            ``bytes`` = block_size x 584 or the padded block size, unit last stride.
        block_size: tokens per block (any positive int).

    Slot s (0 <= s < num_blocks x block_size) is token s % block_size of block s // block_size.
    Pass the cache as ``kv`` to :func:`sparse_mla.sparse_mla_prefill`.
    """

    data: torch.Tensor
    block_size: int
    kv_format: ClassVar[str] = KV_FORMAT

    def __post_init__(self) -> None:
        bs, d = self.block_size, self.data
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
            raise ValueError(f"FP8Cache: block_size must be a positive int, got {bs!r}")
        if not isinstance(d, torch.Tensor):
            raise TypeError(f"FP8Cache: data must be a tensor, got {type(d).__name__}")
        if d.dtype not in (torch.float8_e4m3fn, torch.uint8):
            raise TypeError(
                f"FP8Cache: data must be float8_e4m3fn or uint8 (FlashMLA's MODEL1 bytes), got "
                f"{d.dtype}"
            )
        need = bs * TOKEN_BYTES
        if d.dim() == 4:
            if d.shape[2] != 1 or d.shape[3] != TOKEN_BYTES:
                raise ValueError(
                    f"FP8Cache: data must be [num_blocks, block_size, 1, {TOKEN_BYTES}], got "
                    f"shape {tuple(d.shape)}"
                )
            if d.shape[1] != bs:
                raise ValueError(
                    f"FP8Cache: block_size {bs} does not match data's {d.shape[1]} tokens per "
                    f"block (shape {tuple(d.shape)})"
                )
            inner_ok = d.stride(3) == 1 and (bs == 1 or d.stride(1) == TOKEN_BYTES)
            if d.shape[0] and not inner_ok:
                raise ValueError(
                    f"FP8Cache: each block's bytes must be contiguous (strides (*, "
                    f"{TOKEN_BYTES}, *, 1)), got strides {d.stride()}"
                )
        elif d.dim() == 2:
            if d.shape[1] < need:
                raise ValueError(
                    f"FP8Cache: data of {d.shape[1]} bytes per block is too small for "
                    f"block_size {bs} ({bs} x {TOKEN_BYTES} = {need} bytes)"
                )
            if d.shape[1] not in (need, block_bytes(bs)):
                raise ValueError(
                    f"FP8Cache: {d.shape[1]} bytes per block fit neither block_size {bs}'s "
                    f"{need} bytes nor its padded {block_bytes(bs)}; is block_size right?"
                )
            if d.shape[0] and d.stride(1) != 1:
                raise ValueError(f"FP8Cache: data must have unit last stride, got {d.stride()}")
        else:
            raise ValueError(
                f"FP8Cache: data must be [num_blocks, block_size, 1, {TOKEN_BYTES}] or "
                f"[num_blocks, bytes], got shape {tuple(d.shape)}"
            )
        if d.shape[0] > 1 and d.stride(0) < need:
            raise ValueError(
                f"FP8Cache: data's block stride {d.stride(0)} bytes is smaller than a block "
                f"({need} bytes for block_size {bs}): blocks would overlap"
            )
        if d.shape[0] > 1 and d.stride(0) % 2:
            raise ValueError(
                f"FP8Cache: data's block stride {d.stride(0)} must be even (the RoPE part is bf16)"
            )
        # Under torch.compile's tracing the tensor has no address: the op's kernel
        # (torch.ops.sparse_mla.prefill_fp8) makes the FP8Cache again, and checks it there.
        if d.shape[0] and not torch.compiler.is_compiling() and d.data_ptr() % 2:
            raise ValueError("FP8Cache: data must start 2-byte aligned (the RoPE part is bf16)")

    @property
    def num_blocks(self) -> int:
        return self.data.shape[0]

    @property
    def num_slots(self) -> int:
        """Valid slots: num_blocks x block_size."""
        return self.num_blocks * self.block_size

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def block_stride(self) -> int:
        """Bytes from one block to the next."""
        return self.data.stride(0) if self.num_blocks > 1 else block_bytes(self.block_size)

    def as_bytes(self) -> torch.Tensor:
        """The blocks as a ``[num_blocks, block_size x 584]`` uint8 view (no copy)."""
        d = self.data.view(torch.uint8) if self.data.dtype != torch.uint8 else self.data
        n = self.block_size * TOKEN_BYTES
        return d.as_strided((self.num_blocks, n), (self.block_stride, 1))

    def kernel_bytes(self) -> torch.Tensor:
        """``data`` as uint8, the tensor a kernel's cache pointer gets (its address is the
        first block's; the kernels step blocks by :attr:`block_stride`): ``data`` itself when
        it is uint8, else its uint8 view, made once per cache object (so every launch of a
        call, and the op's plan, see the same object)."""
        d = self.data
        if d.dtype == torch.uint8:
            return d
        t = self.__dict__.get("_kernel_bytes")
        if t is None:
            t = d.view(torch.uint8)
            object.__setattr__(self, "_kernel_bytes", t)  # a cache, not a field
        return t

    def __repr__(self) -> str:
        return (
            f"FP8Cache(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"dtype={self.data.dtype}, device={self.device})"
        )


def _ue8m0_exponent(amax: torch.Tensor) -> torch.Tensor:
    """ceil(log2(max(amax / 448, 1e-4))) as int32, computed exactly from the fp32 bits.

    ``amax / 448`` is an fp32 division (as the reference's); frexp gives x = m * 2^e with m in
    [0.5, 1), so ceil(log2(x)) is e - 1 when m == 0.5 (x a power of two) and e otherwise.
    """
    x = torch.clamp_min(amax.float() / FP8_MAX, MIN_SCALE)
    m, e = torch.frexp(x)
    return torch.where(m == 0.5, e - 1, e).to(torch.int32)


def quantize(kv: torch.Tensor, block_size: int) -> FP8Cache:
    """Quantize bf16 rows into a MODEL1 FP8 cache, byte for byte as FlashMLA's reference does.

    Args:
        kv: [N, 512] (or [N, 1, 512]) bf16 rows, [NoPE 448 | RoPE 64].
        block_size: tokens per block.

    Returns:
        An :class:`FP8Cache` of ceil(N / block_size) blocks whose ``data`` is
        ``[num_blocks, block_size, 1, 584]`` float8_e4m3fn with the padded block stride. Slot s
        holds row s; the last block's slots past N hold quantized zero rows. The 8th scale byte
        and the block padding are zero.
    """
    if not isinstance(kv, torch.Tensor):
        raise TypeError(f"quantize: kv must be a tensor, got {type(kv).__name__}")
    if kv.dim() == 3 and kv.shape[1] == 1:
        kv = kv[:, 0]
    if kv.dim() != 2 or kv.shape[1] != HEAD_DIM:
        raise ValueError(f"quantize: kv must be [N, {HEAD_DIM}], got shape {tuple(kv.shape)}")
    if kv.dtype != torch.bfloat16:
        raise TypeError(f"quantize: kv must be bfloat16 (MODEL1 stores bf16 RoPE), got {kv.dtype}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"quantize: block_size must be a positive int, got {block_size!r}")
    n = kv.shape[0]
    nb = -(-n // block_size)
    rows = torch.zeros(nb * block_size, HEAD_DIM, dtype=torch.bfloat16, device=kv.device)
    rows[:n] = kv
    rows = rows.view(nb, block_size, HEAD_DIM)

    nope = rows[..., :D_NOPE].float().view(nb, block_size, NUM_TILES, TILE)
    exp = _ue8m0_exponent(nope.abs().amax(dim=-1))  # [nb, bs, 7]
    scale = _pow2(exp)
    q = (nope / scale[..., None]).to(torch.float8_e4m3fn).view(torch.uint8)

    out = torch.zeros(nb, block_bytes(block_size), dtype=torch.uint8, device=kv.device)
    body = out[:, : block_size * ROW_BYTES].view(nb, block_size, ROW_BYTES)
    body[..., :D_NOPE] = q.reshape(nb, block_size, D_NOPE)
    body[..., D_NOPE:] = rows[..., D_NOPE:].contiguous().view(torch.uint8)
    scales = out[:, block_size * ROW_BYTES : block_size * TOKEN_BYTES]
    scales = scales.view(nb, block_size, SCALE_BYTES)
    scales[..., :NUM_TILES] = (exp + 127).to(torch.uint8)
    data = out.view(torch.float8_e4m3fn)[:, : block_size * TOKEN_BYTES]
    return FP8Cache(data.view(nb, block_size, 1, TOKEN_BYTES), block_size)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2.0 ** e as fp32, built from its bits (exact), for int32 e in [-149, 127]."""
    normal = (e + 127).clamp(1, 254) << 23
    subnormal = torch.ones_like(e) << (e + 149).clamp(0, 22)
    return torch.where(e >= -126, normal, subnormal).view(torch.float32)


def _ue8m0_value(e: torch.Tensor) -> torch.Tensor:
    """ue8m0 bytes -> fp32 powers of two 2^(e - 127); 255 is NaN."""
    e = e.to(torch.int32)
    x = _pow2(e - 127)
    return torch.where(e == 255, torch.full_like(x, float("nan")), x)


def dequantize(cache: FP8Cache) -> torch.Tensor:
    """The [num_slots, 512] bf16 rows a kernel uses: [e4m3fn NoPE x scale | bf16 RoPE].

    Exact (each NoPE value has 4 significant bits and its scale is a power of two). Row s is
    slot s; every slot of every block is decoded, whatever its bytes hold.
    """
    if not isinstance(cache, FP8Cache):
        raise TypeError(f"dequantize takes an FP8Cache, got {type(cache).__name__}")
    nb, bs = cache.num_blocks, cache.block_size
    raw = cache.as_bytes()
    body = raw[:, : bs * ROW_BYTES].reshape(nb, bs, ROW_BYTES)
    sc = raw[:, bs * ROW_BYTES :].reshape(nb, bs, SCALE_BYTES)[..., :NUM_TILES]
    nope = body[..., :D_NOPE].contiguous().view(torch.float8_e4m3fn).float()
    nope = nope.view(nb, bs, NUM_TILES, TILE) * _ue8m0_value(sc)[..., None]
    out = torch.empty(nb, bs, HEAD_DIM, dtype=torch.bfloat16, device=cache.device)
    out[..., :D_NOPE] = nope.reshape(nb, bs, D_NOPE)
    out[..., D_NOPE:] = body[..., D_NOPE:].contiguous().view(torch.bfloat16)
    return out.view(nb * bs, HEAD_DIM)
