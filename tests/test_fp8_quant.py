"""The MODEL1 FP8 cache: quantize / dequantize against an independently written layout, and
FP8Cache's views and errors (CPU, torch only)."""

from __future__ import annotations

import math

import pytest
import torch

from sparse_mla import FP8Cache
from sparse_mla import fp8 as F


def _e4m3fn_value(code: int) -> float:
    """An OCP e4m3fn byte as a float, from its definition (bias 7, 0x7F/0xFF NaN)."""
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 0x7
    if e == 15 and m == 7:
        return math.nan
    if e == 0:
        return sign * m / 8 * 2.0**-6
    return sign * (1 + m / 8) * 2.0 ** (e - 7)


def _encode_e4m3fn(y: torch.Tensor) -> torch.Tensor:
    """Round |y| <= 448 to the nearest e4m3fn value, ties to the even code; sign from signbit."""
    table = torch.tensor([_e4m3fn_value(c) for c in range(0x7F)], dtype=torch.float64)
    a = y.double().abs().flatten()
    hi = torch.searchsorted(table, a).clamp(max=0x7E)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - table[lo], table[hi] - a
    pick = torch.where(d_lo < d_hi, lo, hi)
    pick = torch.where((d_lo == d_hi) & (lo % 2 == 0), lo, pick)
    sign = torch.signbit(y.flatten()).to(torch.int64) << 7
    return (pick | sign).to(torch.uint8).view(y.shape)


def _expected_bytes(rows: torch.Tensor, block_size: int) -> tuple[torch.Tensor, int]:
    """The whole cache's bytes, written token by token at the offsets DESIGN.md section 9 gives."""
    n = rows.shape[0]
    nb = -(-n // block_size)
    padded = -(-block_size * 584 // 576) * 576
    buf = torch.zeros(nb * padded, dtype=torch.uint8)
    for s in range(nb * block_size):
        b, t = divmod(s, block_size)
        x = rows[s] if s < n else torch.zeros(512, dtype=torch.bfloat16)
        base = b * padded
        for c in range(7):
            tile = x[c * 64 : (c + 1) * 64].float()
            amax = float(tile.abs().max() / 448.0)  # fp32 division, as the reference
            k = math.ceil(math.log2(max(amax, 1e-4)))
            scale = 2.0**k
            assert scale / 2 < max(amax, 1e-4) <= scale
            buf[base + t * 576 + c * 64 : base + t * 576 + (c + 1) * 64] = _encode_e4m3fn(
                tile.double() / scale
            )
            buf[base + block_size * 576 + t * 8 + c] = k + 127
        bits = x[448:].view(torch.int16).to(torch.int32) & 0xFFFF
        off = base + t * 576 + 448
        buf[off : off + 128 : 2] = (bits & 0xFF).to(torch.uint8)  # little-endian bf16
        buf[off + 1 : off + 128 : 2] = (bits >> 8).to(torch.uint8)
    return buf, padded


def _rows(n: int, seed: int) -> torch.Tensor:
    """Rows with tiles at very different magnitudes: tiny (scale clamped at 2^-13), subnormal
    e4m3 values, large values, an all-zero tile, negative zeros."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.randint(-20, 12, (n, 8, 1), generator=g).float())
    x = torch.randn(n, 8, 64, generator=g) * mag
    x[0, 1] = 0.0
    x[-1, 2] = -0.0
    x[n // 2, 3, :8] *= 1e-3  # values far below the tile's amax: e4m3 subnormals
    return x.view(n, 512).bfloat16()


@pytest.mark.parametrize(("n", "block_size"), [(7, 3), (64, 64), (5, 1), (11, 2), (9, 5)])
def test_bytes_equal_an_independent_layout(n, block_size):
    rows = _rows(n, seed=n * 100 + block_size)
    cache = F.quantize(rows, block_size)
    want, padded = _expected_bytes(rows, block_size)
    nb = -(-n // block_size)
    d = cache.data
    assert d.dtype == torch.float8_e4m3fn
    assert tuple(d.shape) == (nb, block_size, 1, 584)
    assert d.stride()[1:] == (584, 584, 1)
    assert nb == 1 or d.stride(0) == padded
    got = d.view(torch.uint8).as_strided((nb * padded,), (1,))
    diff = (got != want).nonzero().flatten()
    assert diff.numel() == 0, f"{diff.numel()} bytes differ, first at {diff[:5].tolist()}"


@pytest.mark.parametrize("block_size", [1, 2, 3, 5, 63, 64, 65, 128, 256])
def test_block_padding(block_size):
    size = F.block_bytes(block_size)
    assert size % 576 == 0 and block_size * 584 <= size < block_size * 584 + 576
    cache = F.quantize(_rows(block_size + 1, seed=block_size), block_size)
    assert cache.num_blocks == 2 and cache.data.stride(0) == size
    # Everything past a block's scales is zero padding.
    tail = cache.data.view(torch.uint8).as_strided((2, size), (size, 1))[:, block_size * 584 :]
    assert not tail.any()


def test_scales_are_powers_of_two_and_round_trip_is_tight():
    rows = _rows(40, seed=3)
    cache = F.quantize(rows, 16)
    raw = cache.as_bytes()
    sc = raw[:, 16 * 576 :].reshape(-1, 16, 8)
    e = sc[..., :7].flatten(0, 1)[:40].to(torch.int64)
    assert not sc[..., 7].any(), "the 8th scale byte is padding"
    assert int(e.min()) >= 127 - 13, "scales are clamped at 2^-13"
    scale = torch.exp2(e.double() - 127)  # [40, 7] powers of two by construction of the byte
    x = rows.double()
    amax = x[:, :448].view(40, 7, 64).abs().amax(-1)
    clamped = scale == 2**-13
    assert torch.all(amax <= 448 * scale) and torch.all((amax > 224 * scale) | clamped)
    assert clamped.any() and (~clamped).any()
    back = F.dequantize(cache)[:40].double()
    assert torch.equal(back[:, 448:], x[:, 448:]), "RoPE is stored as is"
    err = (back[:, :448] - x[:, :448]).abs().view(40, 7, 64)
    # e4m3: 3 mantissa bits (relative error <= 2^-4), subnormal spacing 2^-9 x scale.
    bound = torch.maximum(x[:, :448].view(40, 7, 64).abs() * 2**-4, scale[..., None] * 2**-10)
    assert torch.all(err <= bound)
    assert torch.all(back[:, :448].view(40, 7, 64).abs() <= 448 * scale[..., None])


def test_scale_bytes_sit_at_their_offsets():
    # Give tile c of token s the amax 448 x 2^k(s, c): 7 different scales per token, and a
    # different pattern per token.
    n, bs = 10, 4

    def k(s, c):
        return (7 * s + c) % 20 - 8

    rows = torch.zeros(n, 512)
    for s in range(n):
        for c in range(7):
            rows[s, c * 64 + (s + c) % 64] = 448 * 2.0 ** k(s, c)
    cache = F.quantize(rows.bfloat16(), bs)
    flat = cache.data.view(torch.uint8).as_strided((cache.num_blocks * F.block_bytes(bs),), (1,))
    for s in range(n):
        base = (s // bs) * F.block_bytes(bs) + bs * 576 + (s % bs) * 8
        assert flat[base : base + 7].tolist() == [127 + k(s, c) for c in range(7)]


def test_dequantize_decodes_every_e4m3fn_byte():
    # One block whose NoPE bytes run through all 256 codes, scale 2^0 and 2^3.
    bs = 1
    raw = torch.zeros(1, F.block_bytes(bs), dtype=torch.uint8)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    raw[0, :256] = codes
    raw[0, 256:448] = codes[:192]
    raw[0, 576 : 576 + 7] = torch.tensor([127, 127, 127, 127, 130, 130, 130], dtype=torch.uint8)
    rows = F.dequantize(FP8Cache(raw, bs)).double()[0]
    want = torch.tensor([_e4m3fn_value(c) for c in range(256)], dtype=torch.float64)
    got = torch.cat([rows[:256], rows[256:448] / 8])
    ref = torch.cat([want, want[:192]])
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    ok = ~torch.isnan(ref)
    assert torch.equal(got[ok], ref[ok])


def test_partial_last_block_holds_zero_rows():
    rows = _rows(5, seed=9)
    cache = F.quantize(rows, 4)
    back = F.dequantize(cache)
    assert back.shape == (8, 512)
    assert torch.equal(back[5:], torch.zeros(3, 512, dtype=torch.bfloat16))


def test_views_of_the_same_bytes_agree():
    rows = _rows(12, seed=4)
    cache = F.quantize(rows, 4)
    want = F.dequantize(cache)
    nb, padded = cache.num_blocks, F.block_bytes(4)
    u8 = cache.data.view(torch.uint8)
    full = u8.as_strided((nb, padded), (padded, 1))
    views = [
        u8,  # [nb, bs, 1, 584] uint8
        full,  # [nb, padded bytes]
        full[:, : 4 * 584],  # [nb, bs x 584] with the padded stride
        full.view(torch.float8_e4m3fn),
    ]
    for v in views:
        c = FP8Cache(v, 4)
        assert c.num_slots == 12 and c.block_stride == padded
        assert c.as_bytes().data_ptr() == cache.data.data_ptr(), "no copy"
        assert torch.equal(F.dequantize(c).view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize(
    ("make", "exc", "needle"),
    [
        (lambda d: FP8Cache(d, 0), ValueError, "block_size must be a positive int"),
        (lambda d: FP8Cache(d, True), ValueError, "block_size must be a positive int"),
        (lambda d: FP8Cache(d, 8), ValueError, "block_size 8 does not match"),
        (lambda d: FP8Cache(d.view(torch.uint8)[:, :, :, :576], 4), ValueError, "584"),
        (lambda d: FP8Cache(d.view(torch.uint8).float(), 4), TypeError, "float8_e4m3fn or uint8"),
        (lambda d: FP8Cache(d.view(torch.int8), 4), TypeError, "float8_e4m3fn or uint8"),
        (lambda d: FP8Cache("bytes", 4), TypeError, "must be a tensor"),
        (lambda d: FP8Cache(_flat(d)[:, :2000], 4), ValueError, "too small"),
        (lambda d: FP8Cache(_flat(d), 3), ValueError, "is block_size right"),
        (lambda d: FP8Cache(_strided(), 4), ValueError, "unit last stride"),
        (lambda d: FP8Cache(_flat(d).flatten(), 4), ValueError, "must be \\[num_blocks"),
        (lambda d: FP8Cache(_overlapping(d), 4), ValueError, "blocks would overlap"),
        (lambda d: F.quantize(torch.zeros(3, 512), 4), TypeError, "bfloat16"),
        (lambda d: F.quantize(torch.zeros(3, 576, dtype=torch.bfloat16), 4), ValueError, "512"),
        (lambda d: F.quantize(torch.zeros(3, 512, dtype=torch.bfloat16), 0), ValueError, "block"),
        (lambda d: F.dequantize(d), TypeError, "takes an FP8Cache"),
    ],
)
def test_clear_errors(make, exc, needle):
    d = F.quantize(_rows(12, seed=1), 4).data
    with pytest.raises(exc, match=needle):
        make(d)


def _flat(d: torch.Tensor) -> torch.Tensor:
    padded = d.stride(0)
    return d.view(torch.uint8).as_strided((d.shape[0], padded), (padded, 1))


def _strided() -> torch.Tensor:
    return torch.zeros(3 * 2880 * 2, dtype=torch.uint8).as_strided((3, 2880), (5760, 2))


def _overlapping(d: torch.Tensor) -> torch.Tensor:
    return d.as_strided((3, 4, 1, 584), (1000, 584, 584, 1))
