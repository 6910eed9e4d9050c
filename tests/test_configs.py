"""Tuned-config files: schema, lookup (hit, silent miss, override) and clear errors."""

from __future__ import annotations

import json
import logging
import os
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


# ---------------------------------------------------------------------------------------------
# Files that are not what they claim, and where lookups look (issue 24, items 6 and 8)
# ---------------------------------------------------------------------------------------------

CHOICE_PROV = {"device": "t", "date": "2026-12-01", "source": "t", "times_ms": {}}


def _with_choice(name, launch):
    prov = {**CHOICE_PROV, "times_ms": {name: 1.0}}
    choice = {"name": name, "launch": launch, "provenance": prov}
    return {"H16_D512": {"kernel": choice, "launch": LAUNCH, "provenance": PROV}}


BAD_TEXT = {
    "kernel.launch unknown key": (
        json.dumps(_with_choice("gluon_ws_small", {"HEAD_GROUPS": 1, "BOGUS": 2})),
        "gluon_ws_small.*BOGUS",
    ),
    "kernel.launch bad value": (
        json.dumps(_with_choice("gluon_ws_small", {"HEAD_GROUPS": 3})),
        "HEAD_GROUPS must be 1 or 2",
    ),
    "kernel.launch wgmma flag": (
        json.dumps(_with_choice("gluon_mma", {"BLOCK_H": 16, "wgmma": 1})),
        "gluon_mma.*wgmma",
    ),
    "kernel.launch bool for an int": (
        json.dumps(_with_choice("gluon_mma", {"BLOCK_H": 16, "num_warps": True})),
        "num_warps must be an int",
    ),
    "kernel.launch for a kernel without knobs": (
        json.dumps(_with_choice("gluon_ws", {"BLOCK_K": 64})),
        "gluon_ws.*BLOCK_K",
    ),
    "duplicate shape key": (
        '{{"H16_D512": {0}, "H16_D512": {0}}}'.format(
            json.dumps({"launch": LAUNCH, "provenance": PROV})
        ),
        "duplicate key 'H16_D512'",
    ),
    "duplicate launch key": (
        '{"H16_D512": {"launch": {"BLOCK_H": 16, "BLOCK_H": 32, "BLOCK_K": 16, "num_warps": 4,'
        ' "num_stages": 2}, "provenance": ' + json.dumps(PROV) + "}}",
        "duplicate key 'BLOCK_H'",
    ),
    "100k-deep nesting": ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    "5000-digit integer": (
        json.dumps({"H16_D512": {"launch": {**LAUNCH, "BLOCK_K": 7}, "provenance": PROV}}).replace(
            '"BLOCK_K": 7', '"BLOCK_K": ' + "9" * 5000
        ),
        "integer of 5000 digits",
    ),
    "not UTF-8": (b"\xff\xfe{}", "not UTF-8"),
}


@pytest.mark.parametrize("case", sorted(BAD_TEXT))
def test_bad_file_text_is_a_config_file_error_naming_the_file(tmp_path, case):
    text, message = BAD_TEXT[case]
    path = configs.config_path("sm90", tmp_path)
    path.parent.mkdir(parents=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    for check in (
        lambda: configs.lookup("sm90", 16, 512, root=tmp_path),
        lambda: configs.validate_all(tmp_path),
        lambda: configs.validate_file(path),
    ):
        with pytest.raises(configs.ConfigFileError, match=message) as err:
            check()
        assert str(path) in str(err.value)


def test_shipped_kernel_launches_pass_the_file_check():
    # Every recorded choice's own launch is one its kernel takes (checked at file read); the
    # sm90 choices record null where the bench ran the kernel's default (all of them since the
    # export by list length), which resolves to that default for the shape.
    from sparse_mla import dispatch

    found = configs.validate_all(configs.CONFIG_ROOT)
    choices = [(e, c) for e in found["sm90"].values() for c in e.kernels]
    assert choices
    for e, c in choices:
        assert c.launch is None or all(isinstance(v, int) for v in c.launch.values()), c
        call = dispatch.Call("sm90", e.num_heads, e.head_dim, num_tokens=(c.tokens or (1,))[0])
        if c.name != dispatch.FALLBACK:  # (raises when the kernel cannot take it)
            assert dispatch.kernel(c.name).resolve(c.launch, call) is not None, (e.key, c)


def test_symlink_loop_dangling_symlink_and_unreadable_paths(tmp_path):
    path = configs.config_path("sm90", tmp_path)
    path.parent.mkdir(parents=True)
    path.symlink_to(path)  # a loop: stat() fails with ELOOP
    for check in (
        lambda: configs.lookup("sm90", 16, 512, root=tmp_path),
        lambda: configs.validate_all(tmp_path),
    ):
        with pytest.raises(configs.ConfigFileError, match="symbolic links") as err:
            check()
        assert str(path) in str(err.value)
    path.unlink()
    path.symlink_to(tmp_path / "gone.json")
    for check in (
        lambda: configs.lookup("sm90", 16, 512, root=tmp_path),
        lambda: configs.validate_all(tmp_path),
    ):
        with pytest.raises(configs.ConfigFileError, match="dangling symlink") as err:
            check()
        assert str(path) in str(err.value) and "gone.json" in str(err.value)
    # The same file through a valid link is read (a shared deployment file).
    (tmp_path / "gone.json").write_text(json.dumps({"H16_D512": {"launch": LAUNCH,
                                                                 "provenance": PROV}}))  # fmt: skip
    assert configs.lookup("sm90", 16, 512, root=tmp_path).BLOCK_K == 64


def test_missing_roots_are_refused(tmp_path, monkeypatch):
    missing = pytest.raises(configs.ConfigFileError, match=r"use_root: .*nowhere is not an exist")
    with missing, configs.use_root(tmp_path / "nowhere"):
        pass
    monkeypatch.setenv(configs.CONFIG_DIR_ENV, str(tmp_path / "typo"))
    with pytest.raises(configs.ConfigFileError, match=r"SPARSE_MLA_CONFIG_DIR=.*typo"):
        configs.lookup("sm90", 16, 512)
    # Unset, the per-user folder may be absent: silent.
    monkeypatch.delenv(configs.CONFIG_DIR_ENV)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "no_such_home"))
    assert configs.user_root() == tmp_path / "no_such_home" / "sparse-mla"
    assert configs.lookup("gfx942", 16, 512) is not None  # the shipped entry


def test_user_root_reads_over_the_shipped_files_per_shape(tmp_path, monkeypatch):
    user = tmp_path / "user"
    own = {**LAUNCH, "BLOCK_K": 32, "num_warps": 2}
    path = _write(user, "gfx942", {"H16_D512": {"launch": own, "provenance": PROV}})
    monkeypatch.setenv(configs.CONFIG_DIR_ENV, str(user))
    assert configs.roots() == (user, configs.CONFIG_ROOT)
    hit = configs.lookup_entry("gfx942", 16, 512)
    assert (hit.launch.BLOCK_K, hit.launch.num_warps, hit.source) == (32, 2, str(path))
    shipped = configs.lookup_entry("gfx942", 8, 512)  # not in the user's file: the shipped one
    assert shipped.launch.kpack == 2 and shipped.source.startswith(str(configs.CONFIG_ROOT))
    assert set(configs.validate_all()["gfx942"]) == {"H8_D512", "H16_D512"}
    assert configs.config_path("sm90") == configs.config_path("sm90", user)  # exports go here


def test_the_process_wide_root_reaches_worker_threads_use_root_does_not(tmp_path, monkeypatch):
    import threading

    user, scratch = tmp_path / "user", tmp_path / "scratch"
    for root, block_k in ((user, 16), (scratch, 128)):
        entry = {"launch": {**LAUNCH, "BLOCK_K": block_k}, "provenance": PROV}
        _write(root, "sm90", {"H24_D64": entry})
    monkeypatch.setenv(configs.CONFIG_DIR_ENV, str(user))

    def in_a_thread():
        seen = []
        t = threading.Thread(target=lambda: seen.append(configs.lookup("sm90", 24, 64)))
        t.start()
        t.join()
        return seen[0].BLOCK_K

    assert configs.lookup("sm90", 24, 64).BLOCK_K == in_a_thread() == 16
    with configs.use_root(scratch):
        assert configs.lookup("sm90", 24, 64).BLOCK_K == 128  # this thread
        assert in_a_thread() == 16  # a worker thread: the process-wide root
    assert configs.lookup("sm90", 24, 64).BLOCK_K == 16


def test_isa_names_the_file_the_entry_came_from(tmp_path, monkeypatch):
    from sparse_mla import cli

    shipped = configs.config_path("gfx942", configs.CONFIG_ROOT)
    assert f"tuned entry H16_D512 in {shipped} " in cli._config_origin("gfx942", 16, 512)
    user = tmp_path / "user"
    path = _write(user, "gfx942", {"H16_D512": {"launch": LAUNCH, "provenance": PROV}})
    monkeypatch.setenv(configs.CONFIG_DIR_ENV, str(user))
    assert f"tuned entry H16_D512 in {path} " in cli._config_origin("gfx942", 16, 512)
    miss = cli._config_origin("gfx942", 48, 512)
    assert str(configs.config_path("gfx942", user)) in miss and str(shipped) in miss


def test_roots_cached_follows_the_environment(tmp_path, monkeypatch):
    """The entry's per-call roots (configs.roots_cached) are roots()'s, the user root over the
    shipped files, whatever the environment and use_root say, and a config dir that is gone
    still raises."""
    from sparse_mla import configs

    def same():
        assert configs.roots_cached() == configs.roots()
        assert configs.roots_cached()[-1] == (configs._ACTIVE_ROOT.get() or configs.CONFIG_ROOT)

    same()
    for var in ("SPARSE_MLA_CONFIG_DIR", "XDG_CONFIG_HOME"):
        monkeypatch.delenv(var, raising=False)
    same()
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    same()
    assert configs.roots_cached() == (tmp_path / "sparse-mla", configs.CONFIG_ROOT)
    d = tmp_path / "cfg"
    d.mkdir()
    monkeypatch.setenv("SPARSE_MLA_CONFIG_DIR", str(d))
    same()
    with configs.use_root(tmp_path):
        assert configs.roots_cached() == (tmp_path,)
    d.rmdir()
    with pytest.raises(configs.ConfigFileError, match="not an existing folder"):
        configs.roots_cached()


def test_env_reads_match_os_environ(monkeypatch):
    from sparse_mla import _env

    name = "SPARSE_MLA_TEST_ENV_READ"
    monkeypatch.delenv(name, raising=False)
    assert _env.getenv(name) is None
    for value in ("1", " On ", "", "é/x"):
        monkeypatch.setenv(name, value)
        assert _env.getenv(name) == os.environ.get(name) == value


def test_holds_is_a_half_open_bucket():
    # [lo, hi): lo in, hi out; hi None has no upper end; a bucket None holds every value; an
    # unknown value (None) only an open-ended bucket
    assert configs.holds((8, 32), 8) and configs.holds((8, 32), 31)
    assert not configs.holds((8, 32), 32) and not configs.holds((8, 32), 7)
    assert configs.holds([32, None], 10**9) and not configs.holds([32, None], 31)
    assert configs.holds(None, 5) and configs.holds(None, None)
    assert configs.holds((32, None), None) and not configs.holds((8, 32), None)
