"""Named targets and option validation (no compiling)."""

from __future__ import annotations

import pytest
from triton.backends.compiler import GPUTarget

from sparse_mla import runtime
from sparse_mla.targets import TARGETS, Target, get_target, triton_target, validate_options


@pytest.mark.parametrize(
    ("name", "backend", "arch", "warp"),
    [("sm90", "cuda", 90, 32), ("sm100", "cuda", 100, 32), ("gfx942", "hip", "gfx942", 64),
     ("gfx950", "hip", "gfx950", 64)],
)  # fmt: skip
def test_named_targets(name, backend, arch, warp):
    t = get_target(name)
    assert isinstance(t, Target) and name in TARGETS
    assert (t.name, t.backend, t.arch, t.warp_size) == (name, backend, arch, warp)
    assert triton_target(name) == GPUTarget(backend, arch, warp)
    assert get_target(t) is t
    assert get_target(name.upper()) is t


def test_arch_spellings_and_unknown_name():
    assert get_target("sm_90").name == "sm90"
    assert get_target("gfx942:sramecc+:xnack-").name == "gfx942"
    with pytest.raises(ValueError, match="unknown name 'gfx1100'"):
        get_target("gfx1100")
    with pytest.raises(TypeError, match="target must be"):
        get_target(90)


def test_local_without_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(runtime, "arch", lambda device_index=0: None)
    with pytest.raises(RuntimeError, match="no GPU"):
        get_target("local")


def test_local_maps_the_runtime_arch(monkeypatch):
    monkeypatch.setattr(runtime, "arch", lambda device_index=0: "gfx950")
    assert get_target("local") is get_target("gfx950")
    monkeypatch.setattr(runtime, "arch", lambda device_index=0: "sm89")
    t = get_target("local")
    assert (t.backend, t.arch, t.warp_size) == ("cuda", 89, 32)


def test_validate_merges_defaults_and_drops_none():
    opts = validate_options("gfx942", {"num_warps": 8, "kpack": 2, "waves_per_eu": None})
    assert opts == {"num_warps": 8, "num_stages": 2, "kpack": 2}
    assert validate_options("sm90", None) == {"num_warps": 4, "num_stages": 2}
    assert validate_options("sm90", {"maxnreg": 128})["maxnreg"] == 128


@pytest.mark.parametrize(
    ("target", "options", "message"),
    [
        ("gfx950", {"kpack": 2}, "kpack=2 is a gfx942 option"),
        ("sm90", {"kpack": 1}, "kpack is an AMD option"),
        ("sm100", {"waves_per_eu": 2}, "waves_per_eu is an AMD option"),
        ("gfx942", {"maxnreg": 128}, "maxnreg is an NVIDIA option"),
        ("gfx942", {"kpack": 4}, "kpack must be 1 or 2"),
        ("gfx942", {"waves_per_eu": 9}, "waves_per_eu must be an int in"),
        ("gfx942", {"num_warps": 3}, "num_warps must be a power of two"),
        ("gfx942", {"num_warps": 32}, r"num_warps must be a power of two <= 16"),
        ("sm90", {"num_warps": 0}, "num_warps must be a power of two"),
        ("sm90", {"num_stages": 0}, "num_stages must be an int >= 1"),
        ("gfx950", {"num_ctas": 2}, "num_ctas must be 1"),
        ("gfx942", {"matrix_instr_nonkdim": 8}, "matrix_instr_nonkdim"),
        ("sm90", {"maxnreg": 300}, "maxnreg must be an int"),
        ("sm90", {"numwarps": 4}, "unknown option 'numwarps'"),
    ],
)
def test_invalid_options_raise_clearly(target, options, message):
    with pytest.raises(ValueError, match=message):
        validate_options(target, options)


def test_options_must_be_a_mapping():
    with pytest.raises(TypeError, match="options must be a dict"):
        validate_options("sm90", [("num_warps", 4)])
