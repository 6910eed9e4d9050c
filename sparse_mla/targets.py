"""Named compile targets: ``sm90``, ``sm100``, ``gfx942``, ``gfx950`` and ``local``.

A :class:`Target` is what :mod:`sparse_mla.inspect` compiles for: Triton's backend and arch, the
warp size a Gluon layout must match, the compiler options the target takes and the hardware
limits the occupancy formulas need. None of them needs the GPU it names; ``local`` is the GPU
torch sees, if any.

Options are checked before the compiler sees them (:func:`validate_options`), because Triton
either ignores an option meant for another vendor or fails deep inside a pass: ``kpack=2`` is a
gfx942 option (the stored AMD backend takes only ``kpack=1`` on gfx950), ``kpack`` and
``waves_per_eu`` mean nothing on NVIDIA, ``maxnreg`` nothing on AMD.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from triton.backends.compiler import GPUTarget

__all__ = ["TARGETS", "Target", "get_target", "triton_target", "validate_options"]

_COMMON_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "debug"})
AMD_ONLY_OPTIONS = frozenset({"kpack", "waves_per_eu", "matrix_instr_nonkdim", "schedule_hint"})
NVIDIA_ONLY_OPTIONS = frozenset({"maxnreg"})


@dataclass(frozen=True)
class Target:
    """One compile target and the per-CU / per-SM limits its occupancy formula uses.

    ``arch`` is Triton's: an int compute capability on NVIDIA (90, 100), a ``gfx`` id on AMD.
    ``default_options`` are what :func:`validate_options` starts from (Triton's own defaults for
    the rest). On AMD, ``local_mem_bytes`` is LDS per CU; on NVIDIA, shared memory per SM.
    """

    name: str
    backend: str  # "cuda" | "hip"
    arch: int | str
    warp_size: int
    description: str = ""
    allowed_options: frozenset[str] = frozenset()
    default_options: Mapping[str, Any] = field(default_factory=dict, hash=False, compare=False)
    local_mem_bytes: int = 0
    max_occupancy: int = 0  # waves per SIMD (AMD) or warps per SM (NVIDIA)

    @property
    def is_amd(self) -> bool:
        return self.backend == "hip"

    @property
    def occupancy_unit(self) -> str:
        return "waves/SIMD" if self.is_amd else "warps/SM"

    def __str__(self) -> str:
        return self.name


def _amd(name: str, description: str, lds_bytes: int) -> Target:
    return Target(
        name=name,
        backend="hip",
        arch=name,
        warp_size=64,
        description=description,
        allowed_options=_COMMON_OPTIONS | AMD_ONLY_OPTIONS,
        default_options={"num_warps": 4, "num_stages": 2},
        local_mem_bytes=lds_bytes,
        max_occupancy=8,
    )


def _nvidia(name: str, cc: int, description: str) -> Target:
    return Target(
        name=name,
        backend="cuda",
        arch=cc,
        warp_size=32,
        description=description,
        allowed_options=_COMMON_OPTIONS | NVIDIA_ONLY_OPTIONS,
        default_options={"num_warps": 4, "num_stages": 2},
        local_mem_bytes=228 * 1024,
        max_occupancy=64,
    )


_NAMED: dict[str, Target] = {
    "sm90": _nvidia("sm90", 90, "NVIDIA Hopper (H100/H200)"),
    "sm100": _nvidia("sm100", 100, "NVIDIA Blackwell (B200/GB200)"),
    "gfx942": _amd("gfx942", "AMD CDNA3 (MI300X/MI325X)", 64 * 1024),
    "gfx950": _amd("gfx950", "AMD CDNA4 (MI350X/MI355X)", 160 * 1024),
}

TARGETS: tuple[str, ...] = (*_NAMED, "local")


def get_target(name: str | Target) -> Target:
    """The :class:`Target` for ``name``: one of :data:`TARGETS` (``"local"``: the GPU present).

    Also accepts an arch id as the runtime reports it (``"sm_90"``, ``"gfx942:sramecc+"``).
    """
    if isinstance(name, Target):
        return name
    if not isinstance(name, str):
        raise TypeError(f"target must be a name (one of {list(TARGETS)}) or a Target, got {name!r}")
    key = name.strip().lower().split(":")[0].replace("sm_", "sm")
    if key == "local":
        from . import runtime

        arch = runtime.arch()
        if arch is None:
            raise RuntimeError(
                "target 'local': torch sees no GPU on this machine; cross-compile for a named "
                f"target instead: one of {list(_NAMED)}"
            )
        return _from_arch(arch)
    if key in _NAMED:
        return _NAMED[key]
    raise ValueError(f"target: unknown name {name!r}; expected one of {list(TARGETS)}")


def _from_arch(arch: str) -> Target:
    if arch in _NAMED:
        return _NAMED[arch]
    if arch.startswith("sm") and arch[2:].isdigit():
        return _nvidia(arch, int(arch[2:]), f"local NVIDIA GPU ({arch})")
    if arch.startswith("gfx9"):
        return _amd(arch, f"local AMD GPU ({arch})", 64 * 1024)
    raise RuntimeError(
        f"target 'local': the GPU's arch {arch!r} is not one inspect can compile for"
    )


def triton_target(target: str | Target) -> GPUTarget:
    """Triton's ``GPUTarget`` for a target (what ``triton.compile(..., target=)`` takes)."""
    t = get_target(target)
    return GPUTarget(t.backend, t.arch, t.warp_size)


def _is_pow2(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0 and v & (v - 1) == 0


def validate_options(target: str | Target, options: Mapping[str, Any] | None) -> dict[str, Any]:
    """Check compiler options for ``target``; return them merged over its defaults.

    Keys with value None are dropped (None means "the compiler's default"). Raises ValueError
    naming the option on an unknown key, an option of the other vendor or a bad value.
    """
    t = get_target(target)
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(f"options must be a dict or None, got {type(options).__name__}")
    given = {k: v for k, v in (options or {}).items() if v is not None}
    for key in sorted(given):
        if key in t.allowed_options:
            continue
        if key in AMD_ONLY_OPTIONS:
            raise ValueError(f"options: {key} is an AMD option; target {t.name} does not take it")
        if key in NVIDIA_ONLY_OPTIONS:
            raise ValueError(f"options: {key} is an NVIDIA option; {t.name} does not take it")
        raise ValueError(
            f"options: unknown option {key!r} for target {t.name}; "
            f"expected one of {sorted(t.allowed_options)}"
        )
    out = {**t.default_options, **given}

    max_warps = 1024 // t.warp_size
    nw = out["num_warps"]
    if not _is_pow2(nw) or nw > max_warps:
        raise ValueError(
            f"options: num_warps must be a power of two <= {max_warps} on {t.name} "
            f"(1024 threads / warp size {t.warp_size}), got {nw!r}"
        )
    ns = out["num_stages"]
    if isinstance(ns, bool) or not isinstance(ns, int) or ns < 1:
        raise ValueError(f"options: num_stages must be an int >= 1, got {ns!r}")
    nc = out.get("num_ctas", 1)
    if not _is_pow2(nc) or (nc > 1 and (t.is_amd or int(t.arch) < 90)):
        raise ValueError(
            f"options: num_ctas must be 1 on {t.name} (clusters need sm90+), got {nc!r}"
        )
    for key in ("enable_fp_fusion", "debug"):
        if key in out and not isinstance(out[key], bool):
            raise ValueError(f"options: {key} must be a bool, got {out[key]!r}")

    if "kpack" in out:
        kp = out["kpack"]
        if kp not in (1, 2) or isinstance(kp, bool):
            raise ValueError(f"options: kpack must be 1 or 2, got {kp!r}")
        if kp == 2 and t.arch != "gfx942":
            raise ValueError(
                f"options: kpack=2 is a gfx942 option; {t.name} takes only kpack=1 "
                "(the AMD backend forces kpack to 1 from gfx950 on)"
            )
    if "waves_per_eu" in out:
        w = out["waves_per_eu"]
        if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w <= t.max_occupancy:
            raise ValueError(
                f"options: waves_per_eu must be an int in [0, {t.max_occupancy}] "
                f"(0 = no hint), got {w!r}"
            )
    if "matrix_instr_nonkdim" in out and out["matrix_instr_nonkdim"] not in (0, 16, 32):
        raise ValueError(
            f"options: matrix_instr_nonkdim must be 0 (auto), 16 or 32, "
            f"got {out['matrix_instr_nonkdim']!r}"
        )
    if "schedule_hint" in out and not isinstance(out["schedule_hint"], str):
        raise ValueError(f"options: schedule_hint must be a str, got {out['schedule_hint']!r}")
    if "maxnreg" in out:
        r = out["maxnreg"]
        if isinstance(r, bool) or not isinstance(r, int) or not 24 <= r <= 255:
            raise ValueError(f"options: maxnreg must be an int in [24, 255], got {r!r}")
    return out
