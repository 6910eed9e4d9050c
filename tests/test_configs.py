"""Tuned-config files: schema, lookup (hit, silent miss, override) and clear errors."""

from __future__ import annotations

import json
import logging
import warnings

import pytest

from sparse_mla import configs, prefill
from sparse_mla.prefill import PrefillConfig

PROV = {
    "device": "NVIDIA H200",
    "triton": "3.6.0",
    "date": "2026-11-29",
    "workload": "test",
    "time_ms": 1.5,
    "sweep_size": 12,
}
LAUNCH = {"BLOCK_H": 16, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3, "USE_EXP2": False}


def _write(root, arch, data):
    path = configs.config_path(arch, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_shipped_files_validate_and_hold_aiters_gfx942_entry():
    found = configs.validate_all()
    assert "gfx942" in found
    pinned = PrefillConfig(
        BLOCK_H=16, BLOCK_K=16, num_warps=1, num_stages=2, EVEN_HD=True, USE_EXP2=True,
        kpack=2, waves_per_eu=1,
    )  # fmt: skip
    assert configs.lookup("gfx942", 16, 512) == pinned
    # H=8 is not a multiple of BLOCK_H=16: the head mask stays (EVEN_HD off), all else pinned.
    assert configs.lookup("gfx942", 8, 512) == PrefillConfig(
        **{**pinned.to_dict(), "EVEN_HD": False}
    )
    for key in ("H8_D512", "H16_D512"):
        prov = found["gfx942"][key].provenance
        assert prov["source"] == "ROCm/aiter #6002"
        assert prov["triton"] == "3.7.1" and "MI325X" in prov["device"]
    # Swept shapes only: H=32 or another head dim keeps the default launch.
    assert configs.lookup("gfx942", 32, 512) is None
    assert configs.lookup("gfx942", 16, 576) is None


def test_lookup_hit(tmp_path):
    _write(tmp_path, "sm90", {"H16_D512": {"launch": LAUNCH, "provenance": PROV}})
    cfg = configs.lookup("sm90", 16, 512, root=tmp_path)
    assert cfg == PrefillConfig(BLOCK_H=16, BLOCK_K=64, num_warps=8, num_stages=3, USE_EXP2=False)
    entry = configs.lookup_entry("sm90", 16, 512, root=tmp_path)
    assert entry.provenance["time_ms"] == 1.5 and entry.key == "H16_D512"


def test_lookup_miss_is_silent(tmp_path, caplog, capsys):
    _write(tmp_path, "sm90", {"H16_D512": {"launch": LAUNCH, "provenance": PROV}})
    caplog.set_level(logging.DEBUG)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert configs.lookup("sm90", 32, 512, root=tmp_path) is None  # no entry
        assert configs.lookup("sm90", 16, 128, root=tmp_path) is None  # other head dim
        assert configs.lookup("gfx950", 16, 512, root=tmp_path) is None  # no file
        assert configs.lookup(None, 16, 512, root=tmp_path) is None  # no GPU
        cfg = prefill.resolve_config(32, 512, None, "sm90")
    assert cfg == prefill.default_config(32, 512)
    assert caught == []
    assert caplog.records == []
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""


def test_resolve_config_uses_entry_and_config_overrides(tmp_path, monkeypatch):
    _write(tmp_path, "sm90", {"H16_D512": {"launch": LAUNCH, "provenance": PROV}})
    monkeypatch.setattr(configs, "CONFIG_ROOT", tmp_path)
    tuned = prefill.resolve_config(16, 512, None, "sm90")
    assert tuned.BLOCK_K == 64 and tuned.num_stages == 3
    override = PrefillConfig(BLOCK_H=16, BLOCK_K=16, num_warps=2, num_stages=1)
    assert prefill.resolve_config(16, 512, override, "sm90") == override
    assert prefill.resolve_config(16, 512, {"BLOCK_K": 128}, "sm90").BLOCK_K == 128


BROKEN = {
    "not json": ("{oops", "not a readable JSON"),
    "top level list": ([1, 2], "top level must be an object"),
    "bad shape key": ({"H16": {"launch": LAUNCH, "provenance": PROV}}, "H16_D512"),
    "unknown launch key": (
        {"H16_D512": {"launch": {**LAUNCH, "BLOCK_M": 64}, "provenance": PROV}},
        "BLOCK_M",
    ),
    "string where int": (
        {"H16_D512": {"launch": {**LAUNCH, "BLOCK_K": "64"}, "provenance": PROV}},
        "BLOCK_K must be int",
    ),
    "int where bool": (
        {"H16_D512": {"launch": {**LAUNCH, "USE_EXP2": 1}, "provenance": PROV}},
        "USE_EXP2 must be bool",
    ),
    "not a power of two": (
        {"H16_D512": {"launch": {**LAUNCH, "BLOCK_K": 48}, "provenance": PROV}},
        "power of two",
    ),
    "BLOCK_K unbounded": (
        {"H16_D512": {"launch": {**LAUNCH, "BLOCK_K": 1024}, "provenance": PROV}},
        r"BLOCK_K must be a power of two in \[16, 256\]",
    ),
    "num_stages unbounded": (
        {"H16_D512": {"launch": {**LAUNCH, "num_stages": 100}, "provenance": PROV}},
        "num_stages must be an int in",
    ),
    "EVEN_HD invalid for shape": (
        {"H8_D512": {"launch": {**LAUNCH, "EVEN_HD": True}, "provenance": PROV}},
        "EVEN_HD",
    ),
    "AMD option on sm90": (
        {"H16_D512": {"launch": {**LAUNCH, "kpack": 2}, "provenance": PROV}},
        "AMD compiler options",
    ),
    "missing provenance field": (
        {"H16_D512": {"launch": LAUNCH, "provenance": {**PROV, "device": None}}},
        "device must be str",
    ),
    "bad date": (
        {"H16_D512": {"launch": LAUNCH, "provenance": {**PROV, "date": "yesterday"}}},
        "date must be ISO",
    ),
    "no launch": ({"H16_D512": {"provenance": PROV}}, "entry keys"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_malformed_file_names_the_file(tmp_path, case):
    data, message = BROKEN[case]
    path = _write(tmp_path, "sm90", data)
    with pytest.raises(configs.ConfigFileError, match=message) as err:
        configs.lookup("sm90", 16, 512, root=tmp_path)
    assert str(path) in str(err.value)
    with pytest.raises(configs.ConfigFileError, match=message):
        configs.validate_all(tmp_path)


def test_shape_keys():
    assert configs.shape_key(128, 512) == "H128_D512"
    assert configs.parse_shape_key("H128_D512") == (128, 512)
    for bad in ("H0_D512", "h16_d512", "H16_D512x", 16):
        with pytest.raises(ValueError, match="H16_D512"):
            configs.parse_shape_key(bad)
    with pytest.raises(ValueError, match="arch"):
        configs.config_path("../etc")


def test_use_root_redirects_lookup_and_restores(tmp_path):
    from sparse_mla import configs as cfgmod

    path = cfgmod.config_path("sm90", tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(
        '{"H24_D64": {"launch": {"BLOCK_H": 32, "BLOCK_K": 16, "num_warps": 2, "num_stages": 1},'
        ' "provenance": {"device": "t", "triton": "3.6.0", "date": "2026-11-29", "workload": "w",'
        ' "time_ms": null, "sweep_size": null}}}'
    )
    assert cfgmod.lookup("sm90", 24, 64) is None
    with cfgmod.use_root(tmp_path):
        hit = cfgmod.lookup("sm90", 24, 64)
        assert hit is not None and hit.BLOCK_H == 32 and hit.num_warps == 2
    assert cfgmod.lookup("sm90", 24, 64) is None
