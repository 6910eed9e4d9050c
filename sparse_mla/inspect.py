"""Compile any kernel for any target without its GPU; read what the compiler made of it.

:func:`compile` cross-compiles a ``@triton.jit`` or Gluon kernel for a named target
(:mod:`sparse_mla.targets`) and returns a :class:`CompileResult`: every IR stage, the final ISA
(SASS on NVIDIA via Triton's bundled ``cuobjdump``, the AMDGCN listing on AMD), the resources
the compiler reports, the occupancy they allow (the formulas in docs/ENVIRONMENT.md) and an
instruction mix. :func:`diff` compares two variants: resources side by side and a unified ISA
diff with addresses, register numbers and hex constants normalised; :func:`diff_by_line`
summarises it by kernel source line. :func:`by_line` maps each source line to the instructions
it produced and finds the main loop's body. :func:`compile_prefill` does all of this for the
prefill kernel from a :class:`~sparse_mla.prefill.PrefillConfig`.

Results are cached in memory by (kernel source, target, constexprs, options, signature), so a
widget that flips a constexpr back gets its answer at once (``from_cache`` says so). Triton's
on-disk cache also applies: ``compile_seconds`` is the time this process spent, which is small
on a disk-cache hit. The compile runs in a child process (``sparse_mla/_compile_worker.py``,
started once), so what the compiler prints, its C++ diagnostics on file descriptor 2 included,
is captured there and no other thread of the caller loses output; a failed compile raises
:class:`CompileFailed`, one line naming the pass, with the compiler's whole output kept in a
file.
"""

from __future__ import annotations

import atexit
import contextlib
import difflib
import hashlib
import io
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from .targets import Target, get_target, triton_target, validate_options

__all__ = [
    "CompileFailed",
    "CompileResult",
    "Diff",
    "Resources",
    "amd_unified_vgprs",
    "amd_waves_per_simd",
    "by_line",
    "by_line_table",
    "clear_cache",
    "compile",
    "compile_kernel",
    "compile_prefill",
    "compiler_output",
    "diff",
    "instruction_mix",
    "nvidia_warps_per_sm",
    "opcode_counts",
    "partition_counts",
    "registers_to_next_step",
]

# ----------------------------------------------------------------------------------------------
# Occupancy formulas (docs/ENVIRONMENT.md, "Occupancy formulas")
# ----------------------------------------------------------------------------------------------

_CDNA_REGS_PER_SIMD = 512  # unified VGPR + AGPR file per lane, per SIMD
_CDNA_MAX_WAVES = 8
_CDNA_SIMDS_PER_CU = 4
_CDNA_LDS_PER_CU = {"gfx942": 64 * 1024, "gfx950": 160 * 1024}

_NV_REGS_PER_SM = 65536
_NV_REG_UNIT = 256  # registers are allocated per warp in units of 256
_NV_MAX_WARPS = 64
_NV_MAX_BLOCKS = 32
_NV_SMEM_PER_SM = 228 * 1024
_NV_SMEM_RESERVED = 1024  # per block, taken by the driver on sm80+


def _roundup(x: int, m: int) -> int:
    return -(-x // m) * m


def amd_unified_vgprs(arch_vgprs: int, agprs: int = 0) -> int:
    """CDNA3/4 unified register count: roundup(arch VGPRs, 4) + AGPRs when AGPRs are used."""
    return _roundup(arch_vgprs, 4) + agprs if agprs else arch_vgprs


def _cdna_waves_for_total(total: int) -> int:
    return min(_CDNA_MAX_WAVES, _CDNA_REGS_PER_SIMD // _roundup(max(total, 1), 8))


def _amd_limits(
    arch_vgprs: int,
    agprs: int,
    lds_bytes: int,
    arch: str,
    waves_per_workgroup: int,
    sgprs: int | None,
) -> dict[str, int]:
    limits = {"registers": _cdna_waves_for_total(amd_unified_vgprs(arch_vgprs, agprs))}
    if sgprs is not None:
        # GFX9: the SGPR file allows 8 waves up to 100 SGPRs (80/88 would allow 10/9), else 7.
        limits["sgprs"] = _CDNA_MAX_WAVES if sgprs <= 100 else 7
    if lds_bytes > 0:
        lds_per_cu = _CDNA_LDS_PER_CU.get(arch, 64 * 1024)
        groups = lds_per_cu // lds_bytes
        # Ceil: a CU holding fewer waves than SIMDs still runs one wave on some SIMD.
        waves = -(-groups * waves_per_workgroup // _CDNA_SIMDS_PER_CU)
        limits["lds"] = min(_CDNA_MAX_WAVES, waves)
    return limits


def amd_waves_per_simd(
    arch_vgprs: int,
    agprs: int = 0,
    lds_bytes: int = 0,
    arch: str = "gfx942",
    waves_per_workgroup: int = 4,
    *,
    sgprs: int | None = None,
) -> int:
    """Waves per SIMD on CDNA3/CDNA4 (gfx942, gfx950).

    Registers: total = roundup(arch VGPRs, 4) + AGPRs (when AGPRs are used); waves =
    min(8, floor(512 / roundup(total, 8))), i.e. <=64 -> 8, <=72 -> 7, <=80 -> 6, <=96 -> 5,
    <=128 -> 4, <=168 -> 3, <=256 -> 2, else 1. Then the min with the LDS limit (workgroups that
    fit in the CU's LDS, 64 KiB on gfx942 and 160 KiB on gfx950, times ``waves_per_workgroup``
    over 4 SIMDs, rounded up) and, if ``sgprs`` is given, the GFX9 SGPR limit (7 waves above
    100 SGPRs).
    0 means the workgroup's LDS does not fit.
    """
    return min(_amd_limits(arch_vgprs, agprs, lds_bytes, arch, waves_per_workgroup, sgprs).values())


def _nvidia_limits(registers: int, shared_bytes: int, num_warps: int) -> dict[str, int]:
    regs_per_warp = _roundup(max(registers, 1) * 32, _NV_REG_UNIT)
    blocks = {
        "registers": (_NV_REGS_PER_SM // regs_per_warp) // num_warps,
        "shared": _NV_SMEM_PER_SM // (shared_bytes + _NV_SMEM_RESERVED),
        "warps": _NV_MAX_WARPS // num_warps,
    }
    return {k: min(v, _NV_MAX_BLOCKS) * num_warps for k, v in blocks.items()}


def nvidia_warps_per_sm(registers: int, shared_bytes: int, num_warps: int) -> int:
    """Resident warps per SM on Hopper/Blackwell for a block of ``num_warps`` warps.

    65,536 registers per SM allocated per warp in units of 256 (registers * 32 rounded up),
    228 KiB shared memory per SM with 1 KiB reserved per block, at most 64 warps and 32 blocks.
    Blocks per SM = min over those limits; the result is blocks * num_warps.
    """
    if registers > 255:
        raise ValueError(f"registers: at most 255 per thread, got {registers}")
    return min(_nvidia_limits(registers, shared_bytes, num_warps).values())


def registers_to_next_step(
    arch: str | int, used: int, agprs: int = 0, num_warps: int = 4
) -> tuple[int, int] | None:
    """Registers to shed for the next occupancy step, counting the register limit only.

    ``arch``: a gfx id (``used`` = arch VGPRs, ``agprs`` as compiled) or an NVIDIA compute
    capability / ``"sm90"`` (``used`` = registers per thread). Returns (registers to shed,
    occupancy then) or None when registers already allow the maximum.
    """
    if isinstance(arch, str) and arch.startswith("gfx"):
        now = _cdna_waves_for_total(amd_unified_vgprs(used, agprs))
        if now >= _CDNA_MAX_WAVES:
            return None
        cap = (_CDNA_REGS_PER_SIMD // (now + 1)) // 8 * 8  # largest total with one more wave
        best: tuple[int, int] | None = None  # (registers shed, unified total then)
        for x in range(used + 1):  # x arch VGPRs shed, the rest from AGPRs
            total = amd_unified_vgprs(used - x, agprs)
            y = max(0, total - cap)
            if y <= agprs and (best is None or x + y < best[0]):
                best = (x + y, total - y)
        assert best is not None
        return best[0], _cdna_waves_for_total(best[1])
    warps = _nvidia_limits(used, 0, num_warps)["registers"]
    blocks = warps // num_warps
    cap_warps = min(_NV_MAX_WARPS, _NV_MAX_BLOCKS * num_warps)
    if warps >= cap_warps:
        return None
    regs_per_warp = (_NV_REGS_PER_SM // ((blocks + 1) * num_warps)) // _NV_REG_UNIT * _NV_REG_UNIT
    max_regs = min(255, regs_per_warp // 32)
    return used - max_regs, (blocks + 1) * num_warps


# ----------------------------------------------------------------------------------------------
# Resources
# ----------------------------------------------------------------------------------------------


_LIMIT_NAMES = {
    "registers": "registers",
    "sgprs": "SGPRs",
    "lds": "LDS",
    "shared": "shared memory",
    "warps": "warp slots",
}


@dataclass
class Resources:
    """What one compiled kernel uses and the occupancy that allows.

    AMD fields come from the AMDGCN kernel-info comment block (``; NumVgprs:`` ...); LDS is the
    larger of the compile-time ``; LDSByteSize:`` and what Triton allocates at launch. NVIDIA
    fields come from ``cuobjdump --dump-resource-usage`` (REG, LOCAL, SHARED static) plus
    Triton's dynamic shared memory. ``occupancy`` is waves per SIMD (AMD) or warps per SM
    (NVIDIA), the min over ``limits``; ``next_step`` says what would raise it (None at max).
    """

    backend: str
    arch: int | str
    num_warps: int
    occupancy: int
    spill_bytes: int
    next_step: str | None = None
    limits: dict[str, int] = field(default_factory=dict)
    # AMD
    arch_vgprs: int | None = None
    agprs: int | None = None
    total_vgprs: int | None = None
    sgprs: int | None = None
    scratch_bytes: int | None = None
    lds_bytes: int | None = None
    waves_per_simd: int | None = None
    compiler_occupancy: int | None = None
    # NVIDIA
    registers: int | None = None
    shared_bytes: int | None = None
    static_shared_bytes: int | None = None
    local_bytes: int | None = None
    stack_bytes: int | None = None
    warps_per_sm: int | None = None
    # Warp-specialised kernels (Gluon ``warp_specialize``): (partition, warps, registers per
    # thread after ``setmaxnreg``), the default partition first; None for a plain kernel.
    partitions: list[tuple[str, int, int]] | None = None

    def as_rows(self) -> list[tuple[str, Any]]:
        """[(name, value)] in display order, for tables."""
        if self.backend == "hip":
            names = [
                ("arch VGPRs", self.arch_vgprs),
                ("AGPRs", self.agprs),
                ("unified VGPRs", self.total_vgprs),
                ("SGPRs", self.sgprs),
                ("scratch bytes", self.scratch_bytes),
                ("LDS bytes", self.lds_bytes),
                ("waves/SIMD", self.waves_per_simd),
                ("compiler occupancy", self.compiler_occupancy),
            ]
        else:
            names = [
                ("registers", self.registers),
                ("shared bytes", self.shared_bytes),
                ("local bytes", self.local_bytes),
                ("stack bytes", self.stack_bytes),
                ("warps/SM", self.warps_per_sm),
            ]
            if self.partitions:
                names.append(
                    (
                        "registers per partition",
                        ", ".join(f"{n}: {w} warps x {r}" for n, w, r in self.partitions),
                    )
                )
        return [
            ("num_warps", self.num_warps),
            *names,
            ("occupancy allowed by", self.limits_text()),
            ("next step", self.next_step or "-"),
        ]

    def limits_text(self) -> str:
        """What each resource alone would allow, in the occupancy's unit, and which binds:
        e.g. "registers 1, SGPRs 8, LDS 5 waves/SIMD; registers bind"."""
        if not self.limits:
            return "-"
        unit = "waves/SIMD" if self.backend == "hip" else "warps/SM"
        allowed = ", ".join(f"{_LIMIT_NAMES.get(k, k)} {v}" for k, v in self.limits.items())
        binding = [_LIMIT_NAMES.get(k, k) for k, v in self.limits.items() if v == self.occupancy]
        verb = "binds" if len(binding) == 1 else "bind"
        return f"{allowed} {unit}; {' and '.join(binding)} {verb}"

    def __str__(self) -> str:
        return _table(["resource", "value"], [[k, v] for k, v in self.as_rows()])


def _int(pattern: str, text: str) -> int | None:
    m = re.search(pattern, text, re.MULTILINE)
    return int(m.group(1)) if m else None


def _amd_resources(amdgcn: str, arch: str, num_warps: int, triton_shared: int) -> Resources:
    arch_vgprs = _int(r"^; NumVgprs: (\d+)", amdgcn)
    if arch_vgprs is None:
        raise RuntimeError("AMDGCN text has no '; NumVgprs:' kernel-info block")
    agprs = _int(r"^; NumAgprs: (\d+)", amdgcn) or 0
    sgprs = _int(r"^; TotalNumSgprs: (\d+)", amdgcn)
    sgprs_for_waves = _int(r"^; NumSGPRsForWavesPerEU: (\d+)", amdgcn)
    lds = max(_int(r"^; LDSByteSize: (\d+)", amdgcn) or 0, triton_shared)
    scratch = _int(r"^; ScratchSize: (\d+)", amdgcn) or 0
    limits = _amd_limits(
        arch_vgprs, agprs, lds, arch, num_warps, sgprs_for_waves if sgprs_for_waves else sgprs
    )
    occ = min(limits.values())
    return Resources(
        backend="hip",
        arch=arch,
        num_warps=num_warps,
        occupancy=occ,
        spill_bytes=scratch,
        next_step=_next_step_text(
            arch,
            occ,
            limits,
            arch_vgprs,
            agprs,
            num_warps,
            memory=(lds, _CDNA_LDS_PER_CU.get(arch, 64 * 1024)),
        ),
        limits=limits,
        arch_vgprs=arch_vgprs,
        agprs=agprs,
        total_vgprs=_int(r"^; TotalNumVgprs: (\d+)", amdgcn)
        or amd_unified_vgprs(arch_vgprs, agprs),
        sgprs=sgprs,
        scratch_bytes=scratch,
        lds_bytes=lds,
        waves_per_simd=occ,
        compiler_occupancy=_int(r"^; Occupancy: (\d+)", amdgcn),
    )


def warp_partitions(ttgir: str, ptx: str) -> list[tuple[str, int, int]] | None:
    """(partition, warps, registers) of a warp-specialised kernel, or None.

    The workers' warps and requested registers are in the TTGIR (``partitionN ... num_warps(w)``,
    ``requestedRegisters``). The default partition gets what is left of the register file:
    every warpgroup starts with the launch's share (65,536 / threads, rounded down to 8), the
    workers give theirs up to ``setmaxnreg``, and the default takes the rest, at most 256. The
    PTX must carry that ``setmaxnreg`` value (checked)."""
    req = re.search(r"requestedRegisters = array<i32: ([\d, ]+)>", ttgir)
    if not req:
        return None
    regs = [int(x) for x in req.group(1).split(",")]
    warps = [int(w) for w in re.findall(r"partition\d+\([^\n]*num_warps\((\d+)\)", ttgir)]
    default_warps = _int(r'"ttg.num-warps" = (\d+)', ttgir) or 0
    total_warps = default_warps + sum(warps)
    groups = -(-total_warps // 4)
    share = (65536 // (32 * 4 * groups)) // 8 * 8
    worker_groups = [-(-w // 4) for w in warps]
    left = share * groups - sum(r * g for r, g in zip(regs, worker_groups, strict=True))
    default_regs = min(256, left // max(1, -(-default_warps // 4)))
    seen = {int(v) for v in re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)}
    if default_regs not in seen:
        raise RuntimeError(
            f"warp_partitions: the default partition's {default_regs} registers are not a "
            f"setmaxnreg value of the PTX ({sorted(seen)}): the allocation rule changed"
        )
    rows = [("default", default_warps, default_regs)]
    for i, r in enumerate(regs):
        rows.append((f"worker {i}", warps[i] if i < len(warps) else 0, r))
    return rows


def partition_counts(isa: str, pattern: str) -> dict[int, int]:
    """Lines of an sm90 warp-specialised kernel's SASS that match ``pattern`` (a regular
    expression), by partition, each partition named by the register count of the
    ``setmaxnreg`` that opens it (0: code before any), e.g. ``partition_counts(isa, r"\bLDG")``
    for each partition's global loads, ``"STL"`` for its spill stores."""
    counts: dict[int, int] = {}
    regs = 0
    for line in isa.splitlines():
        m = re.search(r"USETMAXREG\.\w+\.CTAPOOL\s+(?:UP0, )?(0x[0-9a-f]+)", line)
        if m:
            regs = int(m.group(1), 16)
        if re.search(pattern, line):
            counts[regs] = counts.get(regs, 0) + 1
    return counts


def _nvidia_resources(usage: str, arch: int, num_warps: int, triton_shared: int) -> Resources:
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    if not m:
        raise RuntimeError(f"cuobjdump printed no REG/STACK/SHARED/LOCAL line:\n{usage}")
    regs, stack, static_shared, local = map(int, m.groups())
    shared = triton_shared + static_shared
    limits = _nvidia_limits(regs, shared, num_warps)
    occ = min(limits.values())
    return Resources(
        backend="cuda",
        arch=arch,
        num_warps=num_warps,
        occupancy=occ,
        spill_bytes=local,
        next_step=_next_step_text(
            arch,
            occ,
            limits,
            regs,
            0,
            num_warps,
            memory=(shared + _NV_SMEM_RESERVED, _NV_SMEM_PER_SM),
        ),
        limits=limits,
        registers=regs,
        shared_bytes=shared,
        static_shared_bytes=static_shared,
        local_bytes=local,
        stack_bytes=stack,
        warps_per_sm=occ,
    )


def _next_step_text(
    arch: int | str,
    occ: int,
    limits: dict[str, int],
    used: int,
    agprs: int,
    num_warps: int,
    *,
    memory: tuple[int, int] | None = None,
) -> str | None:
    amd = isinstance(arch, str)
    unit, reg_name = ("waves/SIMD", "VGPRs") if amd else ("warps/SM", "registers")
    cap = _CDNA_MAX_WAVES if amd else min(_NV_MAX_WARPS, _NV_MAX_BLOCKS * num_warps)
    if occ >= cap:
        return None
    if occ == 0:
        where = "a CU's LDS" if amd else "an SM's shared memory"
        if memory is not None:
            need, have = memory
            return f"does not launch: one workgroup needs {need} B, more than {where} ({have} B)"
        return f"does not launch: one workgroup needs more than {where}"
    if limits["registers"] == occ:
        step = registers_to_next_step(arch, used, agprs, num_warps)
        if step is not None:
            shed, then = step
            others = min((v for k, v in limits.items() if k != "registers"), default=then)
            if min(then, others) > occ:
                return f"shed {shed} {reg_name} for {min(then, others)} {unit}"
    binding = [k for k, v in limits.items() if v == occ and k != "registers"]
    if binding:
        return f"limited by {', '.join(binding)} at {occ} {unit}"
    return None


# ----------------------------------------------------------------------------------------------
# ISA text and instruction mix
# ----------------------------------------------------------------------------------------------

_AMD_MIX: list[tuple[str, tuple[str, ...]]] = [
    ("mfma", ("v_mfma", "v_smfmac")),
    ("global_load", ("global_load", "flat_load")),
    ("global_store", ("global_store", "flat_store")),
    ("buffer_load", ("buffer_load",)),
    ("buffer_store", ("buffer_store",)),
    ("lds_load", ("ds_read", "ds_load")),
    ("lds_store", ("ds_write", "ds_store")),
    ("exp2", ("v_exp_",)),
    ("fma", ("v_fma_", "v_fmac_", "v_pk_fma_")),
    ("spill_load", ("scratch_load",)),
    ("spill_store", ("scratch_store",)),
    ("branch", ("s_branch", "s_cbranch")),
    ("compare", ("v_cmp", "s_cmp")),
    ("select", ("v_cndmask",)),
]
_NV_MIX: list[tuple[str, tuple[str, ...]]] = [
    ("mma", ("HMMA", "IMMA")),
    ("wgmma", ("HGMMA", "IGMMA", "QGMMA")),
    ("tcgen05_mma", ("UTCHMMA", "UTCQMMA", "UTCIMMA", "UTCOMMA", "UTCMMA")),
    ("global_load", ("LDG",)),
    ("global_store", ("STG",)),
    ("async_copy", ("LDGSTS", "UTMALDG", "UBLKCP")),
    ("shared_load", ("LDS", "LDSM")),
    ("shared_store", ("STS", "STSM")),
    ("exp2", ("MUFU.EX2",)),
    ("fma", ("FFMA", "FFMA2", "HFMA2")),
    ("spill_load", ("LDL",)),
    ("spill_store", ("STL",)),
    ("branch", ("BRA", "BRX", "JMP", "JMX")),
    ("compare", ("ISETP", "FSETP", "HSETP2", "DSETP")),
    ("select", ("SEL", "FSEL")),
]
# log2(e) as an fp32 immediate: where tl.exp is lowered to exp2(x * log2(e)).
_LOG2E_IMM = {"hip": ("0x3fb8aa3b",), "cuda": ("1.4426950216293335", "0x3fb8aa3b")}

_SASS_LINE = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
_SASS_PRED = re.compile(r"^@!?U?P[0-9T]+\s+")


def _amd_code(amdgcn: str, name: str) -> str:
    """The kernel's instruction listing: from its label to ``.Lfunc_end``."""
    start = re.search(rf"^{re.escape(name)}:", amdgcn, re.MULTILINE)
    if not start:
        return amdgcn
    end = re.compile(r"^(\s*\.section|\.Lfunc_end\d+:)", re.MULTILINE).search(amdgcn, start.end())
    return amdgcn[start.start() : end.start() if end else len(amdgcn)]


def _instructions(isa: str, backend: str) -> list[str]:
    """Instruction texts (no addresses, encodings, labels, directives or comments)."""
    out = []
    for line in isa.splitlines():
        if backend == "cuda":
            m = _SASS_LINE.match(line)
            if m:
                out.append(_SASS_PRED.sub("", m.group(1)))
        else:
            s = line.split(";", 1)[0].strip()
            if s and not s.startswith(".") and not s.endswith(":"):
                out.append(s)
    return out


def _opcode(instr: str, backend: str) -> str:
    op = instr.split(None, 1)[0]
    if backend == "cuda":
        return op
    return re.sub(r"_(e32|e64|sdwa|dpp|vop3)$", "", op)


def opcode_counts(isa: str, backend: str) -> Counter:
    """Counter of opcodes: AMD mnemonics without encoding suffix (``v_cndmask_b32``), NVIDIA
    opcodes with modifiers (``ISETP.GE.AND``); predicates are dropped."""
    return Counter(_opcode(i, backend) for i in _instructions(isa, backend))


def instruction_mix(isa: str, backend: str) -> dict[str, int]:
    """Instruction counts by kind, from the ISA text (static counts, not executed ones).

    AMD (``backend="hip"``): ``mfma`` v_mfma/v_smfmac; ``global_load``/``global_store``
    global_/flat_ memory ops; ``buffer_load``/``buffer_store`` buffer ops (Triton emits them
    when it can prove offsets fit 32 bits); ``lds_load``/``lds_store`` ds_read/ds_write;
    ``exp2`` v_exp_* (the hardware exponential is base 2); ``fma`` v_fma/v_fmac/v_pk_fma;
    ``spill_load``/``spill_store`` scratch_ ops; ``branch`` s_branch/s_cbranch; ``compare``
    v_cmp/s_cmp; ``select`` v_cndmask.

    NVIDIA (``"cuda"``): ``mma`` HMMA (mma.sync), ``wgmma`` HGMMA (sm90 warpgroup MMA),
    ``tcgen05_mma`` UTC*MMA (sm100); ``global_load``/``global_store`` LDG/STG;
    ``async_copy`` LDGSTS (cp.async) and TMA; ``shared_load``/``shared_store`` LDS/LDSM and
    STS/STSM; ``exp2`` MUFU.EX2; ``fma`` FFMA/FFMA2/HFMA2; ``spill_load``/``spill_store``
    LDL/STL; ``branch`` BRA/BRX/JMP; ``compare`` ISETP/FSETP; ``select`` SEL/FSEL.

    Both: ``log2e_mul`` counts instructions with log2(e) as an immediate. There is no base-e
    exponential instruction: ``tl.exp`` becomes exp2(x * log2(e)), so exp vs exp2 in the source
    shows up as these multiplies, while ``exp2`` counts the exponentials themselves.
    ``total`` counts all instructions.
    """
    if backend not in ("hip", "cuda"):
        raise ValueError(f"backend must be 'hip' or 'cuda', got {backend!r}")
    return _mix_of(_instructions(isa, backend), backend)


def _empty_mix(backend: str) -> dict[str, int]:
    table = _AMD_MIX if backend == "hip" else _NV_MIX
    mix = dict.fromkeys([k for k, _ in table], 0)
    mix["log2e_mul"] = 0
    mix["total"] = 0
    return mix


def _kind(instr: str, backend: str) -> str | None:
    """The instruction-mix kind of one instruction, or None."""
    op = _opcode(instr, backend)
    for key, prefixes in _AMD_MIX if backend == "hip" else _NV_MIX:
        if backend == "hip":
            hit = op.startswith(prefixes)
        else:
            hit = any(op == p or op.startswith(p + ".") for p in prefixes)
        if hit:
            return key
    return None


def _mix_of(instrs: Iterable[str], backend: str) -> dict[str, int]:
    mix = _empty_mix(backend)
    for instr in instrs:
        kind = _kind(instr, backend)
        if kind is not None:
            mix[kind] += 1
        if any(c in instr for c in _LOG2E_IMM[backend]):
            mix["log2e_mul"] += 1
        mix["total"] += 1
    return mix


# ----------------------------------------------------------------------------------------------
# Source line <-> ISA, and the main loop's body
# ----------------------------------------------------------------------------------------------

_AMD_LOC = re.compile(r"^\s*\.loc\s+(\d+)\s+(\d+)")
_AMD_FILE = re.compile(r'^\s*\.file\s+(\d+)\s+"([^"]*)"\s+"([^"]*)"')
_LABEL = re.compile(r"^\s*(\.?[\w$.]+):")
_NV_LOC = re.compile(r'^\s*//## File "([^"]*)", line (\d+)')
_BRANCH_TARGET = {"hip": re.compile(r"^s_c?branch\w*\s+(\S+)"),
                  "cuda": re.compile(r"^BRA\b.*?`?\(?(\.L_x_\d+)\)?")}  # fmt: skip


@dataclass
class SourceLine:
    """The instructions one kernel source line produced (static counts)."""

    file: str  # file name ("" for instructions without a line)
    line: int  # 1-based; 0 when the compiler gave none
    source: str  # the line's text
    mix: dict[str, int]  # instruction mix of its instructions (``total`` = their number)
    in_loop: int = 0  # how many of them are in the main loop's body


@dataclass
class LoopBody:
    """The main loop: the backward branch whose body holds the most matrix instructions.
    ``mix`` is one iteration's static instruction mix; ``lines`` the source lines in it."""

    label: str
    indices: frozenset[int]  # listing indices of its instructions
    mix: dict[str, int]
    lines: tuple[tuple[str, int], ...]  # (file, line) of its instructions


@dataclass
class LineMap:
    """Source line <-> ISA of one compile: :attr:`lines` (by file and line) and the main loop."""

    backend: str
    lines: list[SourceLine]
    loop: LoopBody | None
    # (kind, text, (file, line), predicated): kind "instr" or "label"
    listing: list[tuple[str, str, tuple[str, int], bool]]

    def totals(self) -> dict[str, int]:
        """Sum of every line's mix: equals the whole kernel's instruction mix."""
        out = _empty_mix(self.backend)
        for sl in self.lines:
            for k, v in sl.mix.items():
                out[k] += v
        return out

    def isa_of(self, file: str, line: int) -> list[str]:
        """The instructions a source line produced, in listing order."""
        return [t for kind, t, loc, _ in self.listing if kind == "instr" and loc == (file, line)]


def _listing(res: CompileResult) -> list[tuple[str, str, tuple[str, int], bool]]:
    """The kernel as (kind, text, (file, line), predicated) records: kind is "instr" or
    "label"; ``predicated`` is True for a SASS instruction under a predicate."""
    backend = res.target.backend
    out: list[tuple[str, str, tuple[str, int], bool]] = []
    loc = ("", 0)
    if backend == "hip":
        files = {m.group(1): m.group(3) for m in map(_AMD_FILE.match, res.asm.get(
            "amdgcn", "").splitlines()) if m}  # fmt: skip
        for raw in res.isa.splitlines():
            m = _AMD_LOC.match(raw)
            if m:
                loc = (files.get(m.group(1), "?"), int(m.group(2)))
                if loc[1] == 0:
                    loc = ("", 0)
                continue
            s = raw.split(";", 1)[0].strip()
            lab = _LABEL.match(s)
            if lab:
                out.append(("label", lab.group(1), loc, False))
            elif s and not s.startswith("."):
                out.append(("instr", s, loc, False))
        return out
    text = _nvdisasm(res.binary)
    for raw in text.splitlines():
        m = _NV_LOC.match(raw)
        if m:
            loc = (Path(m.group(1)).name, int(m.group(2)))
            continue
        lab = _LABEL.match(raw)
        if lab and lab.group(1).startswith(".L_x_"):
            out.append(("label", lab.group(1), loc, False))
            continue
        m = _SASS_LINE.match(raw)
        if m:
            text = _SASS_PRED.sub("", m.group(1))
            out.append(("instr", text, loc, text != m.group(1)))
    return out


def _nvdisasm(cubin: bytes) -> str:
    from triton import knobs

    tool = os.path.join(os.path.dirname(knobs.nvidia.cuobjdump.path), "nvdisasm")
    fd, path = tempfile.mkstemp(suffix=".cubin")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        return subprocess.run(
            [tool, "-g", "-c", path], check=True, capture_output=True, text=True
        ).stdout
    finally:
        os.remove(path)


def _main_loop(listing, backend: str) -> LoopBody | None:
    """The natural loop (basic blocks that reach a backward branch without passing its
    target) holding the most matrix instructions, the smallest such loop on a tie."""
    pat = _BRANCH_TARGET[backend]
    # Basic blocks: [start, end] listing indices; a label starts one, a branch ends one.
    starts = {0}
    for i, (kind, text, _, _) in enumerate(listing):
        if kind == "label":
            starts.add(i)
        elif pat.match(text) or text.startswith(("s_endpgm", "EXIT")):
            starts.add(i + 1)
    bounds = sorted(x for x in starts if x < len(listing))
    blocks = [(s0, (bounds[j + 1] if j + 1 < len(bounds) else len(listing)) - 1)
              for j, s0 in enumerate(bounds)]  # fmt: skip
    block_of_label = {listing[s0][1]: j for j, (s0, _) in enumerate(blocks)
                      if listing[s0][0] == "label"}  # fmt: skip
    succ: list[list[int]] = [[] for _ in blocks]
    backedges = []
    for j, (_, e0) in enumerate(blocks):
        kind, text, _, predicated = listing[e0]
        m = pat.match(text) if kind == "instr" else None
        unconditional = m is not None and (
            text.startswith("s_branch") or (backend == "cuda" and not predicated)
        )
        ends = kind == "instr" and text.startswith(("s_endpgm", "EXIT"))
        if m:
            t = block_of_label.get(m.group(1).strip("`()"))
            if t is not None:
                succ[j].append(t)
                if t <= j:
                    backedges.append((j, t))
        if not unconditional and not ends and j + 1 < len(blocks):
            succ[j].append(j + 1)
    pred: list[list[int]] = [[] for _ in blocks]
    for j, ss in enumerate(succ):
        for t in ss:
            pred[t].append(j)
    best = None
    for tail, head in backedges:
        body, todo = {head, tail}, [tail]
        while todo:
            n = todo.pop()
            for p in pred[n]:
                if p not in body:
                    body.add(p)
                    todo.append(p)
        idx = sorted(i for j in body for i in range(blocks[j][0], blocks[j][1] + 1))
        instrs = [listing[i][1] for i in idx if listing[i][0] == "instr"]
        mix = _mix_of(instrs, backend)
        matrix = sum(mix.get(k, 0) for k in ("mfma", "mma", "wgmma", "tcgen05_mma"))
        score = (matrix, -mix["total"])
        if best is None or score > best[0]:
            lines = tuple(sorted({listing[i][2] for i in idx
                                  if listing[i][0] == "instr" and listing[i][2][1]}))  # fmt: skip
            loop = LoopBody(listing[blocks[head][0]][1], frozenset(idx), mix, lines)
            best = (score, loop)
    return best[1] if best else None


_line_maps: dict[tuple, LineMap] = {}


def by_line(res: CompileResult) -> LineMap:
    """Per kernel source line, the instructions it produced (from the AMDGCN ``.loc``
    directives, or ``nvdisasm -g`` line info on NVIDIA), and the main loop's body."""
    import linecache

    with _cache_lock:
        hit = _line_maps.get(res.key) if res.key else None
    if hit is not None:
        return hit
    backend = res.target.backend
    paths = _source_paths(res)
    listing = _listing(res)
    # A call spread over several lines is one call site: its statement's first line.
    starts = {f: _statement_starts(p) for f, p in paths.items()}
    listing = [(k, t, (f, starts.get(f, {}).get(n, n)), p) for k, t, (f, n), p in listing]
    loop = _main_loop(listing, backend)
    groups: dict[tuple[str, int], list[str]] = {}
    in_loop: Counter = Counter()
    for i, (kind, text, loc, _) in enumerate(listing):
        if kind != "instr":
            continue
        groups.setdefault(loc, []).append(text)
        if loop is not None and i in loop.indices:
            in_loop[loc] += 1
    lines = []
    for (file, line), instrs in sorted(groups.items()):
        if line:
            src = linecache.getline(paths.get(file, file), line).strip()
        else:
            src = _no_line_note(instrs, backend)
        lines.append(SourceLine(file, line, src, _mix_of(instrs, backend), in_loop[(file, line)]))
    out = LineMap(backend, lines, loop, listing)
    if res.key:
        with _cache_lock:
            _line_maps[res.key] = out
    return out


# What the compiler's own instructions (no source line) usually are, by opcode prefix.
_NO_LINE_KINDS = (
    ("s_or_b64", "exec-mask joins"),
    ("s_or_b32", "exec-mask joins"),
    ("v_accvgpr", "AGPR copies"),
    ("v_mov", "copies"),
    ("s_mov", "copies"),
)


def _no_line_note(instrs: list[str], backend: str) -> str:
    """The source column of the "(no line)" row: what those instructions are (the code the
    compiler adds with line 0: exec-mask restores where control flow joins, register copies
    between AGPRs and VGPRs, moves; LLVM also gives line 0 to an instruction merged from two
    lines), as their most common opcodes."""
    ops = Counter(_opcode(i, backend) for i in instrs)
    named = []
    for op, n in ops.most_common(4):
        what = next((w for prefix, w in _NO_LINE_KINDS if op.startswith(prefix)), "")
        named.append(f"{op} {n}" + (f" ({what})" if what else ""))
    return "compiler-made: " + ", ".join(named)


def _statement_starts(path: str) -> dict[int, int]:
    """Line -> first line of the simple statement spanning it, for the statements of ``path``
    that span several lines (a helper call's arguments on their own lines: the compiler names
    the line of an argument as the call site). Empty when the file cannot be parsed."""
    import ast

    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return {}
    out: dict[int, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt) and not hasattr(node, "body") and node.end_lineno:
            for n in range(node.lineno + 1, node.end_lineno + 1):
                out[n] = node.lineno
    return out


def _here(path: str) -> str:
    """``path`` from a compile's line info, or this package's copy of it when the recorded one
    is gone: Triton's on-disk cache is keyed by the source, not by where it was, so a cached
    binary can name the file of another checkout of the same code (since deleted)."""
    if os.path.exists(path):
        return path
    parts = Path(path).parts
    if "sparse_mla" in parts:
        rel = parts[len(parts) - 1 - parts[::-1].index("sparse_mla") + 1 :]
        local = Path(__file__).resolve().parent.joinpath(*rel)
        if local.exists():
            return str(local)
    return path


def _source_paths(res: CompileResult) -> dict[str, str]:
    """File name -> full path, for the files the compile's line info names."""
    out = {}
    for m in map(_AMD_FILE.match, res.asm.get("amdgcn", "").splitlines()):
        if m:
            out[m.group(3)] = _here(os.path.join(m.group(2), m.group(3)))
    for m in re.finditer(r'\.file\s+\d+\s+"([^"]+)"', res.asm.get("ptx", "")):
        out[Path(m.group(1)).name] = _here(m.group(1))
    return out


_BY_LINE_COLS = {
    "hip": [("matrix", ("mfma",)), ("loads", ("global_load", "buffer_load", "lds_load")),
            ("stores", ("global_store", "buffer_store", "lds_store")), ("exp2", ("exp2",)),
            ("spills", ("spill_load", "spill_store"))],
    "cuda": [("matrix", ("mma", "wgmma", "tcgen05_mma")),
             ("loads", ("global_load", "async_copy", "shared_load")),
             ("stores", ("global_store", "shared_store")), ("exp2", ("exp2",)),
             ("spills", ("spill_load", "spill_store"))],
}  # fmt: skip


def by_line_rows(lm: LineMap) -> tuple[list[str], list[list[Any]]]:
    """(header, rows) of the by-line table: line, instructions, matrix, loads, stores, exp2,
    spills, in main loop, source."""
    cols = _BY_LINE_COLS[lm.backend]
    header = ["line", "instrs", *[c for c, _ in cols], "in loop", "source"]
    rows = []
    for sl in lm.lines:
        where = f"{sl.file}:{sl.line}" if sl.line else "(no line)"
        counts = [sum(sl.mix.get(k, 0) for k in kinds) for _, kinds in cols]
        rows.append([where, sl.mix["total"], *counts, sl.in_loop, sl.source[:70]])
    return header, rows


def by_line_table(res: CompileResult, top: int = 0) -> str:
    """Text table of :func:`by_line` (``top``: the lines with most instructions, in line
    order), then the main loop body's mix beside the whole kernel's."""
    lm = by_line(res)
    header, rows = by_line_rows(lm)
    if top:
        keep = sorted(range(len(rows)), key=lambda i: -rows[i][1])[:top]
        rows = [rows[i] for i in sorted(keep)]
    parts = [f"instructions by kernel source line ({len(lm.lines)} lines)", _table(header, rows)]
    parts.append(loop_table(res))
    return "\n".join(parts[:2]) + "\n\n" + parts[2]


def loop_table(res: CompileResult) -> str:
    """The main loop body's instruction mix (one iteration) beside the whole kernel's."""
    lm = by_line(res)
    if lm.loop is None:
        return "main loop: none found (no backward branch)"
    lp = lm.loop
    by_file: dict[str, list[int]] = {}
    for f, n in lp.lines:
        by_file.setdefault(f, []).append(n)
    span = ", ".join(f"{f} lines {min(ns)}-{max(ns)}" for f, ns in by_file.items()) or "no lines"
    rows = [[k, res.mix.get(k, 0), lp.mix.get(k, 0)] for k in res.mix if res.mix.get(k, 0)]
    return f"main loop body (label {lp.label}, {span}): static counts of one iteration\n" + _table(
        ["instructions", "whole kernel", "loop body"], rows
    )


def diff_by_line(a: CompileResult, b: CompileResult) -> list[list[Any]]:
    """Source lines whose instruction count changed from a to b: [line, a, b, change, source],
    largest change first; a readable summary of a long ISA diff."""
    la = {(s.file, s.line): s for s in by_line(a).lines}
    lb = {(s.file, s.line): s for s in by_line(b).lines}
    rows = []
    for key in sorted(set(la) | set(lb)):
        na = la[key].mix["total"] if key in la else 0
        nb = lb[key].mix["total"] if key in lb else 0
        if na != nb:
            src = (lb.get(key) or la.get(key)).source
            where = f"{key[0]}:{key[1]}" if key[1] else "(no line)"
            rows.append([where, na, nb, f"{nb - na:+d}", src[:70]])
    rows.sort(key=lambda r: -abs(int(r[3])))
    return rows


# ----------------------------------------------------------------------------------------------
# Compile
# ----------------------------------------------------------------------------------------------


@dataclass
class CompileResult:
    """One kernel compiled for one target. ``asm`` holds every stage Triton produced (ttir,
    ttgir, llir, ptx or amdgcn; binary cubin/hsaco are kept in ``binary``)."""

    kernel_name: str
    target: Target
    constexprs: dict[str, Any]
    options: dict[str, Any]
    signature: dict[str, str]
    asm: dict[str, str]
    isa: str
    resources: Resources
    mix: dict[str, int]
    compile_seconds: float
    binary: bytes = b""
    key: tuple = ()
    # True when this answer came from the in-memory cache: compile_seconds is then the time the
    # first compile took, not time spent on this call.
    from_cache: bool = False

    @property
    def label(self) -> str:
        return _label(self.kernel_name, self.target, self.constexprs, self.options)

    def __repr__(self) -> str:
        r = self.resources
        return (
            f"CompileResult({self.label}; occupancy {r.occupancy} {self.target.occupancy_unit}, "
            f"spill {r.spill_bytes} B, {self.compile_seconds:.2f} s)"
        )


def _label(name: str, target: Target, constexprs: Mapping[str, Any], options: Mapping[str, Any]):
    bits = [f"{k}={v}" for k, v in constexprs.items()]
    bits += [f"{k}={v}" for k, v in options.items()]
    return f"{name} @ {target.name}: " + " ".join(bits)


_cache: dict[tuple, CompileResult] = {}
_cache_lock = threading.Lock()

# An LLVM IR debug location: (id, line, column, scope, inlinedAt id or None).
_DILOC = re.compile(
    r"^(!\d+) = !DILocation\(line: (\d+), column: (\d+), scope: (!\d+)(?:, inlinedAt: (!\d+))?\)",
    re.M,
)  # fmt: skip


def call_site_locations(llir: str) -> str:
    """``llir`` with every inlined debug location replaced by the outermost call site of its
    inlining chain (Triton inlines every ``@jit`` helper, so a helper's ``return tl.dot(...)``
    otherwise names the helper's line for every call). Debug info only: the code is the same;
    a location that is not inlined is kept."""
    locs = {m.group(1): m.groups()[1:] for m in _DILOC.finditer(llir)}

    def outermost(node: str):
        for _ in range(256):  # a chain is a few calls deep; a cycle would be malformed IR
            nxt = locs[node][3]
            if nxt is None or nxt not in locs:
                break
            node = nxt
        return locs[node]

    def sub(m: re.Match) -> str:
        if m.group(5) is None:
            return m.group(0)
        line, col, scope, _ = outermost(m.group(1))
        return f"{m.group(1)} = !DILocation(line: {line}, column: {col}, scope: {scope})"

    return _DILOC.sub(sub, llir)


# The Triton cache folder (under Triton's own) of the compiles made with call-site line info:
# the stage hook below is not part of Triton's cache key, so these binaries live apart.
CALL_SITE_CACHE = "sparse_mla_call_sites"


@contextlib.contextmanager
def call_site_line_info():
    """While active, ``triton.compile`` attributes inlined helpers to their call sites
    (:func:`call_site_locations` on the LLVM IR stage, through Triton's stage hook) and caches
    in :data:`CALL_SITE_CACHE` under Triton's cache folder. Used by :func:`compile` (and its
    worker process), so :func:`by_line` counts a helper's instructions on the kernel line that
    called it."""
    from triton import knobs

    prev_hook = knobs.runtime.add_stages_inspection_hook
    prev_dir = knobs.cache.dir

    def hook(*args):
        if prev_hook is not None:
            prev_hook(*args)
        stages = next((a for a in args if isinstance(a, dict) and "llir" in a), None)
        if stages is None:
            return
        make_llir = stages["llir"]

        def llir(src, metadata):
            return call_site_locations(make_llir(src, metadata))

        stages["llir"] = llir

    knobs.runtime.add_stages_inspection_hook = hook
    if Path(prev_dir).name != CALL_SITE_CACHE:
        knobs.cache.dir = os.path.join(prev_dir, CALL_SITE_CACHE)
    try:
        yield
    finally:
        knobs.runtime.add_stages_inspection_hook = prev_hook
        knobs.cache.dir = prev_dir


def clear_cache() -> None:
    """Forget every in-memory compile result."""
    with _cache_lock:
        _cache.clear()


def _unwrap(kernel):
    from triton.runtime.jit import JITFunction

    k = kernel
    while not isinstance(k, JITFunction) and hasattr(k, "fn"):
        k = k.fn  # Autotuner / Heuristics wrappers
    if not isinstance(k, JITFunction):
        raise TypeError(
            f"kernel must be a @triton.jit or Gluon kernel, got {type(kernel).__name__}"
        )
    return k


def _is_gluon(kernel) -> bool:
    return bool(getattr(kernel, "is_gluon", lambda: False)())


def _signature(
    kernel, constexprs: dict[str, Any], signature: Mapping[str, str] | None
) -> tuple[dict[str, str], dict[str, Any]]:
    names = [p.name for p in kernel.params]
    given = dict(signature or {})
    unknown = sorted((set(given) | set(constexprs)) - set(names))
    if unknown:
        raise ValueError(f"signature/constexprs: {unknown} are not parameters of {kernel.__name__}")
    sig: dict[str, str] = {}
    consts = dict(constexprs)
    for p in kernel.params:
        if p.is_constexpr and p.name not in consts:
            if not p.has_default:
                raise ValueError(f"constexprs: give a value for constexpr parameter {p.name!r}")
            consts[p.name] = p.default
    for p in kernel.params:
        if p.name in consts:
            sig[p.name] = "constexpr"
        elif p.name in given:
            sig[p.name] = given[p.name]
        elif p.annotation_type:
            sig[p.name] = p.annotation_type
        elif p.name.endswith("ptr"):
            raise ValueError(
                f"signature: give the dtype of pointer parameter {p.name!r}, "
                f"e.g. signature={{{p.name!r}: '*bf16'}}"
            )
        else:
            sig[p.name] = "i32"
    return sig, consts


def _attrs(sig: dict[str, str], names: list[str], divisible: Iterable[str]) -> dict:
    # A launch on torch tensors sees 16-byte aligned pointers; ints are "D" when divisible by 16.
    div = set(divisible)
    return {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(names)
        if sig[n].startswith("*") or (n in div and sig[n] != "constexpr")
    }


def _hashable(d: Mapping[str, Any]) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in d.items()))


def _cuobjdump(cubin: bytes, *flags: str) -> str:
    from triton import knobs

    tool = knobs.nvidia.cuobjdump.path
    fd, path = tempfile.mkstemp(suffix=".cubin")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        return subprocess.run(
            [tool, *flags, path], check=True, capture_output=True, text=True
        ).stdout
    finally:
        os.remove(path)


def _clean_sass(sass: str) -> str:
    """cuobjdump SASS without the encoding-only lines and trailing encodings."""
    lines = []
    for line in sass.splitlines():
        s = line.rstrip()
        if re.match(r"^\s*/\* 0x[0-9a-f]+ \*/$", s):
            continue
        lines.append(re.sub(r"\s*/\* 0x[0-9a-f]+ \*/$", "", s))
    return "\n".join(lines).strip("\n") + "\n"


def compile(
    kernel,
    target: str | Target,
    constexprs: Mapping[str, Any] | None = None,
    options: Mapping[str, Any] | None = None,
    signature: Mapping[str, str] | None = None,
    *,
    divisible: Iterable[str] = (),
) -> CompileResult:
    """Cross-compile ``kernel`` for ``target`` (no GPU needed) and read the result.

    Args:
        kernel: a ``@triton.jit`` or ``@gluon.jit`` kernel (a Gluon kernel's layouts must use the
            target's warp size: 64 on AMD, 32 on NVIDIA).
        target: a name from :data:`sparse_mla.targets.TARGETS` or a Target.
        constexprs: {param name: value} for constexpr parameters (a plain parameter named here
            is specialised as a constant too).
        options: compiler options (num_warps, num_stages, kpack, ...), checked by
            :func:`sparse_mla.targets.validate_options`.
        signature: {param name: Triton type} such as ``"*bf16"``, ``"i32"``, ``"fp32"``; needed
            for every pointer parameter, optional for the rest (annotation, else ``"i32"``).
        divisible: names of integer parameters a launch would see divisible by 16 (Triton
            specialises on that); pointers are always taken as 16-byte aligned.

    Returns:
        A :class:`CompileResult`, cached in memory by (kernel source, target, constexprs,
        options, signature, divisibility).
    """
    import triton

    t = get_target(target)
    jit = _unwrap(kernel)
    opts = validate_options(t, options)
    sig, consts = _signature(jit, dict(constexprs or {}), signature)
    names = [p.name for p in jit.params]
    attrs = _attrs(sig, names, divisible)
    key = (
        jit.cache_key,
        t.name,
        t.arch,
        _hashable(consts),
        _hashable(opts),
        _hashable(sig),
        tuple(sorted(attrs)),
    )
    with _cache_lock:
        hit = _cache.get(key)
    if hit is not None:
        return replace(hit, from_cache=True)

    if _is_gluon(jit):
        from triton.experimental.gluon._runtime import GluonASTSource as Source
    else:
        from triton.compiler.compiler import ASTSource as Source
    src = Source(jit, sig, consts, attrs)
    start = time.perf_counter()
    from . import runtime

    failure: BaseException | None = None
    ck, failure, printed = _compile_in_worker(jit, sig, consts, attrs, triton_target(t), opts)
    if ck is None and failure is None:  # the kernel is not importable by name: compile here
        with compiler_output() as out:
            try:
                with runtime.compiling(), call_site_line_info():  # not while interpreting
                    ck = triton.compile(src, target=triton_target(t), options=opts)
            except Exception as e:
                failure = e
        printed = out.text
    if failure is not None:
        setting = _label(jit.__name__, t, consts, opts)
        warp_size = t.warp_size if _is_gluon(jit) else None
        raise _compile_failed(failure, printed, setting, key, warp_size) from failure
    name = ck.metadata.name
    if t.is_amd:
        binary = ck.asm.get("hsaco", b"")
        isa = _amd_code(ck.asm["amdgcn"], name)
    else:
        binary = ck.asm["cubin"]
        isa = _clean_sass(_cuobjdump(binary, "--dump-sass"))
    res = resources_of(ck, t)
    seconds = time.perf_counter() - start
    result = CompileResult(
        kernel_name=name,
        target=t,
        constexprs=consts,
        options=opts,
        signature=sig,
        asm={k: v for k, v in ck.asm.items() if isinstance(v, str)},
        isa=isa,
        resources=res,
        mix=instruction_mix(isa, t.backend),
        compile_seconds=seconds,
        binary=binary,
        key=key,
    )
    with _cache_lock:
        _cache[key] = result
    return result


def failure_reason(e: BaseException, limit: int = 300) -> str:
    """One line saying why a compile failed: a :class:`CompileFailed`'s own summary (the pass
    or assembler that failed, its first error and the setting), the assembler's complaint when
    there is one (Triton ends a failed ``ptxas`` run's message with the repro command), else the
    last line of the message, after the exception's type."""
    if isinstance(e, CompileFailed):
        return e.summary[:limit]
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    said = [ln for ln in lines if ln.startswith("ptxas") and ("fatal" in ln or "error" in ln)]
    text = said[0] if said else (lines[-1] if lines else "")
    return f"{type(e).__name__}: {text}"[:limit]


# ----------------------------------------------------------------------------------------------
# The compiler's own output, captured per call
# ----------------------------------------------------------------------------------------------
#
# Triton prints in two ways: Python ``print`` (the whole PTX when ptxas fails) and C++ writes
# straight to file descriptor 2 (MLIR's diagnostics, the failing module and ``LLVM ERROR`` when
# a pass fails). A file descriptor belongs to the whole process, so redirecting it would take
# every other thread's output too (a thread printing in a terminal or an engine's logger).
# Nothing here touches the process's file descriptors:
# - compile() runs triton.compile in a child process (sparse_mla/_compile_worker.py, started
#   once, reused): the child's fds 1 and 2 point at a log file while it compiles, so all of the
#   compiler's output, C++ included, is captured there and reaches nobody's terminal.
# - compiler_output() takes the *calling thread's* Python-level writes (sys.stdout and
#   sys.stderr) through a forwarding stream; every other thread's writes go where they always
#   went. It is what compile() uses for a kernel the child cannot import by name (one defined
#   in a notebook cell or a function), and what tune uses around a GPU launch that compiles:
#   there the C++ diagnostics of a failing compile go to the process's stderr, as with any
#   Triton launch.

_tls = threading.local()
_route_lock = threading.Lock()
_route_users = 0


class _ThreadRoutedStream:
    """Forwards writes to the stream it wraps, except a capturing thread's, which go to that
    thread's log."""

    def __init__(self, inner, which: str):
        self._inner = inner
        self._which = which

    def write(self, text):
        buf = getattr(_tls, self._which, None)
        if buf is not None:
            return buf.write(text)
        return self._inner.write(text)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def flush(self):
        if getattr(_tls, self._which, None) is None:
            self._inner.flush()

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _route_python_streams(on: bool) -> None:
    global _route_users
    with _route_lock:
        if on:
            _route_users += 1
            for which in ("stdout", "stderr"):
                cur = getattr(sys, which)
                if cur is not None and not isinstance(cur, _ThreadRoutedStream):
                    setattr(sys, which, _ThreadRoutedStream(cur, which))
            return
        _route_users -= 1
        if _route_users == 0:
            for which in ("stdout", "stderr"):
                cur = getattr(sys, which)
                if isinstance(cur, _ThreadRoutedStream):
                    setattr(sys, which, cur._inner)


@dataclass
class CompilerOutput:
    """What the compiler printed inside one :func:`compiler_output` block (``text`` is filled in
    when the block ends)."""

    text: str = ""


@contextlib.contextmanager
def compiler_output():
    """Capture what this thread prints through ``sys.stdout``/``sys.stderr`` during the block
    (see above): yields a :class:`CompilerOutput` whose ``text`` holds it after the block.
    Other threads' output and the process's file descriptors are untouched."""
    out = CompilerOutput()
    py = io.StringIO()
    outer = (getattr(_tls, "stdout", None), getattr(_tls, "stderr", None))
    _tls.stdout = _tls.stderr = py
    _route_python_streams(True)
    try:
        yield out
    finally:
        _tls.stdout, _tls.stderr = outer
        _route_python_streams(False)
        out.text = py.getvalue()


@contextlib.contextmanager
def compiler_quiet():
    """Keep what the compiler prints through Python during the block out of the caller's
    output (it is dropped; :func:`compile` keeps the compiler's whole output in
    :attr:`CompileFailed.output` instead). Per call: other threads' output is untouched (see
    :func:`compiler_output`)."""
    with compiler_output():
        yield


class _WorkerFailure(RuntimeError):
    """A compile that failed in the worker process: the exception's type name, message,
    traceback text and Triton stage as the child saw them."""

    def __init__(self, reply: dict):
        super().__init__(reply["message"])
        self.type_name = reply["type"]
        self.traceback_text = reply["traceback"]
        self.stage = reply["stage"]


@dataclass
class _Compiled:
    """The parts of a ``CompiledKernel`` this module reads (``asm``, ``metadata``), rebuilt from
    the worker's answer."""

    asm: dict
    metadata: Any


class _Worker:
    """One child process (sparse_mla/_compile_worker.py) that compiles requests one at a time."""

    def __init__(self):
        path = [p for p in sys.path if p]
        boot = f"import sys; sys.path[:0] = {path!r}; from sparse_mla import _compile_worker as w"
        boot += "; w.main()"
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", boot],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        import pickle

        if pickle.load(self.proc.stdout) != {"status": "ready"}:
            raise RuntimeError("compile worker did not start")

    def call(self, req: dict) -> dict:
        import pickle

        pickle.dump(req, self.proc.stdin)
        self.proc.stdin.flush()
        return pickle.load(self.proc.stdout)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except Exception:
            self.proc.kill()


_worker: _Worker | None = None
_worker_lock = threading.Lock()
_worker_broken = False


def _close_worker() -> None:
    global _worker
    with _worker_lock:
        if _worker is not None:
            _worker.close()
            _worker = None


def _forget_worker_in_child() -> None:
    # A forked process (tune's compile pool) starts its own worker when it needs one: the
    # parent's pipes are the parent's, and the lock may have been held at the fork.
    global _worker, _worker_lock
    _worker, _worker_lock = None, threading.Lock()


atexit.register(_close_worker)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_worker_in_child)


def _compile_in_worker(jit, sig, consts, attrs, target, opts):
    """(compiled, failure, output) of ``triton.compile`` run in the worker process; (None, None,
    "") when the worker cannot compile this kernel (not importable by name, its source differs
    from this process's, or no worker), so the caller compiles in-process."""
    global _worker, _worker_broken
    fn = getattr(jit, "fn", None)
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<locals>" in qualname or _worker_broken:
        return None, None, ""
    req = {
        "module": module,
        "qualname": qualname,
        "cache_key": jit.cache_key,
        "signature": sig,
        "constexprs": consts,
        "attrs": attrs,
        "target": target,
        "options": dict(opts),
        "path": list(sys.path),
    }
    with _worker_lock, tempfile.NamedTemporaryFile(mode="rb", suffix=".log") as log:
        req["log"] = log.name
        try:
            if _worker is not None and _worker.proc.poll() is not None:
                _worker = None  # it exited since the last compile (killed): start another
            if _worker is None:
                _worker = _Worker()
            reply = _worker.call(req)
        except Exception as e:  # the child died (a compiler crash) or could not start
            if _worker is None:
                _worker_broken = True  # no worker on this machine: compile in-process from now
                return None, None, ""
            _worker.proc.kill()
            _worker = None
            output = log.read().decode(errors="replace")
            crash = _WorkerFailure({
                "type": "CompilerCrashed", "message": f"the compiler process died ({e!r})",
                "traceback": "", "stage": None,
            })  # fmt: skip
            return None, crash, output
        output = log.read().decode(errors="replace")
    if reply["status"] == "stale":
        return None, None, ""
    if reply["status"] == "error":
        return None, _WorkerFailure(reply), output
    return _Compiled(reply["asm"], SimpleNamespace(**reply["metadata"])), None, output


class CompileFailed(RuntimeError):
    """A compile that failed, said in one line (:attr:`summary`): which pass or tool failed
    (``pass_name``, at Triton stage ``stage``), its first error (``message``, at ``location`` in
    the kernel source) and the setting (``setting``). The compiler's whole output (MLIR's
    reproducer, ptxas's log) is kept in :attr:`log_path`, a file the user can open, and in
    :attr:`output`."""

    def __init__(
        self,
        *,
        setting: str,
        pass_name: str | None,
        stage: str | None,
        message: str,
        location: str | None,
        output: str,
        log_path: Path | None,
        hint: str = "",
    ):
        self.setting, self.pass_name, self.stage = setting, pass_name, stage
        self.message, self.location, self.output, self.log_path = (
            message,
            location,
            output,
            log_path,
        )
        where = pass_name or "compile"
        if stage:
            where += f" (stage {stage})"
        at = f" at {location}" if location else ""
        self.summary = f"{where} failed: {message}{at}; setting {setting}"
        if hint:
            self.summary += f" ({hint})"
        keep = f" [compiler output and reproducer: {log_path}]" if log_path else ""
        super().__init__(self.summary + keep)


_MLIR_PASS = re.compile(r"Pipeline failed while executing \[`([^`]+)`")
_MLIR_ERROR = re.compile(r"^(\S+?):(\d+):\d+: error: (.*)$", re.MULTILINE)


def _classify_failure(
    e: BaseException, output: str
) -> tuple[str | None, str | None, str, str | None]:
    """(pass name, Triton stage, first error message, source location) of a failed compile."""
    stage = getattr(e, "stage", None)  # a _WorkerFailure says the stage the child saw
    for frame in traceback.extract_tb(e.__traceback__):
        if frame.name.startswith("make_") and "triton" in frame.filename:
            stage = frame.name.removeprefix("make_")
    text = f"{output}\n{e}"
    pass_name = location = None
    m = _MLIR_PASS.search(text)
    if m:
        pass_name = m.group(1)
    said = [
        ln.strip()
        for ln in str(e).splitlines()
        if ln.strip().startswith("ptxas") and ("fatal" in ln or "error" in ln)
    ]
    err = _MLIR_ERROR.search(output)
    if said:
        pass_name, message = "ptxas", said[0]
    elif err:
        location = f"{Path(err.group(1)).name}:{err.group(2)}"
        message = err.group(3).strip()
    else:
        llvm = re.search(r"^LLVM ERROR: (.*)$", output, re.MULTILINE)
        crash = re.search(r"^(.+)\n.*UNREACHABLE executed", output, re.MULTILINE)
        lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
        kind = getattr(e, "type_name", type(e).__name__)
        last = lines[-1] if lines else ""
        if llvm:
            message = llvm.group(1)
        elif crash:  # LLVM's assertion text comes just before its "UNREACHABLE" line
            message = f"{kind}: {last} ({crash.group(1).strip()})"
        elif set(last) <= {"^", " "}:  # a CompilationError's caret with no message
            message = _innermost_error(e) or f"{kind}: {last}"
        else:
            message = f"{kind}: {last}"
    return pass_name, stage, message, location


_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception)): (.+)$", re.MULTILINE)


def _innermost_error(e: BaseException) -> str | None:
    """``Type: message`` of the first exception in ``e``'s chain (the innermost cause, printed
    first) that says something: Triton wraps an error raised inside a called ``@jit`` helper in
    a CompilationError per call level, and the outer ones end at their caret line."""
    text = getattr(e, "traceback_text", None) or "".join(
        traceback.format_exception(type(e), e, e.__traceback__)
    )
    for m in _EXCEPTION_LINE.finditer(text):
        said = m.group(2).strip()
        if not re.fullmatch(r"at \d+:\d+:?", said):
            return f"{m.group(1).rsplit('.', 1)[-1]}: {said}"
    return None


def failure_dir() -> Path:
    """Where failed compiles leave their compiler output: ``$TMPDIR/sparse-mla-compile-failures``
    (``SPARSE_MLA_FAILURE_DIR`` overrides it)."""
    given = os.environ.get("SPARSE_MLA_FAILURE_DIR")
    return Path(given) if given else Path(tempfile.gettempdir()) / "sparse-mla-compile-failures"


def _compile_failed(
    e: BaseException, output: str, setting: str, key: tuple, gluon_warp_size: int | None = None
) -> CompileFailed:
    """The CompileFailed of ``e``, its compiler output kept in a log file. ``gluon_warp_size``
    (a Gluon kernel's compile): a layout error's summary says the target's warp size, the
    usual cause when a kernel written for one vendor is compiled for the other (Triton 3.6
    says "error encountered during parsing" for a layout of the wrong warp size)."""
    pass_name, stage, message, location = _classify_failure(e, output)
    hint = ""
    if gluon_warp_size and re.search(r"warp|lane|layout|parsing", message, re.IGNORECASE):
        hint = f"a Gluon kernel's layouts must use the target's warp size, {gluon_warp_size} "
        hint += "threads per warp"
    log_path: Path | None = None
    try:
        folder = failure_dir()
        folder.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256(repr(key).encode()).hexdigest()[:12]
        log_path = folder / f"{digest}.log"
        tb = getattr(e, "traceback_text", None) or "".join(
            traceback.format_exception(type(e), e, e.__traceback__)
        )
        log_path.write_text(
            f"setting: {setting}\npass: {pass_name}\nstage: {stage}\nerror: {message}\n"
            f"location: {location}\n\n---- exception ----\n{tb}\n"
            f"---- compiler output (MLIR reproducer, ptxas log, ...) ----\n{output}"
        )
    except OSError:
        log_path = None
    return CompileFailed(
        setting=setting, pass_name=pass_name, stage=stage, message=message,
        location=location, output=output, log_path=log_path, hint=hint,
    )  # fmt: skip


def resources_of(ck, target: str | Target = "local") -> Resources:
    """Registers, shared memory, spills and occupancy of a kernel Triton has compiled: a
    ``CompiledKernel`` as ``triton.compile`` or ``JITFunction.warmup`` return it (the time
    sweep reads its rows' resources this way from the kernel it launches)."""
    t = target if isinstance(target, Target) else get_target(target)
    num_warps = ck.metadata.num_warps
    if t.is_amd:
        return _amd_resources(ck.asm["amdgcn"], str(t.arch), num_warps, ck.metadata.shared)
    usage = _cuobjdump(ck.asm["cubin"], "--dump-resource-usage")
    res = _nvidia_resources(usage, int(t.arch), num_warps, ck.metadata.shared)
    res.partitions = warp_partitions(ck.asm.get("ttgir", ""), ck.asm.get("ptx", ""))
    return res


_DTYPES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16"}
_INDEX_DTYPES = {"int32": "i32", "i32": "i32", "int64": "i64", "i64": "i64"}


# The slot lists' forms a compile can take (``dense`` of :func:`compile_kernel`), by name.
IDS_FORMS = {"csr": 0, "dense": 1, "lengths": 2}


def _ids_form(dense) -> int:
    """``dense`` (a bool, 0 / 1 / 2 or a name of :data:`IDS_FORMS`) as 0 / 1 / 2."""
    if isinstance(dense, str):
        if dense not in IDS_FORMS:
            raise ValueError(f"dense: one of {sorted(IDS_FORMS)}, got {dense!r}")
        return IDS_FORMS[dense]
    if dense in (False, True, 0, 1, 2):
        return int(dense)
    raise ValueError(
        f"dense must be False/True, 0/1/2 or one of {sorted(IDS_FORMS)}, got {dense!r}"
    )


def compile_prefill(
    target: str | Target,
    config=None,
    *,
    num_heads: int = 16,
    head_dim: int = 512,
    dtype: str = "bf16",
    has_sink: bool = True,
    index_dtype: str = "int32",
    options: Mapping[str, Any] | None = None,
    dense: bool | int = False,
) -> CompileResult:
    """Compile the Triton prefill kernel as a launch with these shapes would, for ``target``.

    Args:
        target: a name from :data:`sparse_mla.targets.TARGETS` or a Target.
        config: a PrefillConfig, a dict of its fields or None (tuned entry for the target's arch,
            else the default); ``EVEN_HD=None`` means on whenever valid.
        num_heads, head_dim: H and D of q [T, H, D]; the pool kv is [N, D].
        dtype: "bf16" or "fp16" for q, kv and out.
        has_sink: compile the attn_sink path.
        index_dtype: "int32" or "int64" for kv_indices and kv_indptr.
        options: extra compiler options over the config's (e.g. ``matrix_instr_nonkdim``).
        dense: the slot lists' form (:data:`IDS_FORMS`): 0 / False CSR, 1 / True dense
            [T, K] ids, 2 dense ids with the rows' lengths (``DENSE_IDS``).
    """
    import torch

    from . import prefill

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if index_dtype not in _INDEX_DTYPES:
        raise ValueError(f"index_dtype must be one of {sorted(_INDEX_DTYPES)}, got {index_dtype!r}")
    for name, v in (("num_heads", num_heads), ("head_dim", head_dim)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    t = get_target(target)
    cfg = prefill.resolve_config(num_heads, head_dim, config, t.name)
    torch_dtype = torch.bfloat16 if _DTYPES[dtype] == "bf16" else torch.float16
    consts = prefill.launch_constexprs(num_heads, head_dim, torch_dtype, cfg, has_sink=has_sink)
    if _ids_form(dense):  # only when set, as the launcher passes it
        from .validation import dense_ids_value

        consts["DENSE_IDS"] = dense_ids_value(_ids_form(dense))
    if cfg.EVEN_HD and not prefill._even_hd_ok(cfg, num_heads, head_dim, consts["BLOCK_D"]):
        raise ValueError(
            f"config: EVEN_HD needs head_dim == BLOCK_D and H % BLOCK_H == 0; got "
            f"head_dim={head_dim}, BLOCK_D={consts['BLOCK_D']}, H={num_heads}, "
            f"BLOCK_H={cfg.BLOCK_H}"
        )
    # A config's vendor-specific knobs are accepted everywhere and used on their vendor only.
    opts: dict[str, Any] = cfg.compile_options("hip" if t.is_amd else "cuda")
    opts.update(options or {})
    el, ix = "*" + _DTYPES[dtype], "*" + _INDEX_DTYPES[index_dtype]
    sig = {
        "q_ptr": el,
        "kv_ptr": el,
        "idx_ptr": ix,
        "indptr_ptr": ix,
        "sink_ptr": "*fp32",
        "out_ptr": el,
        "qk_scale": "fp32",
    }
    hd = num_heads * head_dim
    ints = {
        "stride_qt": hd,
        "stride_qh": head_dim,
        "stride_kvn": head_dim,
        "stride_ot": hd,
        "stride_oh": head_dim,
        "num_heads": num_heads,
        "head_dim": head_dim,
    }
    sig.update({n: "i64" if v >= 2**31 else "i32" for n, v in ints.items()})
    sig["num_kv"] = "i32"
    sig["nnz"] = "i32"
    divisible = [n for n, v in ints.items() if v % 16 == 0]
    return compile(prefill._sparse_mla_prefill_kernel, t, consts, opts, sig, divisible=divisible)


# ----------------------------------------------------------------------------------------------
# Diff
# ----------------------------------------------------------------------------------------------

_NORMALISE_AMD = [
    (re.compile(r"\b0x[0-9a-fA-F]+\b"), "0x#"),
    (re.compile(r"\b([vsa])\[\d+:\d+\]"), r"\1[#]"),
    (re.compile(r"\b([vsa])\d+\b"), r"\1#"),
    (re.compile(r"\.LBB\d+_\d+"), ".LBB#"),
]
_NORMALISE_NV = [
    (re.compile(r"\b0x[0-9a-fA-F]+\b"), "0x#"),
    (re.compile(r"\b(U?R|U?P|B)\d+\b"), r"\1#"),
    (re.compile(r"\.L_x_\d+"), ".L_x_#"),
]


def _normalised(isa: str, backend: str) -> list[str]:
    rules = _NORMALISE_AMD if backend == "hip" else _NORMALISE_NV
    out = []
    for line in isa.splitlines():
        if backend == "cuda":
            m = _SASS_LINE.match(line)
            if not m:
                continue
            s = m.group(1)
        else:
            s = line.split(";", 1)[0].strip()
            if not s or s.startswith("."):
                continue
        s = " ".join(s.split())
        for pat, rep in rules:
            s = pat.sub(rep, s)
        out.append(s)
    return out


def _table(header: list[str], rows: list[list[Any]]) -> str:
    cells = [header, *[["-" if c is None else str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


@dataclass
class Diff:
    """Two variants compared: ``a`` is the baseline, ``b`` the variant.

    ``removed()``/``added()`` are opcodes whose count fell/rose from a to b (with the change);
    ``removed_mix()``/``added_mix()`` the same for instruction-mix kinds.
    """

    a: CompileResult
    b: CompileResult
    resource_table: str
    isa_diff: str
    opcode_delta: dict[str, int]
    mix_delta: dict[str, int]

    def removed(self) -> dict[str, int]:
        return {k: -v for k, v in self.opcode_delta.items() if v < 0}

    def added(self) -> dict[str, int]:
        return {k: v for k, v in self.opcode_delta.items() if v > 0}

    def removed_mix(self) -> dict[str, int]:
        return {k: -v for k, v in self.mix_delta.items() if v < 0}

    def added_mix(self) -> dict[str, int]:
        return {k: v for k, v in self.mix_delta.items() if v > 0}

    @property
    def empty(self) -> bool:
        return not self.isa_diff

    def summary(self, top: int = 12) -> str:
        """Resource table, instruction-mix changes and the largest opcode changes."""
        mix_rows = [[k, self.a.mix[k], self.b.mix[k], f"{v:+d}"] for k, v in self.mix_delta.items()]
        ops = sorted(self.opcode_delta.items(), key=lambda kv: (-abs(kv[1]), kv[0]))[:top]
        parts = [self.resource_table]
        if mix_rows:
            parts.append(_table(["instructions", "a", "b", "change"], mix_rows))
        if ops:
            parts.append(_table(["opcode", "change"], [[k, f"{v:+d}"] for k, v in ops]))
        return "\n\n".join(parts)

    def __str__(self) -> str:
        return self.summary() + "\n\n" + (self.isa_diff or "(ISA identical after normalising)")


def diff(a: CompileResult, b: CompileResult, *, context: int = 3) -> Diff:
    """Compare two compiled variants (same backend): resources side by side, instruction mix
    and opcode count changes, and a unified diff of the normalised ISA (addresses, register
    numbers, hex constants and labels replaced by ``#``)."""
    if a.target.backend != b.target.backend:
        raise ValueError(
            f"diff: both results must be for the same backend, got {a.target.name} and "
            f"{b.target.name}"
        )
    ra, rb = dict(a.resources.as_rows()), dict(b.resources.as_rows())
    rows = []
    for k in ra:
        va, vb = ra[k], rb.get(k)
        change = f"{vb - va:+d}" if isinstance(va, int) and isinstance(vb, int) else ""
        rows.append([k, va, vb, change])
    table = _table(["resource", "a", "b", "change"], rows)
    ca, cb = opcode_counts(a.isa, a.target.backend), opcode_counts(b.isa, b.target.backend)
    opcode_delta = {k: cb[k] - ca[k] for k in sorted(set(ca) | set(cb)) if cb[k] != ca[k]}
    mix_delta = {k: b.mix[k] - a.mix[k] for k in a.mix if b.mix.get(k, 0) != a.mix[k]}
    na, nb = _normalised(a.isa, a.target.backend), _normalised(b.isa, b.target.backend)
    lines = difflib.unified_diff(na, nb, "a: " + a.label, "b: " + b.label, n=context, lineterm="")
    return Diff(
        a=a,
        b=b,
        resource_table=table,
        isa_diff="\n".join(lines),
        opcode_delta=opcode_delta,
        mix_delta=mix_delta,
    )


def compile_gluon(
    mode: str, target: str | Target, kernel: str | None = None, **shape
) -> CompileResult:
    """Cross-compile one mode ("decode" or "prefill") of a Gluon kernel (``kernel``: its
    registry name, default ``gluon_mma``, the shared algorithm) for ``target`` ("gfx950" or
    "sm90"); ``shape`` as for :func:`sparse_mla.gluon.compile_args`."""
    from .gluon import compile_args

    name = target.name if isinstance(target, Target) else target
    kernel, signature, constexprs, options = compile_args(mode, name, kernel, **shape)
    # The pool row strides are multiples of 16 elements in an engine's cache, and the gfx950
    # buffer loads into LDS need that to compile.
    return compile(
        kernel, target, constexprs, options, signature, divisible=("stride_kvn", "stride_kpen")
    )


def compile_kernel(
    name: str,
    target: str | Target,
    *,
    num_heads: int = 16,
    head_dim: int = 512,
    num_tokens: int | None = None,
    config=None,
    dtype: str = "bf16",
    index_dtype: str = "int32",
    dense: bool | int = False,
) -> tuple[str, CompileResult]:
    """Cross-compile a registered kernel of the sparse prefill for ``target`` as a launch at
    (H, D) would: ``name`` a name of :data:`sparse_mla.dispatch.KERNELS`, or ``"default"`` for
    the one ``sparse_mla_prefill(config=None)`` runs there (the dispatch's own choice for the
    target's arch, H, D and ``num_tokens``: the same selector serves the run and this compile).
    ``config`` is the kernel's launch (None: its default, or for ``default`` the chosen one).
    ``dense``: the slot lists' form (:data:`IDS_FORMS`; 0 CSR, 1 dense ids, 2 dense ids with
    the rows' lengths), for a kernel that reads dense ids itself (``Kernel.dense_ids``; the
    entry gives the others CSR).

    Returns (kernel name, CompileResult).
    """
    import torch

    from . import dispatch

    t = get_target(target)
    arch = t.name if t.name != "local" else None
    if name == "default":
        if config is not None:
            raise ValueError("compile_kernel: 'default' takes no config (the dispatch picks it)")
        c = dispatch.choose(dispatch.Call(arch or t.name, num_heads, head_dim,
                                          num_tokens=num_tokens))  # fmt: skip
        name, config = c.kernel, c.launch
    k = dispatch.kernel(name)
    form = _ids_form(dense)
    if form and not k.dense_ids:
        raise ValueError(
            f"compile_kernel: {name} reads CSR lists only (the entry packs dense ids to CSR "
            f"for it); the kernels that read dense ids: "
            f"{', '.join(n for n, kk in dispatch.KERNELS.items() if kk.dense_ids)}"
        )
    if name == dispatch.FALLBACK:
        res = compile_prefill(t, config, num_heads=num_heads, head_dim=head_dim, dtype=dtype,
                              index_dtype=index_dtype, dense=form)  # fmt: skip
        return name, res
    if k.compile_args is None:
        raise ValueError(f"compile_kernel: kernel {name!r} cannot be cross-compiled")
    call = dispatch.Call(t.name, num_heads, head_dim, num_tokens=num_tokens,
                         kv_format=k.kv_format)  # fmt: skip
    why = k.unavailable(call)
    if why:
        raise ValueError(f"compile_kernel: {name} cannot compile for {t.name}: {why}")
    if dtype not in _DTYPES or index_dtype not in _INDEX_DTYPES:
        raise ValueError(
            f"dtype / index_dtype must be in {sorted(_DTYPES)} / {sorted(_INDEX_DTYPES)}"
        )
    shape = {
        "num_heads": num_heads,
        "dtype": torch.bfloat16 if _DTYPES[dtype] == "bf16" else torch.float16,
        "index_dtype": torch.int64 if index_dtype == "int64" else torch.int32,
    }
    if config is not None:
        shape["config"] = config
    if form:
        shape["dense"] = form
    kernel, signature, constexprs, options = k.compile_args(t.name, **shape)
    res = compile(kernel, t, constexprs, options, signature, divisible=("stride_kvn",))
    return name, res
