"""Tests of the unified Gluon MLA kernel (sparse_mla.gluon) and the MLA decode reference.

CPU: both modes cross-compile for gfx950 and sm90 (Gluon does not run in the interpreter), the
gfx950 ISA has MFMA and buffer-to-LDS loads and no scratch, resources are reported; the decode
reference matches a naive per-token loop. GPU (``-m gpu``): both modes match the fp32 references.
"""

from __future__ import annotations

import functools
import math
import os
import re
import subprocess
import tempfile

import pytest
import torch
import triton

from sparse_mla import inspect
from sparse_mla.gluon import (
    GluonConfig,
    choose_num_splits,
    compile_args,
    compile_for,
    hopper_ws,
    mla_gluon,
)
from sparse_mla.gluon.launch import (
    KERNELS,
    SmallWSConfig,
    WSConfig,
    default_config,
    get_target,
    resolve_launch,
    why_not,
)
from sparse_mla.reference import error_report, mla_decode_ref, sparse_mla_prefill_ref

# ----------------------------------------------------------------------------------------------
# CPU: cross-compilation
# ----------------------------------------------------------------------------------------------


@functools.cache
def _compiled(mode: str, target: str, num_heads: int):
    return compile_for(mode, target, num_heads=num_heads)


def _amd_resources(asm: str) -> dict[str, int]:
    res = {}
    for key in ("NumVgprs", "NumAgprs", "TotalNumVgprs", "ScratchSize", "Occupancy"):
        m = re.search(rf"; {key}: (\d+)", asm)
        if m:
            res[key] = int(m.group(1))
    return res


def _nvidia_resources(cubin: bytes) -> dict[str, int]:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    return {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text)}


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_gfx950_cross_compile_mfma_buffer_lds_no_scratch(mode):
    k = _compiled(mode, "gfx950", 64)
    asm = k.asm["amdgcn"]
    assert re.search(r"v_mfma_f32_16x16x32_bf16", asm), "no CDNA4 MFMA in the gfx950 ISA"
    assert re.search(r"buffer_load_dwordx4 .* lds", asm), "KV gather is not buffer -> LDS"
    res = _amd_resources(asm)
    assert {"NumVgprs", "TotalNumVgprs", "ScratchSize", "Occupancy"} <= set(res), res
    assert res["ScratchSize"] == 0, f"scratch spills at the shipped launch: {res}"
    assert 0 < res["TotalNumVgprs"] <= 512 and res["Occupancy"] >= 1, res


@pytest.mark.parametrize(
    "mode, kernel, config, instr",
    [
        ("decode", None, None, "mma.sync.aligned.m16n8k16"),
        ("prefill", "gluon_mma", GluonConfig(64, 32, 8), "mma.sync.aligned.m16n8k16"),
        ("prefill", "gluon_wgmma", None, "wgmma.mma_async.sync.aligned.m64n256k16"),
        ("prefill", "gluon_wgmma", GluonConfig(64, 32, 8, num_stages=4),
         "wgmma.mma_async.sync.aligned.m64n256"),
    ],
)  # fmt: skip
def test_sm90_cross_compile_mma_cp_async(mode, kernel, config, instr):
    k = compile_for(mode, "sm90", kernel, num_heads=64, config=config)
    ptx = k.asm["ptx"]
    assert instr in ptx and ".bf16" in ptx, f"no {instr}"
    assert "cp.async" in ptx, "KV gather is not cp.async"
    res = _nvidia_resources(k.asm["cubin"])
    assert 0 < res["REG"] <= 255 and res["LOCAL"] == 0, res
    assert 0 < k.metadata.shared <= 227 * 1024


def test_wgmma_rule():
    sm90, sm80 = get_target("sm90"), get_target("sm80")
    cfg64 = GluonConfig(BLOCK_H=64, BLOCK_K=32, num_warps=8)
    assert why_not("gluon_wgmma", cfg64, sm90, has_pe=False) is None
    assert "prefill" in why_not("gluon_wgmma", cfg64, sm90, has_pe=True)  # decode: shared one
    assert "sm90" in why_not("gluon_wgmma", cfg64, sm80, has_pe=False)  # no wgmma before sm90
    assert "BLOCK_H=64" in why_not("gluon_wgmma", GluonConfig(16, 32, 4), sm90, has_pe=False)
    # A ring too large for shared memory is refused, saying so.
    big = GluonConfig(64, 64, 8, num_stages=3)
    assert "shared memory" in why_not("gluon_wgmma", big, sm90, has_pe=False)
    with pytest.raises(ValueError, match="shared memory"):
        compile_args("prefill", "sm90", "gluon_wgmma", config=big)
    with pytest.raises(ValueError, match="num_stages"):
        GluonConfig(64, 32, 8, num_stages=1).validate()
    # Its default: BLOCK_K 64 x 2 stages; the shared algorithm's default tile is BLOCK_K 32.
    pre = resolve_launch("gluon_wgmma", None, 128, sm90)
    assert (pre.BLOCK_H, pre.BLOCK_K, pre.num_stages) == (64, 64, 2)
    assert why_not("gluon_wgmma", pre, sm90, has_pe=False) is None
    assert default_config(128, sm90, has_pe=True).BLOCK_K == 32
    assert resolve_launch("gluon_mma", None, 128, get_target("gfx950")).BLOCK_K == 32


def test_sm90_ws_prefill_compile_partitions_and_budget():
    """The 64-heads-on-M warp-specialised kernel (gluon_ws; config=None runs it above 32 heads,
    above 64 below 128 tokens: dispatch.RULE): 64x64 wgmma for S, 64x256 for O, 16-byte
    cp.async gathers that arrive on mbarriers, three partitions whose registers fit the SM's
    file, and Q + the two KV tiles + P within the 227 KiB limit."""
    from sparse_mla import inspect

    k = compile_for(
        "prefill", "sm90", "gluon_ws", num_heads=128, index_dtype=torch.int64, has_sink=False
    )
    assert k.metadata.name == "_prefill_ws_kernel" and k.metadata.num_warps == 12
    ptx = k.asm["ptx"]
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in ptx
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16" in ptx
    # a short last tile: consumer 1's S over 16 slots (hopper_ws.TAIL)
    assert "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16" in ptx
    sizes = set(re.findall(r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], (\w+)", ptx))
    assert sizes == {"0x10"}, f"gathers are not all 16-byte copies: {sizes}"
    assert "cp.async.mbarrier.arrive.noinc" in ptx
    res = inspect.resources_of(k, "sm90")
    assert res.partitions is not None and [p[0] for p in res.partitions] == [
        "default",
        "worker 0",
        "worker 1",
    ], res.partitions
    assert [p[1] for p in res.partitions] == [4, 4, 4]
    assert sum(w * 32 * r for _, w, r in res.partitions) <= 65536, res.partitions
    assert min(r for _, _, r in res.partitions[:2]) >= 224, "consumers hold a 64x256 fp32 O"
    assert res.local_bytes == 0 and res.stack_bytes <= 16, res
    assert res.shared_bytes <= 227 * 1024
    # A plain kernel has no partitions.
    assert (
        inspect.resources_of(compile_for("decode", "sm90", num_heads=16), "sm90").partitions is None
    )


@pytest.mark.parametrize("ix", ["int32", "int64"])
def test_sm90_ws_consumers_mask_from_the_published_ids(ix):
    """gluon_ws's consumers mask S from the slot ids the producer publishes with each tile
    (PERF_NOTES "No cliffs" step 14), not by reloading kv_indices: a consumer's only global
    loads are its items' kv_indptr pair and the sink logits (4 each; consumer 0 had 36 with
    the reload, f53f744), and the ready barriers of a tile's first half (0L, 1R) take
    the producer's one extra arrival that releases them (129 = 128 cp.async lanes + 1)."""
    name, res = inspect.compile_kernel("gluon_ws", "sm90", num_heads=64, index_dtype=ix)
    assert name == "gluon_ws"
    loads = inspect.partition_counts(res.isa, r"\bLDG\b")
    consumer0, consumer1, producer = (r for _, _, r in res.resources.partitions)
    assert loads.get(consumer0, 0) <= 4 and loads.get(consumer1, 0) <= 4, loads
    assert loads.get(producer, 0) >= 8, loads  # the ids of both tiles and each item's range
    counts = re.findall(r"mbarrier\.init\.shared::cta\.b64 \[[^]]+\], (\d+);", res.asm["ptx"])
    assert sorted(map(int, counts)) == [1, 1, 1, 1, 1, 2, 128, 128, 129, 129], counts
    # The FP8 twin's producer keeps no registers for the stores: its consumers reload.
    _, fp8 = inspect.compile_kernel("gluon_ws_fp8", "sm90", num_heads=64, index_dtype=ix)
    c0, c1, _ = (r for _, _, r in fp8.resources.partitions)
    fp8_loads = inspect.partition_counts(fp8.isa, r"\bLDG\b")
    assert fp8_loads.get(c0, 0) > 8 and fp8_loads.get(c1, 0) > 8, fp8_loads


def test_sm90_ws_skips_the_o_rescale_by_warp():
    """Step 15: each consumer's O rescale (128 multiplies a thread) sits behind a warp vote on
    alpha != 1 and a branch around it, in both consumers and the short-tail path (3 sites),
    in place (no register moves for the skipped side: the SASS has 128 FMULs between each
    branch and its target), with no spills; gluon_ws_fp8 shares the consumers."""
    for kernel in ("gluon_ws", "gluon_ws_fp8"):
        _, res = inspect.compile_kernel(kernel, "sm90", num_heads=64, index_dtype="int32")
        assert res.asm["ptx"].count("vote.sync.any.pred") == 3, kernel
        assert inspect.partition_counts(res.isa, "STL") == {}, kernel
        lines = res.isa.splitlines()
        votes = [i for i, ln in enumerate(lines) if "VOTE.ANY" in ln]
        assert len(votes) == 3, (kernel, len(votes))
        for v in votes:
            i = next(j for j in range(v, v + 12) if " BRA " in lines[j])
            m = re.search(r"@!P\d BRA (0x[0-9a-f]+)", lines[i])
            assert m, (kernel, lines[i])  # the vote's branch skips when no row moved
            end = next(
                j for j in range(i, len(lines)) if f"/*{int(m.group(1), 16):04x}*/" in lines[j]
            )
            skipped = lines[i + 1 : end]
            assert sum("FMUL" in ln for ln in skipped) == 128, (kernel, v)
            assert not any(re.search(r"\bMOV\b", ln) for ln in skipped), (kernel, v)


SMALL = SmallWSConfig(HEAD_GROUPS=1)


def test_sm90_ws_small_compile_partitions_and_budget():
    """The heads-on-N kernel (gluon_ws_small) with one head group (H <= 16; two serve up to 32
    heads): heads on wgmma's N (m64n16k16 for
    S^T and O^T), 16-byte cp.async gathers on mbarriers, a consumer and a producer within the
    register file, a 3-tile ring within 227 KiB, no spills."""
    from sparse_mla import inspect

    k = compile_for(
        "prefill", "sm90", "gluon_ws_small", num_heads=16, config=SMALL, index_dtype=torch.int64
    )
    assert k.metadata.name == "_prefill_ws_small_kernel" and k.metadata.num_warps == 8
    ptx = k.asm["ptx"]
    n_mma = ptx.count("wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16")
    # S^T: 512 / 16 k-steps; O^T: 512 / 64 row blocks x 64 / 16 k-steps.
    assert n_mma == 512 // 16 + (512 // 64) * (64 // 16), n_mma
    sizes = set(re.findall(r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], (\w+)", ptx))
    assert sizes == {"0x10"}, sizes
    assert "cp.async.mbarrier.arrive.noinc" in ptx
    res = inspect.resources_of(k, "sm90")
    assert [(p[0], p[1]) for p in res.partitions] == [("default", 4), ("worker 0", 4)]
    assert sum(w * 32 * r for _, w, r in res.partitions) <= 65536, res.partitions
    assert res.local_bytes == 0 and res.stack_bytes == 0, res
    assert 3 * 64 * 512 * 2 < res.shared_bytes <= 227 * 1024


@pytest.mark.parametrize("name,heads", [("gluon_ws", 64), ("gluon_ws_small", 16),
                                        ("gluon_ws_small", 32)])  # fmt: skip
def test_sm90_ws_small_call_order_prefetches_the_ids(name, heads):
    """The small-call order (``SMALL``, set from the kernel module's ``small_call``) of both
    warp-specialised kernels: the producer asks L2 for its program's ids (256 prefetches a
    program, 2 a lane); the large-call kernel has none; no spills either way."""
    from sparse_mla import inspect
    from sparse_mla.gluon import hopper_ws, hopper_ws_small

    module = {"gluon_ws": hopper_ws, "gluon_ws_small": hopper_ws_small}[name]
    assert module.small_call is hopper_ws.small_call  # what the launcher calls (getattr)
    for small in (True, False):
        k = compile_for("prefill", "sm90", name, num_heads=heads, small=small)
        n = k.asm["ptx"].count("prefetch.global.L2")
        assert n == (2 if small else 0), (small, n)
        res = inspect.resources_of(k, "sm90")
        assert res.local_bytes == 0, (small, res)


def test_ws_small_rule():
    sm90 = get_target("sm90")
    assert why_not("gluon_ws_small", SMALL, sm90, has_pe=False) is None
    # Its default takes one head group per 16 heads (two up to 32 heads when built with two).
    for h in (1, 8, 16):
        assert resolve_launch("gluon_ws_small", None, h, sm90) == SmallWSConfig(1)
    for h in (17, 24, 32):
        assert resolve_launch("gluon_ws_small", None, h, sm90) == SmallWSConfig(2)
    assert KERNELS["gluon_ws_small"].knobs["HEAD_GROUPS"] == (1, 2)
    # One split, no LSE, prefill only, sm90 only, its own config type.
    assert "one KV split" in why_not("gluon_ws_small", SMALL, sm90, has_pe=False, num_splits=2)
    assert "LSE" in why_not("gluon_ws_small", SMALL, sm90, has_pe=False, write_lse=True)
    assert "prefill" in why_not("gluon_ws_small", SMALL, sm90, has_pe=True)
    assert "sm90" in why_not("gluon_ws_small", SMALL, get_target("gfx950"), has_pe=False)
    assert "SmallWSConfig" in why_not("gluon_ws_small", GluonConfig(16, 64, 4), sm90,
                                      has_pe=False)  # fmt: skip
    with pytest.raises(ValueError, match="HEAD_GROUPS"):
        resolve_launch("gluon_ws_small", {"HEAD_GROUPS": 3}, 16, sm90)
    with pytest.raises(ValueError, match="HEAD_GROUPS"):
        resolve_launch("gluon_ws_small", {"HEAD_GROUPS": True}, 16, sm90)
    with pytest.raises(ValueError, match="SmallWSConfig fields"):
        resolve_launch("gluon_ws_small", {"BLOCK_H": 16}, 16, sm90)


def test_ws_rule():
    sm90 = get_target("sm90")
    cfg = resolve_launch("gluon_ws", None, 64, sm90)
    assert cfg == WSConfig()
    assert why_not("gluon_ws", cfg, sm90, has_pe=False) is None
    # it splits lists (partials and a reduce step), but writes no LSE; gluon_ws_small does neither
    assert why_not("gluon_ws", cfg, sm90, has_pe=False, num_splits=2) is None
    assert why_not("gluon_ws", cfg, sm90, has_pe=False, write_lse=True) is not None
    small = resolve_launch("gluon_ws_small", None, 16, sm90)
    assert why_not("gluon_ws_small", small, sm90, has_pe=False, num_splits=2) is not None
    assert why_not("gluon_ws", cfg, sm90, has_pe=True) is not None  # decode
    assert why_not("gluon_ws", cfg, get_target("gfx950"), has_pe=False) is not None
    with pytest.raises(TypeError, match="WSConfig"):
        resolve_launch("gluon_ws", GluonConfig(64, 64, 8), 64, sm90)
    with pytest.raises(ValueError, match="unknown"):
        resolve_launch("gluon", None, 64, sm90)


def test_every_gluon_kernel_names_its_modes_targets_and_default():
    """Each Gluon kernel compiles its default launch for each target and mode it says it
    serves, and refuses (saying why) the ones it does not."""
    for name, spec in KERNELS.items():
        for target in ("sm90", "gfx950"):
            tgt = get_target(target)
            for mode in ("decode", "prefill"):
                cfg = resolve_launch(name, None, 64, tgt)
                why = why_not(name, cfg, tgt, has_pe=mode == "decode",
                              write_lse=mode == "decode")  # fmt: skip
                served = target in spec.targets and mode in spec.modes
                assert (why is None) == served, (name, target, mode, why)
                if not served:
                    with pytest.raises(ValueError, match="cannot compile"):
                        compile_args(mode, target, name)


def test_compile_args_shapes_and_errors():
    kernel, sig, cx, opts = compile_args("decode", "sm90", num_heads=16)
    assert cx["HAS_PE"] is True and cx["BLOCK_H"] == 16 and opts["num_warps"] == 4
    assert set(kernel.arg_names) == set(sig)
    assert all(sig[k] == "constexpr" for k in cx)
    _, _, cx, _ = compile_args("prefill", "gfx950", num_heads=128, index_dtype=torch.int64)
    assert cx["HAS_PE"] is False and cx["ARCH"] == "cdna4" and cx["BLOCK_H"] == 64
    with pytest.raises(ValueError, match="target"):
        compile_args("decode", "gfx942")
    with pytest.raises(ValueError, match="mode"):
        compile_args("encode", "sm90")
    with pytest.raises(ValueError, match="unknown"):
        compile_args("decode", "sm90", heads=3)


def test_split_rule():
    cfg = GluonConfig(BLOCK_H=16, BLOCK_K=32, num_warps=4)
    # A full grid needs no split.
    assert choose_num_splits(200, 16, 200 * 4096, cfg, 132) == 1
    # 4 requests x 1 head block: split to fill 132 SMs, capped at 16.
    assert choose_num_splits(4, 16, 4 * 8192, cfg, 132) == 16
    # Short rows: at least 2 tiles (64 slots) per split.
    assert choose_num_splits(4, 16, 4 * 200, cfg, 132) == 3
    assert choose_num_splits(4, 16, 4 * 10, cfg, 132) == 1
    # Without per_unit (AMD): cover the CUs once, rounded up (32 programs: 5 splits).
    assert choose_num_splits(32, 16, 32 * 8192, cfg, 132) == 5
    assert choose_num_splits(67, 16, 67 * 8192, cfg, 132) == 2
    # One wave of program slots: one program an SM, 32 programs take 4 splits (128), not 5
    # (160: a second wave of 28); 67-131 programs take none (two splits would be two waves of
    # half the work). Two an SM: 264 slots.
    wg = GluonConfig(BLOCK_H=64, BLOCK_K=64, num_warps=8)
    assert choose_num_splits(16, 128, 16 * 1152, wg, 132, 1) == 4
    assert choose_num_splits(67, 16, 67 * 8192, cfg, 132, 1) == 1
    assert choose_num_splits(66, 16, 66 * 8192, cfg, 132, 1) == 2
    assert choose_num_splits(64, 16, 64 * 640, cfg, 132, 2) == 4
    assert choose_num_splits(200, 16, 200 * 4096, cfg, 132, 2) == 1


def test_ws_split_rule():
    """gluon_ws splits only calls whose items (rows x 64-head blocks) fill at most half the
    SMs, into pieces of whole pairs of tiles of the average list rounded up, one wave, none
    empty, and only when a piece is at least 6 tiles shorter than the list (4 tiles for at
    most 4 items)."""
    from sparse_mla.gluon.launch import ws_num_splits

    # Whole DSv4 lists (640 slots: 5 pairs) at 64 heads: T = 4 and 16 take 5 pieces of a pair
    assert ws_num_splits(4, 64, 4 * 640, 132) == 5
    assert ws_num_splits(16, 64, 16 * 640, 132) == 5
    # T = 32: 4 fit, 4 pieces would be 2, 2, 1, 0 pairs: 3 pieces (saving 6 tiles)
    assert ws_num_splits(32, 64, 32 * 640, 132) == 3
    # T = 64 (64 items): 2 pieces of 3 and 2 pairs save 4 tiles only
    assert ws_num_splits(64, 64, 64 * 640, 132) == 1
    # 128 heads, 1152 slots (9 pairs), 32 items: 4 fit, 4 pieces would be 3, 3, 3, 0 pairs
    assert ws_num_splits(16, 128, 16 * 1152, 132) == 3
    # 33 x 2 items split in two (5 + 4 pairs: 8 tiles saved), 34 x 2 do not (past half the SMs)
    assert ws_num_splits(33, 128, 33 * 1152, 132) == 2
    assert ws_num_splits(34, 128, 34 * 1152, 132) == 1
    # middling lists (384 slots, 3 pairs) save at most 4 tiles: split only for at most 4 items
    assert ws_num_splits(4, 64, 4 * 384, 132) == 3
    assert ws_num_splits(2, 128, 2 * 384, 132) == 3
    assert ws_num_splits(8, 64, 8 * 384, 132) == 1
    assert ws_num_splits(4, 64, 4 * 256, 132) == 1  # 2 tiles saved
    assert ws_num_splits(4, 64, 4 * 128, 132) == 1
    # one list a slot longer than the others: 4 pairs for it, so 4 pieces of one pair
    assert ws_num_splits(8, 64, 8 * 384 + 1, 132) == 4
    assert ws_num_splits(4, 64, 4 * 640 + 3, 132) == 6
    # long lists: at most MAX_SPLITS, and no empty piece (64 pairs over 16 pieces of 4)
    assert ws_num_splits(1, 64, 8192, 132) == 16
    assert ws_num_splits(1, 64, 9000, 132) == 15  # 71 pairs: 15 pieces of 5
    assert ws_num_splits(0, 64, 0, 132) == 1


def test_split_plan_trades_gluon_mma_own_blocks_only_while_16_head_programs_are_few():
    """launch.split_plan, what the run and the bench's num_kv_splits column both follow."""
    from sparse_mla.gluon import launch

    sm90, gfx = launch.get_target("sm90"), launch.get_target("gfx950")
    own64 = launch.resolve_launch("gluon_mma", None, 64, sm90)
    assert own64.BLOCK_H == 64
    # H64 T=4 whole lists: 4 programs of 64 heads would split; 16 programs of 16 heads
    # (<= SPLIT_TRADE_PROGRAMS) take the trade, with their own split count (two an SM)
    cfg, splits = launch.split_plan("gluon_mma", own64, 4, 64, 4 * 640, sm90, 132, own_launch=True)
    assert cfg is launch.SPLIT_CONFIG
    assert splits == choose_num_splits(4, 64, 4 * 640, launch.SPLIT_CONFIG, 132, 2) == 10
    # A launch the caller gave (not the kernel's own object), a PE call, AMD, or the other
    # split kernel: no trade, the launch's own count
    for name, c, kw, tgt in (
        ("gluon_mma", own64, {"own_launch": False}, sm90),
        ("gluon_mma", own64, {"own_launch": True, "has_pe": True}, sm90),
        ("gluon_mma", launch.resolve_launch("gluon_mma", None, 64, gfx), {"own_launch": True}, gfx),
        ("gluon_wgmma", launch.resolve_launch("gluon_wgmma", None, 64, sm90),
         {"own_launch": True}, sm90),
    ):  # fmt: skip
        got, n = launch.split_plan(name, c, 4, 64, 4 * 640, tgt, 132, **kw)
        assert got is c
        assert n == choose_num_splits(4, 64, 4 * 640, c, 132, launch.programs_per_sm(c, tgt))
    # H128 T=4: 32 programs of 16 heads, more than SPLIT_TRADE_PROGRAMS: 64-head blocks stay
    own128 = launch.resolve_launch("gluon_mma", None, 128, sm90)
    got, n = launch.split_plan("gluon_mma", own128, 4, 128, 4 * 1152, sm90, 132, own_launch=True)
    assert got is own128 and n == choose_num_splits(4, 128, 4 * 1152, own128, 132, 1) > 1
    # 32-head defaults trade at any program count that still splits (H32 T=16: 32 programs)
    own32 = launch.resolve_launch("gluon_mma", None, 32, sm90)
    got, n = launch.split_plan("gluon_mma", own32, 16, 32, 16 * 640, sm90, 132, own_launch=True)
    assert own32.BLOCK_H == 32 and got is launch.SPLIT_CONFIG and n > 1
    # A call that fills the GPU does not split, and keeps its launch
    got, n = launch.split_plan("gluon_mma", own64, 1024, 64, 1024 * 640, sm90, 132,
                               own_launch=True)  # fmt: skip
    assert (got, n) == (own64, 1)
    # gluon_ws: its own launch with ws_num_splits' count
    ws = launch.resolve_launch("gluon_ws", None, 64, sm90)
    assert launch.split_plan("gluon_ws", ws, 4, 64, 4 * 640, sm90, 132, own_launch=True) == (ws, 5)
    # call_splits: the same from a choice's launch (None or the default object: the kernel's
    # own, which gluon_mma may trade; a config given keeps its blocks); 1 for a kernel that
    # never splits
    sm = launch.call_splits
    assert sm("gluon_mma", None, 4, 64, 4 * 640, sm90, 132)[0] is launch.SPLIT_CONFIG
    assert sm("gluon_mma", own64, 4, 64, 4 * 640, sm90, 132)[0] is launch.SPLIT_CONFIG
    given = launch.GluonConfig(BLOCK_H=64, BLOCK_K=32, num_warps=8)
    assert sm("gluon_mma", given, 4, 64, 4 * 640, sm90, 132)[0] is given
    assert sm("gluon_ws", ws, 4, 64, 4 * 640, sm90, 132) == (ws, 5)
    small = launch.resolve_launch("gluon_ws_small", None, 16, sm90)
    assert sm("gluon_ws_small", small, 4, 16, 4 * 640, sm90, 132) == (small, 1)


@pytest.mark.parametrize("name, heads", [("gluon_mma", 1), ("gluon_mma", 32), ("gluon_mma", 64),
                                         ("gluon_wgmma", 128)])  # fmt: skip
def test_programs_per_sm_is_the_compiled_occupancy(name, heads):
    """The split rule's programs an SM (launch.programs_per_sm) is what the sm90 build of each
    split kernel's default launch allows (registers and shared memory), and of the 16-head
    blocks gluon_mma trades to (its default at one head)."""
    from sparse_mla import inspect
    from sparse_mla.gluon import launch

    _, res = inspect.compile_kernel(name, "sm90", num_heads=heads)
    sm90 = launch.get_target("sm90")
    cfg = launch.resolve_launch(name, None, heads, sm90)
    assert res.resources.warps_per_sm // cfg.num_warps == launch.programs_per_sm(cfg, sm90)
    assert launch.programs_per_sm(cfg, launch.get_target("gfx950")) is None


# ----------------------------------------------------------------------------------------------
# CPU: input validation (nothing launches)
# ----------------------------------------------------------------------------------------------


def _decode_inputs(B, H, N, nnz, device="cpu", dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    q_nope = torch.randn(B, H, 512, generator=g).to(device=device, dtype=dtype)
    q_pe = torch.randn(B, H, 64, generator=g).to(device=device, dtype=dtype)
    kv_c = torch.randn(N, 512, generator=g).to(device=device, dtype=dtype)
    k_pe = torch.randn(N, 64, generator=g).to(device=device, dtype=dtype)
    idx = torch.randint(0, N, (nnz,), generator=g, dtype=torch.int32).to(device)
    indptr = torch.linspace(0, nnz, B + 1).round().to(torch.int32).to(device)
    return q_nope, q_pe, kv_c, k_pe, idx, indptr


def test_validation_errors_name_the_argument():
    q_nope, q_pe, kv_c, k_pe, idx, indptr = _decode_inputs(2, 16, 8, 6)
    with pytest.raises(TypeError, match="kv_c"):
        mla_gluon(q_nope, q_pe, kv_c.half(), k_pe, idx, indptr, 0.1)
    with pytest.raises(ValueError, match="q_pe"):
        mla_gluon(q_nope, q_pe[:, :, :32], kv_c, k_pe, idx, indptr, 0.1)
    with pytest.raises(ValueError, match="kv_indptr"):
        mla_gluon(q_nope, q_pe, kv_c, k_pe, idx, indptr[:-1], 0.1)
    with pytest.raises(TypeError, match="kv_indices"):
        mla_gluon(q_nope, q_pe, kv_c, k_pe, idx.float(), indptr, 0.1)
    with pytest.raises(ValueError, match="attn_sink"):
        mla_gluon(q_nope, q_pe, kv_c, k_pe, idx, indptr, 0.1, attn_sink=torch.zeros(3))
    with pytest.raises(ValueError, match="has_pe=False"):
        mla_gluon(q_nope, q_pe, kv_c, k_pe, idx, indptr, 0.1, has_pe=False)
    with pytest.raises(RuntimeError, match="GPU"):
        mla_gluon(q_nope, q_pe, kv_c, k_pe, idx, indptr, 0.1)


def test_prefill_validation_is_the_shared_one():
    # The Gluon entry runs sparse_mla.validation.validate_inputs as the Triton entry does:
    # the same checks on kv_indptr's values, the scale and out, before it asks for a GPU.
    from sparse_mla import sparse_mla_prefill

    q, _, _, _, idx, indptr = _decode_inputs(3, 16, 8, 6)
    buf = torch.randn(8 + 48, 512).to(q.dtype)
    kv, out_on_kv = buf[:8], buf[7:55].view(3, 16, 512)
    bad_ptr = torch.tensor([0, 4, 2, 6], dtype=torch.int32)

    def gluon(ptr=indptr, scale=0.1, **kw):
        return mla_gluon(q, None, kv, None, idx, ptr, scale, has_pe=False, **kw)

    def triton_(ptr=indptr, scale=0.1, **kw):
        return sparse_mla_prefill(q, kv, idx, ptr, scale, **kw)

    for call in (gluon, triton_):
        with pytest.raises(ValueError, match="kv_indptr must be non-decreasing"):
            call(ptr=bad_ptr)
        with pytest.raises(ValueError, match="overflows fp32"):
            call(scale=1e39)
        with pytest.raises(ValueError, match="out overlaps kv"):
            call(out=out_on_kv)
    # A strided sink passes validation (then Gluon needs its GPU).
    sinks = torch.zeros(16, 4)
    with pytest.raises(RuntimeError, match="GPU"):
        gluon(attn_sink=sinks[:, 2])
    for bad in (GluonConfig(num_warps=4.0), GluonConfig(BLOCK_K=True), GluonConfig(BLOCK_H=48)):
        with pytest.raises(ValueError, match="config"):
            gluon(config=bad)
    with pytest.raises(TypeError, match="GluonConfig"):
        gluon(config=SmallWSConfig(1))  # another kernel's config
    with pytest.raises(ValueError, match="GluonConfig fields"):
        gluon(config={"BLOCK_Q": 16})
    with pytest.raises(ValueError, match="unknown"):
        gluon(kernel="gluon")
    misaligned = torch.empty(9 * 512 + 1, dtype=q.dtype)[1:].view(9, 512)
    with pytest.raises(ValueError, match="16-byte aligned"):
        mla_gluon(q, None, misaligned, None, idx, indptr, 0.1, has_pe=False)


# ----------------------------------------------------------------------------------------------
# CPU: the decode reference against a naive per-token loop
# ----------------------------------------------------------------------------------------------


def _naive_decode(q_nope, q_pe, kv_c, k_pe, idx, indptr, scale, sink):
    B, H, D = q_nope.shape
    N = kv_c.shape[0]
    out = torch.zeros(B, H, D, dtype=torch.float64)
    lse = torch.full((B, H), -math.inf, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            logits, rows = [], []
            for j in range(int(indptr[b]), int(indptr[b + 1])):
                s = int(idx[j])
                if 0 <= s < N:
                    c = kv_c[s].double()
                    logit = q_nope[b, h].double() @ c + q_pe[b, h].double() @ k_pe[s].double()
                    logits.append(logit * scale)
                    rows.append(c)
            terms = list(logits) + ([float(sink[h])] if sink is not None else [])
            if not terms:
                continue
            m = max(float(t) for t in terms)
            den = sum(math.exp(float(t) - m) for t in terms)
            lse[b, h] = m + math.log(den)
            for logit, c in zip(logits, rows, strict=True):
                out[b, h] += math.exp(float(logit) - m) / den * c
    return out, lse


@pytest.mark.parametrize("with_sink", [False, True])
def test_mla_decode_ref_matches_naive_loop(with_sink):
    g = torch.Generator().manual_seed(1)
    B, H, N = 4, 3, 10
    q_nope = torch.randn(B, H, 512, generator=g)
    q_pe = torch.randn(B, H, 64, generator=g)
    kv_c = torch.randn(N, 512, generator=g)
    k_pe = torch.randn(N, 64, generator=g)
    kv_c[7] = float("nan")  # an unreferenced row: must not reach the output
    idx = torch.tensor([0, 3, -1, 9, N, 2**31 - 1, 5, 5, 1, -1], dtype=torch.int64)
    indptr = torch.tensor([0, 4, 4, 7, 10])  # request 1 is empty, request 3 has one invalid
    sink = torch.randn(H, generator=g) if with_sink else None
    out, lse = mla_decode_ref(
        q_nope, q_pe, kv_c, k_pe, idx, indptr, 0.07, attn_sink=sink, return_lse=True
    )
    ref_out, ref_lse = _naive_decode(q_nope, q_pe, kv_c, k_pe, idx, indptr, 0.07, sink)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    assert torch.all(out[1] == 0)


# ----------------------------------------------------------------------------------------------
# GPU: numerics against the fp32 references
# ----------------------------------------------------------------------------------------------

INVALID = (-1, "N", 2**31 - 1)


def _gpu_case(R, H, N, *, has_pe, index_dtype, seed, max_len=300, lengths=None):
    """Random bf16 inputs in engine style: pool inside a bigger NaN-filled buffer, every pool row
    that no valid slot references set to NaN, ragged and empty rows, invalid slots mixed in.
    ``lengths``: the rows' list lengths (rows 0 and 2 are still made empty / all absent)."""
    dev = "cuda"
    g = torch.Generator(device="cpu").manual_seed(seed)
    if lengths is None:
        lengths = torch.randint(0, max_len, (R,), generator=g)
    else:
        lengths = torch.tensor(lengths, dtype=torch.int64)
    lengths[0] = 0  # an empty row
    if R > 2:
        lengths[2] = 5  # a row of only invalid slots (set below)
    indptr = torch.zeros(R + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(lengths, 0)
    nnz = int(indptr[-1])
    idx = torch.randint(0, N, (nnz,), generator=g, dtype=torch.int64)
    bad = torch.rand(nnz, generator=g) < 0.1
    big = 2**40 if index_dtype == torch.int64 else 2**31 - 1
    choices = torch.tensor([-1, N, big], dtype=torch.int64)
    idx[bad] = choices[torch.randint(0, 3, (int(bad.sum()),), generator=g)]
    if R > 2:
        idx[indptr[2] : indptr[3]] = torch.tensor([-1, N, big, -1, N])
    pad = 64
    buf = torch.full((N + 2 * pad, 512 + 64), float("nan"), dtype=torch.bfloat16)
    pool = torch.randn(N, 512 + 64, generator=g).to(torch.bfloat16)
    used = torch.zeros(N, dtype=torch.bool)
    valid = (idx >= 0) & (idx < N)
    used[idx[valid]] = True
    pool[~used] = float("nan")
    buf[pad : pad + N] = pool
    buf = buf.to(dev)
    kv_c = buf[pad : pad + N, :512]  # row stride 576: a view into a larger buffer
    k_pe = buf[pad : pad + N, 512:]
    q = torch.randn(R, H, 512 + 64, generator=g).to(torch.bfloat16).to(dev)
    q_nope, q_pe = q[..., :512], q[..., 512:]
    return dict(
        q_nope=q_nope,
        q_pe=q_pe if has_pe else None,
        kv_c=kv_c,
        k_pe=k_pe if has_pe else None,
        kv_indices=idx.to(index_dtype).to(dev),
        kv_indptr=indptr.to(torch.int32).to(dev),
    )


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("H", [16, 64, 128])
@pytest.mark.parametrize("splits", [1, 4, None])
@pytest.mark.parametrize("with_sink", [False, True])
def test_gpu_decode_matches_reference(H, splits, with_sink):
    c = _gpu_case(6, H, 3000, has_pe=True, index_dtype=torch.int32, seed=H + 7 * (splits or 0))
    sink = _gpu_sink(H, H + 7 * (splits or 0)) if with_sink else None
    scale = (512 + 64) ** -0.5
    out = torch.full((6, H, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    res, lse = mla_gluon(
        **c, sm_scale=scale, attn_sink=sink, out=out, num_kv_splits=splits, return_lse=True
    )
    assert res is out
    args = [c[k] for k in ("q_nope", "q_pe", "kv_c", "k_pe", "kv_indices", "kv_indptr")]
    ref, ref_lse = mla_decode_ref(*args, scale, attn_sink=sink, return_lse=True)
    base = mla_decode_ref(*args, scale, attn_sink=sink, upcast=False)
    rep = error_report(out.float(), ref, base.float())
    assert rep.ok, str(rep)
    assert torch.all(out[0] == 0) and torch.all(out[2] == 0), "empty rows must be zeros"
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=1e-3)


def _gpu_sink(H, seed):
    """[H] fp32 sink logits on the GPU, drawn from ``seed`` (a test's case is reproducible; the
    global generator's state depends on which tests ran before in the worker)."""
    return torch.randn(H, generator=torch.Generator().manual_seed(10_000 + seed)).cuda()


def _check_prefill(c, sink, *, entry=None, **launch):
    """Run the Gluon prefill (or ``entry``: the package's ``sparse_mla_prefill``) into a
    NaN-poisoned output and check it against the fp32 reference (2x rule); rows 0 and 2 of
    ``_gpu_case`` are empty and must come out zero."""
    scale = 512**-0.5
    out = torch.full(c["q_nope"].shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    args = (c["q_nope"], c["kv_c"], c["kv_indices"], c["kv_indptr"], scale)
    if entry is None:
        mla_gluon(**c, sm_scale=scale, has_pe=False, attn_sink=sink, out=out, **launch)
    else:
        entry(*args, attn_sink=sink, out=out, **launch)
    ref = sparse_mla_prefill_ref(*args, attn_sink=sink)
    base = sparse_mla_prefill_ref(*args, attn_sink=sink, upcast=False)
    rep = error_report(out.float(), ref, base.float())
    assert rep.ok, str(rep)
    assert torch.all(out[0] == 0) and torch.all(out[2] == 0), "empty rows must be zeros"
    return out


WS = "gluon_ws"


def _check_ws_case(kernel, H, with_sink, index_dtype, seed):
    """A warp-specialised kernel over 300 tokens (more work items than SMs, so every persistent
    program takes several and the barrier phases carry over), ragged and empty rows, absent
    slots of every kind, duplicates, NaN in every unreferenced pool row; repeat calls are
    bitwise identical."""
    c = _gpu_case(300, H, 5000, has_pe=False, index_dtype=index_dtype, seed=seed, max_len=700)
    idx, ptr = c["kv_indices"], c["kv_indptr"]
    s, e = int(ptr[7]), int(ptr[8])
    if e - s >= 4:
        idx[s + 1 : e : 2] = idx[s]  # duplicates within one row
    sink = _gpu_sink(H, seed) if with_sink else None
    out = _check_prefill(c, sink, kernel=kernel)
    again = _check_prefill(c, sink, kernel=kernel)
    assert torch.equal(out, again), "repeat calls differ"


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("H", [64, 96, 128])  # 96: the last head block is half outside H
@pytest.mark.parametrize("with_sink", [False, True])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gpu_ws_prefill_matches_reference(H, with_sink, index_dtype):
    _check_ws_case(WS, H, with_sink, index_dtype, seed=H + 2 * with_sink)


# List lengths around gluon_ws's short last tile (hopper_ws.TAIL = 16 slots of the last pair's
# odd tile): odd tile counts (an empty odd tile), tails of 1, 15, 16 (short) and 17, 32, 64
# (whole), over one, two and three pairs.
_TAIL_LENGTHS = [0, 1, 5, 16, 17, 63, 64, 65, 79, 80, 81, 96, 127, 128, 129, 143, 144, 145,
                 192, 200, 255, 256, 257, 320, 336, 337]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("H", [64, 128])
@pytest.mark.parametrize("small", [False, True])
def test_gpu_ws_short_last_tile(H, small):
    """gluon_ws takes the odd tile of an item's last pair at 16 slots when at most 16 of its slots
    are in the list: every length around that bound (in one call, and repeated so programs take
    several items in the large-call order) against the fp32 reference, bitwise repeats."""
    lengths = _TAIL_LENGTHS * (1 if small else 12)
    c = _gpu_case(len(lengths), H, 5000, has_pe=False, index_dtype=torch.int32, seed=H + small,
                  lengths=lengths)  # fmt: skip
    sink = _gpu_sink(H, H + small)
    out = _check_prefill(c, sink, kernel=WS)
    assert torch.equal(out, _check_prefill(c, sink, kernel=WS)), "repeat calls differ"


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("H", [64, 128])
@pytest.mark.parametrize("with_sink", [False, True])
def test_gpu_ws_late_max_jumps(H, with_sink):
    """gluon_ws keeps a row's stale running max until a pair's logits pass it by more than
    hopper_ws.RESCALE_SLACK (log2 units), and a warp none of whose 16 rows moved skips its O
    rescale: lists of 16 tiles in which one slot past the eighth tile lifts one head's logit
    (that head alone: the slot's K row is orthogonal to the token's other heads) far past its
    running max (a rescale in that head's warp only) or by less than the slack (the stale max,
    P up to 2^8), against the fp32 reference; bitwise repeats."""
    R, N = 40, 5000
    c = _gpu_case(R, H, N, has_pe=False, index_dtype=torch.int32, seed=H + 3 + with_sink,
                  lengths=[1024] * R)  # fmt: skip
    scale = 512**-0.5
    idx, ptr = c["kv_indices"].cpu(), c["kv_indptr"].cpu()
    for r in range(3, R):
        h = (7 * r) % H
        pos = int(ptr[r]) + 512 + (37 * r) % 448  # in pairs 4-7 of 8
        j = 4000 + r
        idx[pos] = j
        # base-2 logit of head h with slot j: 40 (far past any max of randn logits) or 9
        # (about 4-6 past a row's max of a few hundred randn logits, under the slack)
        target = (40.0 if r % 2 else 9.0) / math.log2(math.e) / scale
        q = c["q_nope"][r].double().cpu()  # [H, 512]
        k = q.T @ torch.linalg.solve(q @ q.T, torch.eye(H, dtype=torch.float64)[:, h] * target)
        c["kv_c"][j] = k.to(torch.bfloat16).cuda()
    c["kv_indices"] = idx.cuda()
    sink = _gpu_sink(H, H + 3 + with_sink) if with_sink else None
    out = _check_prefill(c, sink, kernel=WS)
    assert torch.equal(out, _check_prefill(c, sink, kernel=WS)), "repeat calls differ"


@pytest.mark.gpu
@pytest.mark.sm90
def test_gpu_ws_prefill_fp16():
    """gluon_ws in fp16 (its TMA output descriptor and P buffers take the dtype)."""
    c = _gpu_case(200, 64, 3000, has_pe=False, index_dtype=torch.int32, seed=11, max_len=700)
    c = {k: (v.to(torch.float16) if v is not None and v.is_floating_point() else v)
         for k, v in c.items()}  # fmt: skip
    sink = torch.randn(64, device="cuda")
    args = (c["q_nope"], c["kv_c"], c["kv_indices"], c["kv_indptr"], 512**-0.5)
    out = torch.full(c["q_nope"].shape, float("nan"), dtype=torch.float16, device="cuda")
    mla_gluon(**c, sm_scale=512**-0.5, has_pe=False, attn_sink=sink, out=out, kernel=WS)
    ref = sparse_mla_prefill_ref(*args, attn_sink=sink)
    base = sparse_mla_prefill_ref(*args, attn_sink=sink, upcast=False)
    rep = error_report(out.float(), ref, base.float())
    assert rep.ok, str(rep)
    assert torch.all(out[0] == 0)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("H", [1, 8, 16])
@pytest.mark.parametrize("with_sink", [False, True])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gpu_ws_small_prefill_matches_reference(H, with_sink, index_dtype):
    """gluon_ws_small (heads on wgmma's N) with one head group, same cases."""
    _check_ws_case("gluon_ws_small", H, with_sink, index_dtype, seed=5 * H + with_sink)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("H", [1, 8, 16, 20, 32])
@pytest.mark.parametrize("max_len", [700, 2100])  # CSA top-k 512 + window; GLM top-k 2048
@pytest.mark.parametrize("with_sink", [False, True])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gpu_default_prefill_few_heads(H, max_len, with_sink, index_dtype):
    """``sparse_mla_prefill`` with ``config=None`` at few heads, whichever kernel the dispatch
    picks (on sm90: gluon_ws_small up to 32 heads, dispatch.RULE): the cases of _check_ws_case with
    lists up to 2100 slots."""
    from sparse_mla import sparse_mla_prefill

    c = _gpu_case(300, H, 5000, has_pe=False, index_dtype=index_dtype, seed=H + max_len,
                  max_len=max_len)  # fmt: skip
    idx, ptr = c["kv_indices"], c["kv_indptr"]
    s, e = int(ptr[7]), int(ptr[8])
    if e - s >= 4:
        idx[s + 1 : e : 2] = idx[s]  # duplicates within one row
    sink = _gpu_sink(H, H + max_len) if with_sink else None
    out = _check_prefill(c, sink, entry=sparse_mla_prefill)
    again = _check_prefill(c, sink, entry=sparse_mla_prefill)
    assert torch.equal(out, again), "repeat calls differ"


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("H", [16, 64, 128])
@pytest.mark.parametrize("with_sink", [False, True])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("kernel", ["gluon_mma", "gluon_wgmma", "gluon_ws"])
def test_gpu_prefill_matches_reference(H, with_sink, index_dtype, splits, kernel):
    """The split-capable kernels with and without KV splits (gluon_wgmma at 64 heads a block)."""
    if kernel == "gluon_wgmma" and H < 64:
        pytest.skip("gluon_wgmma's tile is 64 heads")
    T = 40
    c = _gpu_case(T, H, 5000, has_pe=False, index_dtype=index_dtype, seed=3 * H + splits)
    sink = _gpu_sink(H, 3 * H + splits) if with_sink else None
    _check_prefill(c, sink, num_kv_splits=splits, kernel=kernel)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("H", [1, 33, 64, 100, 128])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gpu_ws_splits_match_reference(H, index_dtype):
    """gluon_ws with its lists split (partials, then the reduce): forced counts from 2 to 16 on
    ragged lists (empty rows, absent slots of every kind, duplicates, NaN in unreferenced pool
    rows), sink on and off, bit-equal repeats; T = 1-3 with 9,000-slot lists through the public
    entry, whose rule splits them; dense [T, K] ids; an out= view TMA cannot address."""
    from sparse_mla import sparse_mla_prefill
    from sparse_mla.dispatch import Choice
    from sparse_mla.gluon.launch import ws_num_splits

    for splits, with_sink in ((2, True), (3, False), (16, True)):
        c = _gpu_case(12, H, 5000, has_pe=False, index_dtype=index_dtype, seed=H + splits,
                      max_len=1500)  # fmt: skip
        idx, ptr = c["kv_indices"], c["kv_indptr"]
        s, e = int(ptr[7]), int(ptr[8])
        idx[s + 1 : e : 2] = idx[s]  # duplicates within one row
        sink = _gpu_sink(H, H + splits) if with_sink else None
        out = _check_prefill(c, sink, num_kv_splits=splits, kernel=WS)
        again = _check_prefill(c, sink, num_kv_splits=splits, kernel=WS)
        assert torch.equal(out, again), f"splits={splits}: repeat calls differ"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for T in (1, 2, 3):
        # _gpu_case empties row 0 (and fills row 2 with 5 absent slots): T = 1 is its row 1
        c = _gpu_case(max(T, 2), H, 20000, has_pe=False, index_dtype=index_dtype,
                      seed=7 * T + H, lengths=[0, 9000, 8999][: max(T, 2)])  # fmt: skip
        if T == 1:
            c["q_nope"], c["kv_indptr"] = c["q_nope"][1:], c["kv_indptr"][1:]
        assert ws_num_splits(T, H, c["kv_indices"].numel(), sms) > 1
        sink = _gpu_sink(H, T)
        scale = 512**-0.5
        args = (c["q_nope"], c["kv_c"], c["kv_indices"], c["kv_indptr"], scale)
        out = torch.full(c["q_nope"].shape, float("nan"), dtype=torch.bfloat16, device="cuda")
        sparse_mla_prefill(*args, attn_sink=sink, out=out, config=Choice(WS))
        ref = sparse_mla_prefill_ref(*args, attn_sink=sink)
        base = sparse_mla_prefill_ref(*args, attn_sink=sink, upcast=False)
        rep = error_report(out.float(), ref, base.float())
        assert rep.ok, f"T={T}: {rep}"
        # dense ids ([T, K], -1 padded): the same rows
        K = int((c["kv_indptr"][1:] - c["kv_indptr"][:-1]).max())
        dense = torch.full((T, K), -1, dtype=index_dtype, device="cuda")
        for r in range(T):
            lo, hi = int(c["kv_indptr"][r]), int(c["kv_indptr"][r + 1])
            dense[r, : hi - lo] = c["kv_indices"][lo:hi]
        # an out= view inside a larger buffer whose row stride TMA cannot take (odd)
        big = torch.full((T, H + 1, 513), float("nan"), dtype=torch.bfloat16, device="cuda")
        view = big[:, :H, :512]
        sparse_mla_prefill(c["q_nope"], c["kv_c"], dense, None, scale, attn_sink=sink, out=view,
                           config=Choice(WS))  # fmt: skip
        # (not bitwise: dense rows are K long, so the rule may cut them into other pieces)
        rep = error_report(view.float(), ref, base.float())
        assert rep.ok, f"T={T}, dense ids into a view: {rep}"
        assert torch.isnan(big[:, H:, :]).all() and torch.isnan(big[:, :, 512:]).all()


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("kernel, H", [("gluon_mma", 16), ("gluon_mma", 128),
                                       ("gluon_wgmma", 64), ("gluon_wgmma", 128)])  # fmt: skip
def test_gpu_split_counters_are_zero_at_rest(kernel, H):
    """The fused reduce's arrival counters and work ticket: a set reused by calls of other row
    counts and split counts, back to back on one stream with no sync, comes back all zero
    after each, and every call is right (fp32 rule, NaN-poisoned out) and bit-equal to the same
    call with fresh counters and to the reduce as a second launch; 16 splits over 3 rows make
    arrivals race. 16-head blocks fuse by the last arrival, 64-head ones by combiner programs
    (every split call here fused, whether or not its combiners fit on the SMs at once: 40
    rows of 128 heads make 320, so some wait for SMs the splits hold)."""
    from sparse_mla.gluon import launch

    made = []
    real = launch.fastlaunch.zeroed
    rule = launch.fused_reduce  # every split call of the test fused, 64-head blocks included
    launch.fused_reduce = lambda s, t, bh, *_: s > 1 and t.backend == "cuda"

    def keep_one(n, dtype, device):  # one counter buffer for every call of the test
        if not made:
            made.append(real(4096, dtype, device))
        return made[0][:n]

    runs = [(3, 16), (40, 3), (7, 16), (3, 2), (40, 16)]
    cases = {T: _gpu_case(T, H, 5000, has_pe=False, index_dtype=torch.int32, seed=T + H,
                          max_len=900) for T, _ in runs}  # fmt: skip
    sink = _gpu_sink(H, H)
    try:
        fresh = {
            r: _check_prefill(cases[r[0]], sink, kernel=kernel, num_kv_splits=r[1]) for r in runs
        }
        launch.fused_reduce = lambda s, t, bh, *_: False
        for r in runs:
            two = _check_prefill(cases[r[0]], sink, kernel=kernel, num_kv_splits=r[1])
            assert torch.equal(two, fresh[r]), ("fused != two launches", r)
        launch.fused_reduce = lambda s, t, bh, *_: s > 1 and t.backend == "cuda"
        launch.fastlaunch.zeroed = keep_one
        for _ in range(3):
            for T, splits in runs:
                out = _check_prefill(cases[T], sink, kernel=kernel, num_kv_splits=splits)
                assert torch.equal(out, fresh[(T, splits)]), (T, splits)
        torch.cuda.synchronize()
    finally:
        launch.fastlaunch.zeroed = real
        launch.fused_reduce = rule
    assert made and int(made[0].abs().sum()) == 0, "a counter was left non-zero"


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize(
    "kernel, config",
    [
        ("gluon_wgmma", GluonConfig(64, 32, 8, num_stages=4)),
        ("gluon_wgmma", GluonConfig(64, 32, 8, num_stages=3)),
        ("gluon_wgmma", None),
        ("gluon_mma", GluonConfig(64, 32, 8)),
    ],
    ids=["wgmma_k32_s4", "wgmma_k32_s3", "wgmma_default", "mma"],
)
def test_gpu_prefill_variants_match_reference(kernel, config):
    T, H = 40, 128
    c = _gpu_case(T, H, 5000, has_pe=False, index_dtype=torch.int64, seed=11, max_len=700)
    sink = _gpu_sink(H, 11)
    _check_prefill(c, sink, kernel=kernel, config=config)


@pytest.mark.gpu
@pytest.mark.sm90
def test_gpu_empty_pool_and_no_rows():
    c = _gpu_case(3, 16, 50, has_pe=True, index_dtype=torch.int32, seed=5)
    c["kv_c"], c["k_pe"] = c["kv_c"][:0], c["k_pe"][:0]
    out, lse = mla_gluon(**c, sm_scale=0.1, return_lse=True)
    assert torch.all(out == 0) and torch.all(lse == -math.inf)


@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("target", ["gfx950", "sm90"])
def test_inspect_compiles_both_modes(mode, target):
    from sparse_mla import inspect

    res = inspect.compile_gluon(mode, target)
    assert res.resources.spill_bytes == 0
    assert res.resources.occupancy >= 1
    # The shared algorithm: mma.sync (HMMA) on sm90, MFMA on gfx950; wgmma on sm90 prefill is
    # the named gluon_wgmma kernel.
    key = "mfma" if target == "gfx950" else "mma"
    if target == "sm90" and mode == "prefill":
        assert inspect.compile_gluon(mode, target, "gluon_wgmma").mix["wgmma"] > 0
    assert res.mix[key] > 0, res.mix
    rows = dict(res.resources.as_rows())
    assert rows, "no resource rows"


def test_ws_split_build_writes_partials_not_out():
    """gluon_ws at NUM_SPLITS > 1 stores fp32 partials from registers (v2 stores) and no bf16
    O; its one-split build stores O by the consumers' 16-byte stores (step 46: each [64, 64]
    block through the P buffer, four a lane a block) and no other global store, and neither
    build has a TMA store."""
    from sparse_mla.gluon import launch

    split = launch.compile_for("prefill", "sm90", "gluon_ws", num_splits=4).asm["ptx"]
    whole = launch.compile_for("prefill", "sm90", "gluon_ws").asm["ptx"]
    for ptx in (split, whole):
        assert "cp.async.bulk.tensor.3d.global.shared" not in ptx
    assert split.count("st.global.v2.b32") == 128  # 64 column pairs a thread, two consumers
    assert "st.global.v4.b32" not in split
    assert whole.count("st.global.v4.b32") == 32  # 4 blocks x 4 rows of 16 bytes, two consumers
    assert whole.count("st.global") == 32
    # its reduce: one program per (row, 16 heads, 128 columns), no spills at 16 splits
    from sparse_mla import inspect

    sig = {"opart_ptr": "*fp32", "lsepart_ptr": "*fp32", "sink_ptr": "*fp32",
           "out_ptr": "*bf16", "lse_ptr": "*fp32"}  # fmt: skip
    for splits, has_sink in ((4, True), (16, False)):
        cx = launch._reduce_constexprs(64, splits, has_sink, False, launch.get_target("sm90"),
                                       cols=launch.REDUCE_COLS)  # fmt: skip
        res = inspect.compile(launch._mla_reduce_kernel, "sm90", cx, {"num_warps": 4}, sig)
        assert res.resources.spill_bytes == 0 and res.resources.occupancy >= 1


@pytest.mark.parametrize(
    "shape",
    [{}, {"small": True}, {"num_splits": 4}, {"dense": True}, {"index_dtype": torch.int64}],
    ids=["whole", "small", "splits", "dense", "int64"],
)
def test_ws_l2_rows_build_prefetches_the_next_pairs_rows(shape):
    """gluon_ws with ``L2_ROWS`` (a split call, hopper_ws.l2_rows): its producer asks L2
    for the next pair's KV rows, one 1 KiB bulk prefetch a row (the row's bytes at D = 512,
    16-bit), predicated on the id being valid, in every build, with no spills (its 48-register
    producer loads the ids once more); without it, the build has no such prefetch."""
    from sparse_mla import inspect
    from sparse_mla.gluon import launch

    pattern = r"@p cp\.async\.bulk\.prefetch\.L2\.global \[%rd\d+\], (\d+);"
    # A small build has one more: its consumer 1's call rows (the next test).
    call_rows = 1 if shape.get("small") else 0
    res = launch.compile_for("prefill", "sm90", "gluon_ws", l2_rows=True, **shape)
    assert re.findall(pattern, res.asm["ptx"]) == ["1024"] * (1 + call_rows)
    assert inspect.resources_of(res, "sm90").spill_bytes == 0
    plain = launch.compile_for("prefill", "sm90", "gluon_ws", **shape)
    assert re.findall(pattern, plain.asm["ptx"]) == ["1024"] * call_rows


@pytest.mark.parametrize("dense", [0, 1, 2])
def test_ws_small_call_asks_l2_for_the_calls_rows(dense):
    """Step 45: in gluon_ws's small-call build, consumer 1 (worker 0) loads its program's share
    of kv_indices and asks L2 for those KV rows, one 1 KiB bulk prefetch a row predicated on
    the id being valid, behind a runtime check that the shares are at most CALL_ROWS ids; the
    large-call build has none, and neither has gluon_ws_fp8's small build, whose consumers
    share the code but whose pool is an FP8 cache's bytes (no [N, 512] 16-bit rows). No
    spills."""
    from sparse_mla.gluon import hopper_ws, launch, launch_fp8

    assert hopper_ws.CALL_ROWS.value == 128
    pattern = r"@p cp\.async\.bulk\.prefetch\.L2\.global \[%rd\d+\], (\d+);"
    for small in (True, False):
        res = launch.compile_for("prefill", "sm90", "gluon_ws", small=small, dense=dense)
        assert re.findall(pattern, res.asm["ptx"]) == (["1024"] if small else []), small
        # In consumer 1's partition (named by its setmaxnreg: worker 0's registers) alone
        resources = inspect.resources_of(res, "sm90")
        parts = resources.partitions
        consumer1 = next(r for n, _, r in parts if n == "worker 0")
        assert consumer1 not in (r for n, _, r in parts if n != "worker 0"), parts
        bulk = inspect.partition_counts(inspect._nvdisasm(res.asm["cubin"]), r"\bUBLKPF\.L2\b")
        assert bulk == ({consumer1: 1} if small else {}), (small, bulk)
        assert resources.spill_bytes == 0
    if dense == 0:  # the FP8 build does not depend on the ids' form: checked once
        kernel, sig, cx, opts = launch_fp8.compile_args_ws("sm90", num_heads=64, small=True)
        fp8 = inspect.compile(kernel, "sm90", cx, opts, sig)
        assert "cp.async.bulk.prefetch.L2" not in fp8.asm["ptx"]


def test_ws_fp8_single_item_call_stores_o_itself():
    """Step 47: gluon_ws_fp8's build for calls of one item a program (OUT_DIRECT) writes O by
    its consumers' own 16-byte stores, four [64, 64] blocks of 16 STG.128 a consumer and no
    TMA store; the other build keeps its four TMA stores a consumer and has no 16-byte global
    stores. The register split as before and no spills either way."""
    from sparse_mla.gluon import launch, launch_fp8

    assert launch.single_item(132, 132) and not launch.single_item(133, 132)
    for single in (True, False):
        kernel, sig, cx, opts = launch_fp8.compile_args_ws(
            "sm90", num_heads=64, small=True, single=single
        )
        assert cx["OUT_DIRECT"] is single and sig["out"].startswith("*") == single
        res = inspect.compile(kernel, "sm90", cx, opts, sig)
        parts = res.resources.partitions
        assert [r for _, _, r in parts] == [224, 192, 88], parts
        c0, c1 = parts[0][2], parts[1][2]
        stg = inspect.partition_counts(res.isa, r"\bSTG\.E\.128\b")
        tma = inspect.partition_counts(res.isa, r"\bUTMASTG\b")
        assert stg == ({c0: 16, c1: 16} if single else {}), (single, stg)
        assert tma == ({} if single else {c0: 4, c1: 4}), (single, tma)
        assert res.resources.spill_bytes == 0 and inspect.partition_counts(res.isa, "STL") == {}


@pytest.mark.parametrize("kernel", ["gluon_ws", "gluon_ws_small", "gluon_mma"])
def test_compile_for_gives_every_constexpr(kernel, monkeypatch):
    """compile_for hands Triton every constexpr parameter, defaults included: Triton 3.6's
    ASTSource.hash keys its cache on the given constexprs' values in parameter order without
    their names, so two builds that set different optional constexprs to the same value would
    otherwise share a cache entry (a gluon_ws build with a new last constexpr came back as the
    L2_ROWS build while this was written)."""
    from sparse_mla.gluon import launch

    seen = []
    monkeypatch.setattr(triton, "compile", lambda src, **kw: seen.append(src))
    launch.compile_for("prefill", "sm90", kernel, l2_rows=kernel == "gluon_ws")
    (src,) = seen
    fn = src.fn
    want = {(i,) for i, p in enumerate(fn.params) if p.is_constexpr}
    assert set(src.constants) == want, sorted(want - set(src.constants))


def test_ws_l2_rows_rule_is_split_calls():
    """The run sets L2_ROWS only for calls that split their lists (measured gains there; unsplit
    calls of one wave and T = 16384 lost 3-5%)."""
    from sparse_mla.gluon import hopper_ws

    assert hopper_ws.l2_rows(2) and hopper_ws.l2_rows(16)
    assert not hopper_ws.l2_rows(1)


@pytest.mark.parametrize("target", ["gfx950", "sm90"])
def test_split_reduce_kernel_cross_compiles(target):
    """The reduce step of KV splits (sink, empty rows zero) compiles for both targets, with and
    without a sink; its numerics run on the GPU (test_gpu_prefill_matches_reference, splits 3)."""
    from sparse_mla import inspect
    from sparse_mla.gluon.algorithm import _mla_reduce_kernel
    from sparse_mla.gluon.launch import _reduce_constexprs

    sig = {"opart_ptr": "*fp32", "lsepart_ptr": "*fp32", "sink_ptr": "*fp32",
           "out_ptr": "*bf16", "lse_ptr": "*fp32"}  # fmt: skip
    for has_sink in (False, True):
        cx = _reduce_constexprs(64, 4, has_sink, False, get_target(target))
        res = inspect.compile(_mla_reduce_kernel, target, cx, {"num_warps": 4}, sig)
        assert res.resources.spill_bytes == 0 and res.resources.occupancy >= 1
    # column blocks (gluon_ws's reduce) leave the LSE to whole-row programs: refused at compile
    cx = {**_reduce_constexprs(64, 4, True, True, get_target(target)), "COLS": 128}
    with pytest.raises(inspect.CompileFailed, match="whole-row"):
        inspect.compile(_mla_reduce_kernel, target, cx, {"num_warps": 4}, sig)


@pytest.mark.parametrize("kernel, mode, H", [
    ("gluon_mma", "prefill", 16), ("gluon_mma", "decode", 8), ("gluon_mma", "prefill", 64),
    ("gluon_mma", "decode", 128), ("gluon_wgmma", "prefill", 64),
])  # fmt: skip
def test_split_launch_fuses_its_reduce_on_sm90(kernel, mode, H):
    """With KV splits, the sm90 kernels combine their partials in the same launch. 16-head
    blocks: one acquire-release atomic add at GPU scope (the arrival count) by one thread,
    after a barrier (every warp's partial stores issued first), the partials loaded past L1
    (ld.global.cg). Larger blocks (combiner programs): a relaxed atomic add first (the work
    ticket, before any other global access), the splits' arrival as a release add after the
    barrier behind their partial stores, the combiners' poll an acquire load in a loop, then
    their .cg loads and a relaxed arrival of their own. Without splits none of it; gfx950
    keeps the reduce launch (no atomic in its split kernel). Numerics: the GPU tests of splits
    (test_gpu_prefill_matches_reference, test_gpu_split_counters_are_zero_at_rest)."""
    from sparse_mla.gluon.launch import combiners, compile_for, fused_reduce, resolve_launch

    cfg = resolve_launch(kernel, None, H, get_target("sm90"))
    assert fused_reduce(4, get_target("sm90"), cfg.BLOCK_H)
    assert not fused_reduce(1, get_target("sm90"), cfg.BLOCK_H)
    assert not fused_reduce(4, get_target("gfx950"), cfg.BLOCK_H)
    # combiners beyond one wave of the SMs: a second launch (16-head blocks fuse regardless)
    assert fused_reduce(4, get_target("sm90"), cfg.BLOCK_H, 133, 132) == (cfg.BLOCK_H <= 16)
    by_rule = compile_for(mode, "sm90", kernel, num_splits=4, num_heads=H).asm["ptx"]
    assert "atom." in by_rule
    one = compile_for(mode, "sm90", kernel, num_splits=1, num_heads=H, fused_reduce=True)
    assert "atom." not in one.asm["ptx"] and "ld.global.cg" not in one.asm["ptx"]
    ptx = compile_for(mode, "sm90", kernel, num_splits=4, num_heads=H, fused_reduce=True)
    lines = [ln.strip() for ln in ptx.asm["ptx"].splitlines()]
    atoms = [i for i, ln in enumerate(lines) if "atom." in ln]
    assert all(lines[i].startswith("@%p") for i in atoms), "one thread's atomics"
    assert sum("ld.global.cg" in ln for ln in lines) > 0

    def after_barrier_behind_stores(i):
        before = lines[:i]
        last_store = max(k for k, ln in enumerate(before) if "st.global" in ln)
        last_bar = max(k for k, ln in enumerate(before) if ln.startswith("bar.sync"))
        return last_bar > last_store

    if combiners(cfg.BLOCK_H) == 0:
        assert len(atoms) == 1, [lines[i] for i in atoms]
        assert "atom.global.gpu.acq_rel.add" in lines[atoms[0]], lines[atoms[0]]
        assert after_barrier_behind_stores(atoms[0]), "partial stores, barrier, then arrival"
    else:
        kinds = [lines[i] for i in atoms]
        assert len(atoms) == 3, kinds
        first_global = min(i for i, ln in enumerate(lines) if "ld.global" in ln or "atom." in ln)
        assert first_global == atoms[0] and "atom.global.gpu.relaxed.add" in kinds[0], kinds
        (arrival,) = [i for i in atoms if "atom.global.gpu.release.add" in lines[i]]
        assert after_barrier_behind_stores(arrival), "partial stores, barrier, then arrival"
        assert sum("atom.global.gpu.relaxed.add" in k for k in kinds) == 2, kinds
        polls = [i for i, ln in enumerate(lines) if "ld.global.gpu.acquire" in ln]
        assert polls, "the combiners' poll is an acquire load"
        assert min(k for k, ln in enumerate(lines) if "ld.global.cg" in ln) > min(polls)
    if kernel == "gluon_mma":
        amd = compile_for(mode, "gfx950", kernel, num_splits=4, num_heads=H).asm["amdgcn"]
        assert "global_atomic" not in amd and "buffer_atomic" not in amd


def test_persistent_launch_arguments(monkeypatch):
    """The warp-specialised launches' host side, on CPU with a stand-in kernel: the persistent
    grid, the argument order the kernels declare, a -inf sink when there is none, a copy of a q
    whose rows are not 16-byte aligned (the producer copies Q with 16-byte cp.async), and for
    gluon_ws (OUT_ALIGNED: 16-byte stores of O) out's pointer and strides, or a buffer's copied
    into an out whose rows are not 16-byte aligned; for a TMA-writing kernel (out_tma, as
    gluon_ws_fp8 launches) a descriptor of out or of such a buffer."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from sparse_mla.gluon import hopper_ws, launch
    from sparse_mla.gluon.hopper_ws import _prefill_ws_kernel
    from sparse_mla.gluon.hopper_ws_small import _prefill_ws_small_kernel

    calls = []

    class FakeKernel:
        def __getitem__(self, grid):
            def run(*args, **kw):
                calls.append((grid, args, kw))
                for a in args[5:6]:  # "write" the output the kernel was given
                    if isinstance(a, TensorDescriptor):
                        a.base.fill_(3.0)
                    elif isinstance(a, torch.Tensor):
                        a.fill_(3.0)

            return run

    monkeypatch.setattr(launch, "_num_compute_units", lambda dev: 132)
    T, H, N = 300, 128, 50
    qb = torch.randn(T, H, 520, dtype=torch.bfloat16)
    q = qb[..., 4:516]  # 8 bytes into each row
    kv = torch.randn(N, 512, dtype=torch.bfloat16)
    idx = torch.arange(10, dtype=torch.int32)
    ptr = torch.zeros(T + 1, dtype=torch.int32)
    out = torch.empty(T, H, 512, dtype=torch.bfloat16)
    part, lse = torch.empty(1), torch.empty(1)  # the split partials' pointers (unused here)
    assert hopper_ws.OUT_ALIGNED and not hasattr(hopper_ws, "OUT_BY_TMA")
    launch._launch_persistent(FakeKernel(), 64, q, kv, idx, ptr, None, out, 0.25, 0,
                              out_aligned=True, q_tma=True, extra_args=(part, lse))  # fmt: skip
    (grid, args, kw), = calls  # fmt: skip
    assert grid == (132,) and kw == {"num_warps": 4, "num_stages": 1}
    # The positional arguments (the constexprs with defaults, SMALL and the register split,
    # go by keyword when a launch sets them).
    k = _prefill_ws_kernel
    names = [n for i, n in enumerate(k.arg_names) if i not in k.constexprs]
    assert len(args) == len(names), (len(args), names)
    got = dict(zip(names, args, strict=True))
    qd = got["q_desc"]  # Q by TMA: a descriptor of a contiguous copy of q (rows not aligned)
    assert isinstance(qd, TensorDescriptor) and qd.base.is_contiguous()
    assert torch.equal(qd.base, q) and list(qd.shape) == [T, H, 512]
    assert list(qd.block_shape) == [1, 64, hopper_ws.Q_BLOCK.value]
    assert qd.layout == hopper_ws.Q_SMEM.value
    assert got["kv_ptr"] is kv and got["idx_ptr"] is idx
    assert got["out_ptr"] is out and (got["stride_or"], got["stride_oh"]) == (H * 512, 512)
    assert torch.all(got["sink_ptr"] == -math.inf) and got["sink_ptr"].shape == (H,)
    assert (got["stride_qr"], got["stride_qh"]) == (H * 512, 512)
    assert (got["num_heads"], got["num_kv"], got["nnz"]) == (H, N, 10)
    assert got["num_items"] == T * 2 and got["qk_scale"] == pytest.approx(0.25 * 1.4426950408889634)
    assert got["opart_ptr"] is part and got["lsepart_ptr"] is lse
    # An out view whose rows are 8 bytes off 16: written through a buffer, copied.
    calls.clear()
    ob = torch.zeros(T, H, 520, dtype=torch.bfloat16)
    odd = ob[..., 4:516]
    launch._launch_persistent(FakeKernel(), 64, q, kv, idx, ptr, None, odd, 0.25, 0,
                              out_aligned=True, q_tma=True, extra_args=(part, lse))  # fmt: skip
    (_, args, _), = calls  # fmt: skip
    got = dict(zip(names, args, strict=True))
    buf = got["out_ptr"]
    assert buf is not odd and buf.is_contiguous() and buf.shape == odd.shape
    assert (got["stride_or"], got["stride_oh"]) == (H * 512, 512)
    assert torch.all(odd == 3.0) and torch.all(ob[..., :4] == 0) and torch.all(ob[..., 516:] == 0)
    # An aligned out view (rows 16 bytes apart, a wider row stride): out itself, its strides.
    calls.clear()
    wide = torch.zeros(T, H, 520, dtype=torch.bfloat16)[..., 8:520]
    launch._launch_persistent(FakeKernel(), 64, q, kv, idx, ptr, None, wide, 0.25, 0,
                              out_aligned=True, q_tma=True, extra_args=(part, lse))  # fmt: skip
    (_, args, _), = calls  # fmt: skip
    got = dict(zip(names, args, strict=True))
    assert got["out_ptr"] is wide and (got["stride_or"], got["stride_oh"]) == (H * 520, 520)
    # The TMA-writing launch (gluon_ws_fp8's): a descriptor of out, or of a buffer for an
    # out TMA cannot address, in out_ptr's place (the stand-in takes gluon_ws's positions),
    # and out's strides after it either way. With single_direct a call of at most one item a
    # program (T = 66 here: 132 items) takes the pointer and OUT_DIRECT instead, a larger one
    # (T = 300: 600 items) the descriptor.
    cases = [(d, d is out, single) for single in (None, False, True) for d in (out, odd)]
    for whole, direct, single in cases:
        calls.clear()
        ob.zero_()
        rows = 66 if single else T
        dst = whole[:rows]
        launch._launch_persistent(
            FakeKernel(), 64, q[:rows], kv, idx, ptr[: rows + 1], None, dst, 0.25, 0,
            out_tma=True, single_direct=single is not None, q_tma=True, extra_args=(part, lse),
        )  # fmt: skip
        (_, args, kw), = calls  # fmt: skip
        got = dict(zip(names, args, strict=True))
        o_arg = got["out_ptr"]
        assert kw.get("OUT_DIRECT", False) == bool(single)
        assert (got["stride_or"], got["stride_oh"]) == (H * 512, 512)
        if single:
            assert isinstance(o_arg, torch.Tensor) and (o_arg is dst) == direct
            assert o_arg.is_contiguous() and o_arg.shape == (rows, H, 512)
        else:
            assert isinstance(o_arg, TensorDescriptor) and (o_arg.base is dst) == direct
            assert list(o_arg.shape) == [rows, H, 512]
            assert list(o_arg.block_shape) == [1, 64, hopper_ws.OUT_BLOCK.value]
            assert o_arg.layout == hopper_ws.OUT_SMEM.value
        assert torch.all(dst == 3.0)  # written, or copied from the buffer
        assert torch.all(ob[..., :4] == 0) and torch.all(ob[..., 516:] == 0)
        whole.zero_()
    # A split launch: splits x the items, and its buffer is never copied into out (the kernel
    # writes partials; the reduce writes out)
    calls.clear()
    ob.zero_()
    launch._launch_persistent(FakeKernel(), 64, q, kv, idx, ptr, None, odd, 0.25, 0,
                              out_aligned=True, q_tma=True, extra_args=(part, lse), splits=3,
                              constexprs={"NUM_SPLITS": 3})  # fmt: skip
    (grid, args, kw), = calls  # fmt: skip
    got = dict(zip(names, args, strict=True))
    assert grid == (132,) and got["num_items"] == T * 2 * 3 and kw["NUM_SPLITS"] == 3
    assert torch.all(ob == 0)
    # The pointer-writing kernel (H <= 16): an aligned q and a sink pass through; few items
    # give a smaller grid.
    calls.clear()
    sink = torch.randn(H)
    launch._launch_persistent(FakeKernel(), 16, qb[:2, :, :512], kv, idx, ptr[:3], sink, out[:2],
                              0.25, 0)  # fmt: skip
    (grid, args, _), = calls  # fmt: skip
    k = _prefill_ws_small_kernel
    names = [n for i, n in enumerate(k.arg_names) if i not in k.constexprs]
    got = dict(zip(names, args, strict=True))
    assert grid == (2 * 8,) and got["q_ptr"].data_ptr() == qb.data_ptr()
    assert got["out_ptr"] is not None and got["out_ptr"].data_ptr() == out.data_ptr()
    assert (got["stride_or"], got["stride_oh"]) == (H * 512, 512)
    assert torch.equal(got["sink_ptr"], sink) and got["stride_qh"] == 520
    assert got["ids_per_row"] == 0 and got["indptr_ptr"].data_ptr() == ptr.data_ptr()
    assert "DENSE_IDS" not in calls[0][2]  # CSR: the kernel it always was
    # Dense ids [R, K]: DENSE_IDS and K, the ids standing in for the unused kv_indptr pointer;
    # with the rows' lengths, DENSE_IDS = 2 and the lengths in that pointer's place.
    dense = torch.zeros(2, 7, dtype=torch.int32)
    lengths = torch.tensor([3, 7], dtype=torch.int32)
    for indptr, want_flag, want_ptr in ((None, True, dense), (lengths, 2, lengths)):
        calls.clear()
        launch._launch_persistent(FakeKernel(), 16, qb[:2, :, :512], kv, dense, indptr, sink,
                                  out[:2], 0.25, 0)  # fmt: skip
        (_, args, kw), = calls  # fmt: skip
        got = dict(zip(names, args, strict=True))
        assert kw["DENSE_IDS"] is want_flag or kw["DENSE_IDS"] == want_flag == 2
        assert got["indptr_ptr"] is want_ptr and got["ids_per_row"] == 7
        assert got["idx_ptr"] is dense and got["nnz"] == 14


# ------------------------------------------------------------------------------------------------
# The warp-specialised kernels' knobs: the register split and the ring depth
# ------------------------------------------------------------------------------------------------


def test_ws_knobs_are_validated_before_compiling():
    sm90 = get_target("sm90")
    assert set(KERNELS["gluon_ws"].knobs) == {"CONSUMER_REGS", "PRODUCER_REGS"}
    assert set(KERNELS["gluon_ws_small"].knobs) == {"HEAD_GROUPS", "STAGES", "PRODUCER_REGS"}
    # gluon_ws: consumer 0 takes 504 - CONSUMER_REGS - PRODUCER_REGS, never less than consumer 1.
    assert hopper_ws.register_split(224, 48) == (232, 224, 48)
    assert hopper_ws.register_split(216, 56) == (232, 216, 56)
    ok = resolve_launch("gluon_ws", {"CONSUMER_REGS": 216, "PRODUCER_REGS": 56}, 64, sm90)
    assert ok == WSConfig(216, 56)
    for bad, word in (({"CONSUMER_REGS": 240}, "consumer 0 would get 504 - 240 - 48 = 216"),
                      ({"PRODUCER_REGS": 20}, "multiple of 8"),
                      ({"CONSUMER_REGS": 225}, "multiple of 8"),
                      ({"CONSUMER_REGS": True}, "multiple of 8")):  # fmt: skip
        with pytest.raises(ValueError, match=word):
            resolve_launch("gluon_ws", bad, 64, sm90)
    # gluon_ws_small: the ring's depth against shared memory, the producer's registers.
    assert SmallWSConfig(1).stages() == 3 and SmallWSConfig(2).stages() == 2
    assert SmallWSConfig(1, STAGES=2).stages() == 2
    with pytest.raises(ValueError, match="233536 bytes of shared memory"):
        resolve_launch("gluon_ws_small", {"HEAD_GROUPS": 2, "STAGES": 3}, 32, sm90)
    for bad in ({"STAGES": 4}, {"STAGES": 1}, {"PRODUCER_REGS": 300}):
        with pytest.raises(ValueError, match=r"STAGES|PRODUCER_REGS"):
            resolve_launch("gluon_ws_small", bad, 16, sm90)
    # Every value a knob lists is valid alone, on top of the default launch.
    for name, heads in (("gluon_ws", 64), ("gluon_ws_small", 16)):
        for knob, values in KERNELS[name].knobs.items():
            for v in values:
                cfg = resolve_launch(name, {knob: v}, heads, sm90)
                assert getattr(cfg, knob) == v


def test_ws_knobs_reach_the_compiled_kernel():
    """A launch's register split is the compiled kernel's setmaxnreg values, its ring depth
    the shared memory it takes; the default launch compiles to the kernel as written."""
    sm90 = "sm90"
    res = inspect.compile_gluon(
        "prefill", sm90, "gluon_ws", num_heads=64, config=WSConfig(216, 56)
    ).resources
    assert res.partitions == [("default", 4, 232), ("worker 0", 4, 216), ("worker 1", 4, 56)]
    assert res.local_bytes == 0 and res.stack_bytes == 0, res
    small = inspect.compile_gluon(
        "prefill", sm90, "gluon_ws_small", num_heads=16, config=SmallWSConfig(1, STAGES=2)
    ).resources
    three = inspect.compile_gluon("prefill", sm90, "gluon_ws_small", num_heads=16).resources
    assert three.shared_bytes - small.shared_bytes == 64 * 512 * 2  # one 64 KiB tile fewer
    assert small.partitions[1] == ("worker 0", 4, 64)
