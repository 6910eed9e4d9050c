"""Cross-compiling without a GPU: resources vs the compiler's own report, occupancy, mix, diff.

Every prefill compile goes through one module-scoped cache (and inspect's own memory cache),
so the D=512 kernel is compiled once per (target, variant).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from sparse_mla import cli
from sparse_mla import inspect as si
from sparse_mla.prefill import PrefillConfig

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ["sm90", "sm100", "gfx942", "gfx950"]
# Fixed so the tests do not depend on configs/ (a tuned entry would change the default).
BASE = PrefillConfig(BLOCK_H=16, BLOCK_K=32, num_warps=4, num_stages=2)


@pytest.fixture(scope="module")
def prefill():
    """compile_prefill(target, **config overrides), remembered for the whole module."""
    seen: dict = {}

    def get(target: str, **overrides) -> si.CompileResult:
        key = (target, tuple(sorted(overrides.items())))
        if key not in seen:
            cfg = PrefillConfig(**{**BASE.to_dict(), **overrides})
            seen[key] = si.compile_prefill(target, cfg)
        return seen[key]

    return get


# ---------------------------------------------------------------------------------------------
# Occupancy formulas
# ---------------------------------------------------------------------------------------------

CDNA_STEPS = [(64, 8), (72, 7), (80, 6), (96, 5), (128, 4), (168, 3), (256, 2), (512, 1)]


def _cdna_table(total: int) -> int:
    return next(waves for bound, waves in CDNA_STEPS if total <= bound)


def test_cdna_table_every_step():
    for total in range(0, 513):
        assert si.amd_waves_per_simd(total, 0) == _cdna_table(total), total
    for bound, waves in CDNA_STEPS[:-1]:  # each step's edge: one more register drops a wave
        assert si.amd_waves_per_simd(bound + 1, 0) == waves - 1


def test_cdna_agprs_join_after_rounding_arch_vgprs_to_4():
    assert si.amd_unified_vgprs(255, 34) == 290  # gfx950 prefill: '; TotalNumVgprs: 290'
    assert si.amd_unified_vgprs(253, 0) == 253
    assert si.amd_waves_per_simd(125, 4) == 3  # 128 + 4 = 132 > 128
    assert si.amd_waves_per_simd(124, 4) == 4  # 124 + 4 = 128


def test_cdna_lds_and_sgpr_limits():
    # 32 KiB per 4-wave workgroup: 2 fit in gfx942's 64 KiB (2 waves/SIMD), 5 in gfx950's 160.
    assert si.amd_waves_per_simd(64, 0, 32768, "gfx942", 4) == 2
    assert si.amd_waves_per_simd(64, 0, 32768, "gfx950", 4) == 5
    assert si.amd_waves_per_simd(64, 0, 65537, "gfx942", 4) == 0
    text = si._next_step_text("gfx942", 0, {"registers": 8, "lds": 0}, 64, 0, 4)
    assert "does not launch" in text
    text = si._next_step_text("gfx942", 0, {"registers": 8, "lds": 0}, 64, 0, 4,
                              memory=(65537, 65536))  # fmt: skip
    assert "needs 65537 B, more than a CU's LDS (65536 B)" in text
    assert si.amd_waves_per_simd(64, 0, sgprs=100) == 8
    assert si.amd_waves_per_simd(64, 0, sgprs=101) == 7


def test_hopper_by_hand():
    # 255 regs: 255*32 = 8160 -> 8192 per warp; 65536/8192 = 8 warps = 2 blocks of 4 warps.
    # 56 KiB + 1 KiB reserved per block: 228 KiB fits 4 blocks, so registers limit: 8 warps.
    assert si.nvidia_warps_per_sm(255, 56 * 1024, 4) == 8
    # 128 regs: 4096 per warp -> 16 warps; no shared memory limit.
    assert si.nvidia_warps_per_sm(128, 0, 4) == 16
    # 32 regs: 1024 per warp -> 64 warps, the SM's maximum.
    assert si.nvidia_warps_per_sm(32, 0, 4) == 64
    # 100 KiB shared (+1 KiB) per block: 2 blocks of 4 warps although registers allow 32 warps.
    assert si.nvidia_warps_per_sm(64, 100 * 1024, 4) == 8
    # 1-warp blocks: at most 32 blocks per SM.
    assert si.nvidia_warps_per_sm(16, 0, 1) == 32
    with pytest.raises(ValueError, match="at most 255"):
        si.nvidia_warps_per_sm(256, 0, 4)


def test_registers_to_next_step():
    assert si.registers_to_next_step("gfx942", 258) == (2, 2)  # aiter #6002's 258 -> 256 cliff
    assert si.registers_to_next_step("gfx942", 255) == (87, 3)  # <= 168 for 3 waves
    assert si.registers_to_next_step("gfx942", 256, 167) == (167, 2)
    assert si.registers_to_next_step("gfx950", 64) is None
    # Hopper, 4 warps at 255 regs = 2 blocks; 3 blocks need <= 65536/12 -> 5376/32 = 168 regs.
    assert si.registers_to_next_step(90, 255, num_warps=4) == (87, 12)
    assert si.registers_to_next_step(90, 32, num_warps=4) is None


# ---------------------------------------------------------------------------------------------
# Instruction mix on hand-written listings
# ---------------------------------------------------------------------------------------------

AMD_SNIPPET = """\
_k:
; %bb.0:
\tv_mfma_f32_16x16x16_bf16 v[0:3], v[4:5], v[6:7], v[0:3]
\tglobal_load_dwordx4 v[8:11], v[12:13], off
\tbuffer_load_dwordx4 v[8:11], v14, s[0:3], 0 offen
\tds_read_b128 v[8:11], v15
\tds_write_b64 v15, v[8:9]
\tv_mul_f32_e32 v1, 0x3fb8aa3b, v1
\tv_exp_f32_e32 v1, v1
\tv_fmac_f32_e32 v2, v1, v3
\tscratch_store_dword off, v1, s0 offset:4
\tscratch_load_dword v1, off, s0 offset:4
\tv_cmp_gt_i32_e32 vcc, s2, v1
\tv_cndmask_b32_e32 v1, 0, v1, vcc
\ts_cbranch_execz .LBB0_2
.LBB0_2:
\ts_endpgm
.Lfunc_end0:
"""

SASS_SNIPPET = """\
        /*0000*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ ;
        /*0020*/              @!P0 LDG.E.128 R8, desc[UR6][R2.64] ;
        /*0030*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR6][R4.64] ;
        /*0040*/                   LDSM.16.M88.4 R8, [R3] ;
        /*0050*/                   STS.128 [R3], R8 ;
        /*0060*/                   FMUL R1, R1, 1.4426950216293335 ;
        /*0070*/                   MUFU.EX2 R1, R1 ;
        /*0080*/                   FFMA R2, R1, R3, R2 ;
        /*0090*/                   STL [R1+0x4], R2 ;
        /*00a0*/                   LDL R2, [R1+0x4] ;
        /*00b0*/                   ISETP.GE.AND P0, PT, R2, 0x10, PT ;
        /*00c0*/                   SEL R2, R2, RZ, P0 ;
        /*00d0*/               @P0 BRA `(.L_x_1) ;
        /*00e0*/                   STG.E [R4.64], R2 ;
"""


def test_instruction_mix_amd():
    mix = si.instruction_mix(AMD_SNIPPET, "hip")
    expect = dict(mfma=1, global_load=1, buffer_load=1, lds_load=1, lds_store=1, exp2=1,
                  fma=1, spill_load=1, spill_store=1, compare=1, select=1, branch=1,
                  log2e_mul=1)  # fmt: skip
    assert {k: mix[k] for k in expect} == expect
    assert mix["total"] == 14 and mix["global_store"] == mix["buffer_store"] == 0


def test_instruction_mix_nvidia():
    mix = si.instruction_mix(SASS_SNIPPET, "cuda")
    expect = dict(mma=1, wgmma=1, global_load=1, global_store=1, async_copy=1, shared_load=1,
                  shared_store=1, exp2=1, fma=1, spill_load=1, spill_store=1, compare=1, select=1,
                  branch=1, log2e_mul=1)  # fmt: skip
    assert {k: mix[k] for k in expect} == expect
    assert mix["total"] == 15 and mix["tcgen05_mma"] == 0
    with pytest.raises(ValueError, match="backend"):
        si.instruction_mix(SASS_SNIPPET, "cpu")


# ---------------------------------------------------------------------------------------------
# The prefill kernel on every target
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_prefill_compiles_for_every_target(prefill, target):
    r = prefill(target)
    amd = target.startswith("gfx")
    stages = {"ttir", "ttgir", "llir", "amdgcn" if amd else "ptx"}
    assert stages <= set(r.asm), sorted(r.asm)
    assert r.constexprs["EVEN_HD"] is True  # EVEN_HD=None resolves to on for H=16, D=512
    assert r.mix["mfma" if amd else "mma"] > 0  # the two tl.dot become matrix instructions
    assert r.mix["exp2"] > 0 and r.mix["total"] > 500
    res = r.resources
    assert 1 <= res.occupancy <= (8 if amd else 64)
    assert res.occupancy == min(res.limits.values())
    rows = dict(res.as_rows())
    assert rows["num_warps"] == 4
    if amd:
        assert not re.search(r"^\s*\.(section|byte)", r.isa, re.MULTILINE)  # code only
        assert res.waves_per_simd == res.occupancy and rows["arch VGPRs"] == res.arch_vgprs
    else:
        assert "HMMA" in r.isa and "/* 0x" not in r.isa  # SASS without encodings
        assert res.warps_per_sm == res.occupancy and rows["registers"] == res.registers
    assert r.compile_seconds > 0


def _comment(amdgcn: str, name: str) -> int:
    return int(re.search(rf"^; {name}: (\d+)", amdgcn, re.MULTILINE).group(1))


@pytest.mark.parametrize("target", ["gfx942", "gfx950"])
def test_amd_resources_match_the_comment_block(prefill, target):
    r = prefill(target)
    res, text = r.resources, r.asm["amdgcn"]
    assert res.arch_vgprs == _comment(text, "NumVgprs")
    assert res.agprs == _comment(text, "NumAgprs")
    assert res.total_vgprs == _comment(text, "TotalNumVgprs")
    assert res.sgprs == _comment(text, "TotalNumSgprs")
    assert res.scratch_bytes == res.spill_bytes == _comment(text, "ScratchSize")
    assert res.compiler_occupancy == _comment(text, "Occupancy")
    # The formula, without the launch-time LDS the compiler cannot see, gives its Occupancy.
    assert si.amd_unified_vgprs(res.arch_vgprs, res.agprs) == res.total_vgprs
    sgprs = _comment(text, "NumSGPRsForWavesPerEU")
    formula = si.amd_waves_per_simd(res.arch_vgprs, res.agprs, 0, target, sgprs=sgprs)
    assert formula == res.compiler_occupancy
    assert res.lds_bytes >= _comment(text, "LDSByteSize")


@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_nvidia_resources_match_cuobjdump(prefill, target):
    from triton import knobs

    r = prefill(target)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.cubin"
        path.write_bytes(r.binary)
        usage = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "--dump-resource-usage", str(path)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    regs, local = (int(x) for x in re.search(r"REG:(\d+) .*LOCAL:(\d+)", usage).groups())
    res = r.resources
    assert (res.registers, res.local_bytes, res.spill_bytes) == (regs, local, local)
    assert res.shared_bytes >= 32 * 512 * 2  # at least one staged bf16 KV tile
    assert res.warps_per_sm == si.nvidia_warps_per_sm(regs, res.shared_bytes, 4)


def test_larger_block_k_costs_registers_or_spills(prefill):
    small, big = prefill("gfx950").resources, prefill("gfx950", BLOCK_K=128).resources
    assert (big.total_vgprs, big.spill_bytes) > (small.total_vgprs, small.spill_bytes)
    assert big.total_vgprs > small.total_vgprs or big.spill_bytes > small.spill_bytes


@pytest.mark.parametrize(
    ("target", "masking"),
    [("gfx942", ("v_cmp", "s_and_saveexec", "v_cndmask")), ("sm90", ("ISETP", "SEL"))],
)
def test_even_hd_diff_names_the_masking_that_went(prefill, target, masking):
    d = si.diff(prefill(target, EVEN_HD=False), prefill(target))
    assert not d.empty and d.isa_diff.startswith("--- a: ")
    assert "EVEN_HD=False" in d.isa_diff.splitlines()[0]
    removed = d.removed()
    gone = {op: n for op, n in removed.items() if op.startswith(masking)}
    assert gone, f"no masking instruction among the removed opcodes: {sorted(removed)}"
    assert d.removed_mix().get("compare", 0) > 0  # fewer compares in total, not just moved
    # Normalised: no raw register numbers or addresses left in the diff body.
    body = [ln for ln in d.isa_diff.splitlines() if ln[:1] in "+- " and not ln.startswith("---")]
    body = [ln for ln in body if not ln.startswith("+++")]
    assert not any(re.search(r"\b[vs]\d+\b|\bR\d+\b|/\*[0-9a-f]{4}\*/", ln) for ln in body)
    text = str(d)
    assert "resource" in text and "change" in text


def test_diff_of_identical_results_is_empty(prefill):
    r = prefill("gfx950")
    d = si.diff(r, r)
    assert d.empty and not d.removed() and not d.added() and not d.mix_delta
    with pytest.raises(ValueError, match="same backend"):
        si.diff(r, prefill("sm90"))


def test_results_are_cached(prefill):
    first = prefill("sm90")
    again = si.compile_prefill("sm90", BASE)
    # The same compile (nothing recompiled), flagged as a cache hit: its compile_seconds is
    # the first compile's time, not this call's.
    assert again.isa is first.isa and again.binary is first.binary and again.key == first.key
    assert again.from_cache and again.compile_seconds == first.compile_seconds


@pytest.mark.parametrize("target", ["gfx950", "sm90"])
def test_by_line_totals_equal_the_whole_kernel_and_the_loop_is_a_subset(prefill, target):
    r = prefill(target)
    lm = si.by_line(r)
    assert lm.totals() == r.mix  # every instruction is counted on exactly one source line
    lines = {(s.file, s.line): s for s in lm.lines}
    # The two tl.dot calls go through one helper (_mma), counted on its two call sites (ptxas'
    # line table puts a few HGMMAs of the scheduled loop on a neighbouring line); the gather is
    # the masked tl.load.
    matrix = "mfma" if target.startswith("gfx") else "mma"
    dot = [s for s in lm.lines if "= _mma(" in s.source]
    assert len(dot) == 2 and all(s.mix[matrix] for s in dot), [(s.line, s.source) for s in dot]
    on_sites = sum(s.mix[matrix] for s in dot)
    assert on_sites == r.mix[matrix] if target == "gfx950" else on_sites >= 0.9 * r.mix[matrix]
    gather = [s for s in lines.values() if "= _load_tile(" in s.source]  # the masked tl.load
    assert gather and all(s.mix["total"] for s in gather)
    loop = lm.loop
    assert loop is not None and loop.mix[matrix] > 0
    assert all(0 <= loop.mix[k] <= r.mix[k] for k in r.mix), (loop.mix, r.mix)
    assert loop.mix["total"] < r.mix["total"]
    assert sum(s.in_loop for s in lm.lines) == loop.mix["total"]
    # Each line's instructions are the listing's instructions tagged with that line.
    s = dot[0]
    assert len(lm.isa_of(s.file, s.line)) == s.mix["total"]


def test_cli_isa_by_line(prefill, capsys):
    r = prefill("gfx950")
    argv = ["isa", "--target", "gfx950", "--set", "BLOCK_H=16", "--set", "BLOCK_K=32",
            "--set", "num_warps=4", "--set", "num_stages=2", "--by-line"]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "instructions by kernel source line" in out and "main loop body" in out
    rows = re.findall(r"^(prefill\.py:\d+|\(no line\)|\S+\.py:\d+)\s+(\d+)\s", out, re.MULTILINE)
    assert sum(int(n) for _, n in rows) == r.mix["total"]
    assert re.search(rf"^mfma\s+{r.mix['mfma']}\s+\d+", out, re.MULTILINE)


def test_diff_by_line_names_the_lines_that_changed(prefill):
    even, masked = prefill("gfx942"), prefill("gfx942", EVEN_HD=False)
    rows = si.diff_by_line(even, masked)
    assert rows and all(int(r[3]) != 0 for r in rows)
    assert sum(int(r[3]) for r in rows) == masked.mix["total"] - even.mix["total"]


def test_compile_needs_pointer_dtypes_and_constexprs():
    import torch

    from sparse_mla.prefill import _sparse_mla_prefill_kernel as kernel
    from sparse_mla.prefill import launch_constexprs

    with pytest.raises(ValueError, match="constexpr parameter 'BLOCK_H'"):
        si.compile(kernel, "sm90", {})
    consts = launch_constexprs(16, 64, torch.bfloat16, BASE, has_sink=False)
    with pytest.raises(ValueError, match="pointer parameter 'q_ptr'"):
        si.compile(kernel, "sm90", consts)
    with pytest.raises(ValueError, match="not parameters"):
        si.compile(kernel, "sm90", {"BLOCK_X": 1})
    with pytest.raises(TypeError, match="kernel must be"):
        si.compile(lambda x: x, "sm90", {})
    with pytest.raises(ValueError, match="kpack=2 is a gfx942 option"):
        si.compile_prefill("gfx950", BASE, options={"kpack": 2})


def test_compile_prefill_rejects_bad_shapes():
    with pytest.raises(ValueError, match="EVEN_HD needs"):
        si.compile_prefill("gfx942", PrefillConfig(EVEN_HD=True), num_heads=12)
    with pytest.raises(ValueError, match="dtype must be"):
        si.compile_prefill("gfx942", BASE, dtype="fp8")
    with pytest.raises(ValueError, match="index_dtype must be"):
        si.compile_prefill("gfx942", BASE, index_dtype="int16")


# ---------------------------------------------------------------------------------------------
# Gluon
# ---------------------------------------------------------------------------------------------


def _gluon_kernel():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    @gluon.jit
    def exp2_scale(x_ptr, y_ptr, n, BLOCK: gl.constexpr, WARP_SIZE: gl.constexpr):
        layout: gl.constexpr = gl.BlockedLayout(
            [BLOCK // (WARP_SIZE * gl.num_warps())], [WARP_SIZE], [gl.num_warps()], [0]
        )
        offs = gl.program_id(0) * BLOCK + gl.arange(0, BLOCK, layout=layout)  # [BLOCK]
        x = gl.load(x_ptr + offs, mask=offs < n, other=0.0)
        gl.store(y_ptr + offs, gl.exp2(x) * 2.0, mask=offs < n)

    return exp2_scale


@pytest.fixture(scope="module")
def gluon_kernel():
    return _gluon_kernel()


@pytest.mark.parametrize("target", ["gfx950", "sm90"])
def test_gluon_kernel_compiles_with_the_targets_warp_size(gluon_kernel, target):
    from sparse_mla.targets import get_target

    sig = {"x_ptr": "*fp32", "y_ptr": "*fp32"}
    ws = get_target(target).warp_size
    r = si.compile(gluon_kernel, target, {"BLOCK": 1024, "WARP_SIZE": ws}, {"num_warps": 4}, sig)
    assert r.signature["n"] == "i32" and "ttgir" in r.asm
    assert r.mix["exp2"] > 0 and r.mix["global_store"] > 0
    res = r.resources
    if ws == 64:
        assert "v_exp_f32" in r.isa
        assert res.compiler_occupancy == 8
        assert si.amd_waves_per_simd(res.arch_vgprs, res.agprs, sgprs=res.sgprs) == 8
    else:
        assert "MUFU.EX2" in r.isa and res.registers < 64 and res.local_bytes == 0
    wrong = 32 if ws == 64 else 64
    with pytest.raises(RuntimeError, match=f"{ws} threads per warp"):
        si.compile(gluon_kernel, target, {"BLOCK": 1024, "WARP_SIZE": wrong}, {"num_warps": 4}, sig)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def test_cli_isa_prints_resources_and_a_diff(prefill, capsys):
    prefill("gfx942")  # same compiles as the tests above: served from the memory cache
    prefill("gfx942", EVEN_HD=False)
    argv = ["isa", "--target", "gfx942", "--set", "BLOCK_H=16", "--set", "BLOCK_K=32",
            "--set", "num_warps=4", "--set", "num_stages=2", "--set", "kpack=none",
            "--set", "waves_per_eu=none", "--set", "EVEN_HD=1",
            "--diff-against", "EVEN_HD=0", "--diff-lines", "5"]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    res = prefill("gfx942").resources
    assert re.search(rf"arch VGPRs\s+{res.arch_vgprs}\b", out)
    assert re.search(rf"waves/SIMD\s+{res.waves_per_simd}\b", out)
    assert "EVEN_HD=True" in out and "--- a: " in out and "more lines" in out
    assert re.search(r"v_cmp_\w+\s+-\d+", out)  # the opcode table shows compares removed


def test_compiler_output_is_per_call_and_other_threads_still_print(capsys):
    import threading

    inside, release, box = threading.Event(), threading.Event(), {}

    def compile_like():
        with si.compiler_output() as out:
            print("python print from the compiler")
            inside.set()
            release.wait(30)
        box["out"] = out

    t = threading.Thread(target=compile_like)
    t.start()
    assert inside.wait(30)
    print("a print from another cell")  # while the other thread captures
    release.set()
    t.join(30)
    printed = capsys.readouterr()
    assert "a print from another cell" in printed.out
    assert "from the compiler" not in printed.out + printed.err
    assert "python print from the compiler" in box["out"].text
    assert not isinstance(sys.stdout, si._ThreadRoutedStream)  # nothing left installed
    # Blocks nest (compiler_quiet around compile): the inner one takes its own output only.
    with si.compiler_output() as outer:
        print("outer before")
        with si.compiler_output() as inner:
            print("inner")
        print("outer after")
    assert inner.text == "inner\n" and outer.text == "outer before\nouter after\n"


_PRINT_WHILE_COMPILING = """
import sys, threading, time
from sparse_mla import inspect as si
from sparse_mla.prefill import PrefillConfig

started, done, count = threading.Event(), threading.Event(), [0]

def chatter():
    i = 0
    while not done.is_set() or i < 20:
        print(f"line {i}", flush=True)
        started.set()
        i += 1
        time.sleep(0.002)
    count[0] = i

t = threading.Thread(target=chatter)
t.start()
started.wait()
before = count[0]
try:  # Triton 3.6's AMD pipeliner fails here, printing MLIR's diagnostics from C++ to fd 2
    si.compile_prefill("gfx950", PrefillConfig(BLOCK_K=64, num_warps=1, num_stages=4))
    failed = None
except si.CompileFailed as e:
    failed = e
ok = si.compile_prefill("gfx942", PrefillConfig(BLOCK_K=32, num_warps=4, num_stages=2))
done.set()
t.join()
print(f"printed {count[0]}", flush=True)
print(f"summary {failed.summary if failed else None}", flush=True)
print(f"pass {failed.pass_name if failed else None}", flush=True)
kept = "mlir_reproducer" in failed.output and "mlir_reproducer" in failed.log_path.read_text()
print(f"kept {kept}", flush=True)
print(f"vgprs {ok.resources.arch_vgprs}", flush=True)
"""


def test_a_thread_printing_while_compiling_loses_nothing(tmp_path):
    # A real process with fds 1 and 2 (capsys would hide an fd-level redirect): another
    # thread's prints during a failing and a working cross-compile all reach stdout, and the
    # compiler's own output (MLIR's C++ diagnostics) reaches neither stream but stays in the
    # CompileFailed.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPARSE_MLA_FAILURE_DIR": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-c", _PRINT_WHILE_COMPILING], capture_output=True, text=True,
        env=env, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout.splitlines()
    n = int(next(ln for ln in out if ln.startswith("printed ")).split()[1])
    assert n > 20
    lines = [ln for ln in out if ln.startswith("line ")]
    assert lines == [f"line {i}" for i in range(n)]
    assert "pass TritonAMDGPUPipeline" in out
    assert "kept True" in out
    assert any(ln.startswith("vgprs ") and int(ln.split()[1]) > 0 for ln in out)
    assert "mlir_reproducer" not in run.stdout + run.stderr
    assert "error:" not in run.stderr and "LLVM ERROR" not in run.stderr


def test_a_compile_worker_that_died_is_replaced_and_a_crash_is_one_compile_failure():
    si.clear_cache()
    cfg = PrefillConfig(BLOCK_H=16, BLOCK_K=16, num_warps=4, num_stages=2)
    first = si.compile_prefill("gfx942", cfg, num_heads=8, head_dim=64)
    si._worker.proc.kill()  # between compiles: the next one starts a new worker
    si._worker.proc.wait()
    si.clear_cache()
    again = si.compile_prefill("gfx942", cfg, num_heads=8, head_dim=64)
    assert again.isa == first.isa and not again.from_cache
    # The compiler dying during a compile (a crash) is a CompileFailed, not a dead notebook.
    worker = si._worker
    real_call = worker.call

    def die(req):
        worker.proc.kill()
        return real_call(req)

    worker.call = die
    si.clear_cache()
    with pytest.raises(si.CompileFailed, match="compiler process died"):
        si.compile_prefill("gfx942", cfg, num_heads=8, head_dim=64)
    si.clear_cache()
    assert si.compile_prefill("gfx942", cfg, num_heads=8, head_dim=64).isa == first.isa


def test_failed_compile_names_the_pass_in_one_line_and_keeps_the_reproducer(
    tmp_path, monkeypatch, capfd
):
    monkeypatch.setenv("SPARSE_MLA_FAILURE_DIR", str(tmp_path))
    cfg = PrefillConfig(BLOCK_K=64, num_warps=1, num_stages=4)  # Triton 3.6's AMD pipeliner fails
    with pytest.raises(si.CompileFailed) as info:
        si.compile_prefill("gfx950", cfg, num_heads=16, head_dim=512)
    e = info.value
    assert e.pass_name == "TritonAMDGPUPipeline" and e.stage == "ttgir"
    assert e.location and e.location.startswith("prefill.py:")
    assert "\n" not in e.summary and "BLOCK_K=64" in e.summary and "num_stages=4" in e.summary
    assert si.failure_reason(e) == e.summary[:300]
    assert e.log_path.parent == tmp_path and "mlir_reproducer" in e.log_path.read_text()
    printed = capfd.readouterr()
    assert "mlir_reproducer" not in printed.out + printed.err


def test_cli_isa_failed_compile_is_one_line_and_exits_1(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("SPARSE_MLA_FAILURE_DIR", str(tmp_path))
    argv = ["isa", "--target", "gfx950", "--set", "BLOCK_K=64", "--set", "num_warps=1",
            "--set", "num_stages=4"]  # fmt: skip
    assert cli.main(argv) == 1
    err = capfd.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 2, err
    assert "TritonAMDGPUPipeline (stage ttgir) failed" in lines[0]
    assert str(tmp_path) in lines[1]


def test_cli_isa_cannot_launch_exits_nonzero(capsys):
    # gfx942, BLOCK_K=128: one workgroup needs more LDS than a CU's 64 KiB.
    assert cli.main(["isa", "--target", "gfx942", "--set", "BLOCK_K=128"]) == 1
    captured = capsys.readouterr()
    assert "cannot launch" in captured.err and "more than a CU's LDS (65536 B)" in captured.err
    assert "waves/SIMD" in captured.out  # the resources are still printed


def test_cli_isa_names_its_base_config(capsys):
    assert cli.main(["isa", "--target", "gfx950", "--heads", "16"]) == 0
    out = capsys.readouterr().out
    assert "base config: the default for H=16 D=512" in out and "no tuned entry" in out
    assert cli.main(["isa", "--target", "sm90", "--heads", "16", "--set", "BLOCK_K=16"]) == 0
    out = capsys.readouterr().out
    assert "base config: tuned entry H16_D512" in out and "NVIDIA H200" in out
    assert "with BLOCK_K=16 over it" in out


@pytest.mark.parametrize(
    "setting, said",
    [("EVEN_HD=maybe", "EVEN_HD takes true/false"), ("BLOCK_K=big", "BLOCK_K takes an integer"),
     ("num_warps=true", "num_warps takes an integer"), ("BLOCK_Q=16", "unknown setting")],
)  # fmt: skip
def test_cli_isa_type_checks_set_values(setting, said, capsys):
    assert cli.main(["isa", "--set", setting]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err


def test_limits_are_explained():
    r = si.Resources(backend="hip", arch="gfx942", num_warps=4, occupancy=1, spill_bytes=0,
                     limits={"registers": 1, "sgprs": 8, "lds": 5})  # fmt: skip
    assert r.limits_text() == "registers 1, SGPRs 8, LDS 5 waves/SIMD; registers binds"
    assert dict(r.as_rows())["occupancy allowed by"] == r.limits_text()


def test_cli_isa_rejects_a_bad_setting(capsys):
    with pytest.raises(SystemExit):
        cli.main(["isa", "--set", "BLOCK_K"])
    assert "expected KEY=VAL" in capsys.readouterr().err


@pytest.mark.parametrize("target", ["sm90", "gfx950"])
def test_resources_of_a_compiled_kernel_match_compile(target, monkeypatch):
    # The time sweep reads resources from the kernel it launched (a CompiledKernel of this
    # process); they must be what inspect.compile reports from its compile worker.
    import triton

    si.clear_cache()
    res = si.compile_prefill(target, None, num_heads=16, head_dim=512)
    captured = []
    real = triton.compile

    def spy(*args, **kwargs):
        captured.append(real(*args, **kwargs))
        return captured[-1]

    monkeypatch.setattr(triton, "compile", spy)
    monkeypatch.setattr(si, "_compile_in_worker", lambda *a: (None, None, ""))  # in-process
    si.clear_cache()
    here = si.compile_prefill(target, None, num_heads=16, head_dim=512)
    assert len(captured) == 1
    assert si.resources_of(captured[0], target) == res.resources == here.resources
    assert here.isa == res.isa
    assert res.resources.occupancy > 0


def test_line_info_of_a_cached_binary_from_a_deleted_checkout_maps_here():
    """Triton's disk cache is keyed by source, so a cached binary can name the files of another
    checkout of the same code; by_line then reads this package's copy, not an empty line."""
    from pathlib import Path

    import sparse_mla.gluon.hopper_ws as ws

    gone = "/no/such/checkout/sparse_mla/gluon/hopper_ws.py"
    assert si._here(gone) == str(Path(ws.__file__).resolve())
    assert si._here("/no/such/place/other.py") == "/no/such/place/other.py"
    assert si._here(ws.__file__) == ws.__file__


def _gluon_kernel_with_a_bad_call():
    """A Gluon kernel whose helper passes a tensor where a builtin takes an int: Triton
    raises a TypeError inside that helper, wrapped in a CompilationError per call level
    (the outer one's text ends at its caret line, with no message)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier

    @gluon.jit
    def helper(n):
        bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        mbarrier.init(bar.index(0), count=n + 1)  # count must be a Python int

    @gluon.jit
    def kernel(x_ptr, n):
        helper(n)

    return kernel


def test_a_failed_gluon_compile_says_the_builtins_error(tmp_path, monkeypatch):
    # The one-line summary names the innermost error (the builtin's TypeError), not the
    # outer CompilationError's caret line, and the Gluon warp-size hint (for layout errors)
    # is not added to an error that is not about layouts.
    monkeypatch.setenv("SPARSE_MLA_FAILURE_DIR", str(tmp_path))
    kernel = _gluon_kernel_with_a_bad_call()
    with pytest.raises(si.CompileFailed) as info:
        si.compile(kernel, "sm90", signature={"x_ptr": "*i32", "n": "i32"},
                   options={"num_warps": 4})  # fmt: skip
    e = info.value
    assert "create_mbarrier_init" in e.message and e.message.startswith("TypeError:"), e.message
    assert "^" not in e.summary and "warp size" not in e.summary, e.summary
    assert "\n" not in e.summary


def test_a_compiler_crash_says_the_line_before_llvms_unreachable():
    # A crash in LLVM (here: an inline-asm constraint count) kills the compiler process; its
    # last words before "UNREACHABLE executed" go into the one-line message.
    e = si._WorkerFailure({"type": "CompilerCrashed", "stage": None, "traceback": "",
                           "message": "the compiler process died (EOFError())"})  # fmt: skip
    output = (
        "Failure value returned from cantFail wrapped call\n"
        "number of input constraints does not match number of parameters\n"
        "UNREACHABLE executed at /source/llvm/include/llvm/Support/Error.h:779!\n"
    )
    _, _, message, _ = si._classify_failure(e, output)
    assert message == (
        "CompilerCrashed: the compiler process died (EOFError()) "
        "(number of input constraints does not match number of parameters)"
    )


def test_partition_counts_splits_sass_at_each_setmaxnreg():
    isa = "\n".join([
        "LDG.E R1, desc[UR4][R2.64] ;",  # before any setmaxnreg: partition 0
        "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe8 ;",
        "LDG.E R1, desc[UR4][R2.64] ;", "STL [R1], R2 ;", "LDGSTS [R1], desc[UR4][R2.64] ;",
        "USETMAXREG.DEALLOC.CTAPOOL 0x30 ;",
        "LDG.E.64 R4, desc[UR4][R6.64] ;", "LDG.E R1, desc[UR4][R2.64] ;",
    ])  # fmt: skip
    assert si.partition_counts(isa, r"\bLDG\b") == {0: 1, 0xE8: 1, 0x30: 2}
    assert si.partition_counts(isa, "STL") == {0xE8: 1}
    assert si.partition_counts(isa, "HGMMA") == {}
