"""The CLI on a user's mistake: one line on stderr, exit status 2, no traceback (--debug: one)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
CAPTURE = ROOT / "data" / "captures" / "csa_h8_topk512_t128_r2.safetensors"
SWEEP_CSV = ROOT / "data" / "sweeps" / "sm90_csa_topk512.csv"


def _mistakes(tmp: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (arguments, a word the one line must contain)."""
    damaged = tmp / "damaged.safetensors"
    damaged.write_bytes(CAPTURE.read_bytes()[:-100])
    wrong_csv = tmp / "wrong.csv"
    wrong_csv.write_text("a,b\n1,2\n")
    root = tmp / "configs"
    cfg = root / "sm90" / "triton" / "attention" / "sparse_attention_dsv4" / "DEFAULT.json"
    cfg.parent.mkdir(parents=True)
    cfg.write_text('{"H16_D512": ')
    cases = {
        "missing file": (["replay", str(tmp / "missing.safetensors")], "missing.safetensors"),
        "damaged file": (["replay", str(damaged)], "damaged.safetensors"),
        "unknown target": (["isa", "--target", "gfx9000"], "gfx9000"),
        "unknown workload": (
            ["capture", "--workload", "nope", "--out", str(tmp / "c"), "--kernel", "reference"],
            "nope",
        ),
        "bad grid key": (["sweep", "--grid", "BLOCK_X=1,2", "--target", "sm90"], "BLOCK_X"),
        "negative tokens": (["check", "--tokens", "-1"], "--tokens"),
        "bad heads list": (["sweep", "--heads", "8,x", "--target", "sm90"], "8,x"),
        "bad setting": (["isa", "--target", "sm90", "--set", "BLOCK_K=24"], "BLOCK_K"),
        "dense ids for a CSR-only kernel": (
            ["isa", "--target", "sm90", "--kernel", "gluon_mma", "--ids", "dense"],
            "gluon_mma",
        ),
        "malformed configs JSON": (
            ["export", str(SWEEP_CSV), "--arch", "sm90", "--root", str(root), "--dry-run"],
            "DEFAULT.json",
        ),
        "CSV with wrong columns": (["export", str(wrong_csv), "--arch", "sm90"], "wrong.csv"),
    }
    if not torch.cuda.is_available():
        cases["--device cuda without a GPU"] = (["replay", str(CAPTURE), "--device", "cuda"], "GPU")
    return cases


def _start(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "sparse_mla.cli", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_each_user_mistake_is_one_line_and_exit_2(tmp_path):
    cases = _mistakes(tmp_path)
    procs = {name: _start(args) for name, (args, _) in cases.items()}  # run side by side
    problems = []
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        args, word = cases[name]
        lines = [ln for ln in err.splitlines() if ln.strip()]
        ok = (
            proc.returncode == 2
            and len(lines) == 1
            and lines[0].startswith(f"sparse-mla {args[0]}: error: ")
            and word in lines[0]
            and "Traceback" not in out + err
        )
        if not ok:
            problems.append(f"{name}: exit {proc.returncode}, stderr {err[-600:]!r}")
    assert not problems, "\n".join(problems)


def test_debug_shows_the_traceback(tmp_path):
    proc = _start(["check", "--tokens", "-1", "--debug"])
    _, err = proc.communicate(timeout=300)
    assert proc.returncode not in (0, 2)
    assert "Traceback" in err and "--tokens must be >= 0" in err


def test_argparse_mistakes_keep_argparse_behaviour():
    proc = _start(["check", "--tokens", "many"])
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "invalid int value" in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [["check", "--heads", "0"], ["capture", "--calls", "0"]])
def test_numeric_bounds_in_process(argv, capsys):
    from sparse_mla import cli

    if argv[0] == "capture":
        argv = [*argv, "--workload", "csa_h8_topk512", "--out", "unused"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "must be >= 1" in err[0]


def _huge_pool_capture(tmp: Path, num_kv: int = 10**15) -> Path:
    """The shipped capture with metadata claiming ``num_kv`` pool rows and a valid hash."""
    import json
    import struct

    from safetensors.torch import load, save

    from sparse_mla import capture as cap

    raw = CAPTURE.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    meta = json.loads(json.loads(raw[8 : 8 + n])["__metadata__"][cap._META_KEY])
    call = {**meta["call"], "num_kv": num_kv}
    call["kv_shape"] = [num_kv, *call["kv_shape"][1:]]
    meta = {**meta, "call": call}
    tensors = load(raw)
    meta[cap._HASH_KEY] = cap._content_hash(tensors, meta)
    path = tmp / f"pool_{num_kv}.safetensors"
    path.write_bytes(save(tensors, metadata={cap._META_KEY: json.dumps(meta)}))
    return path


def _nested_root(tmp: Path) -> Path:
    root = tmp / "nested"
    cfg = root / "sm90" / "triton" / "attention" / "sparse_attention_dsv4" / "DEFAULT.json"
    cfg.parent.mkdir(parents=True)
    cfg.write_text("[" * 100_000 + "]" * 100_000)
    return root


# name -> (arguments, a word the line must contain, needs a machine without a GPU)
MISTAKES = {
    "isa --target local": (["isa", "--target", "local"], "--target local", True),
    "sweep --target local": (["sweep", "--target", "local", "--out", "{tmp}/s.csv"],
                             "--target local", True),
    "sweep --mode time": (["sweep", "--mode", "time", "--out", "{tmp}/s.csv"], "--mode time", True),
    "capture --device tpu": (["capture", "--workload", "csa_h8_topk512", "--out", "{tmp}/c",
                              "--device", "tpu"], "--device tpu", False),
    "capture --device meta": (["capture", "--workload", "csa_h8_topk512", "--out", "{tmp}/c",
                               "--device", "meta"], "--device meta", False),
    "replay --device tpu": (["replay", str(CAPTURE), "--device", "tpu"], "--device tpu", False),
    "check --tokens 1e11": (["check", "--tokens", "100000000000"], "--tokens", False),
    "capture --tokens 1e11": (["capture", "--workload", "csa_h8_topk512", "--out", "{tmp}/c",
                               "--tokens", "100000000000", "--device", "cpu"], "--tokens", False),
    "replay num_kv 1e15": (["replay", "{huge}"], "num_kv", False),
    "export nested DEFAULT.json": (["export", str(SWEEP_CSV), "--arch", "sm90", "--root",
                                    "{nested}", "--dry-run", "--allow-compile-only"],
                                   "DEFAULT.json: not a readable JSON file (nested too deeply)",
                                   False),
    "replay /dev/zero": (["replay", "/dev/zero"], "/dev/zero", False),
    "isa gfx942 --asm ptx": (["isa", "--target", "gfx942", "--asm", "ptx"], "no ptx stage", False),
    "check --seed 2**70": (["check", "--seed", str(2**70)], "--seed", False),
    "export a binary file": (["export", "{binary}", "--arch", "sm90"], "binary.csv", False),
    "sweep --workload-arg T": (["sweep", "--target", "sm90", "--workload-arg", "T", "--out",
                                "{tmp}/s.csv"], "--workload-arg", False),
    "capture --arg T": (["capture", "--workload", "csa_h8_topk512", "--out", "{tmp}/c", "--arg",
                         "T"], "--arg", False),
    "capture --max-bytes 10": (["capture", "--workload", "csa_h8_topk512", "--out", "{tmp}/c",
                                "--max-bytes", "10", "--device", "cpu", "--kernel", "reference",
                                "--tokens", "8"], "--max-bytes 10", False),
    "abbreviated --token": (["check", "--token", "8"], "--token", False),
    "abbreviated --dry": (["export", str(SWEEP_CSV), "--arch", "sm90", "--dry"], "--dry", False),
}  # fmt: skip


@pytest.mark.parametrize("name", list(MISTAKES))
def test_engine_grade_mistakes_are_one_line_exit_2(name, tmp_path, capsys):
    from sparse_mla import cli

    args, word, without_gpu = MISTAKES[name]
    if without_gpu and torch.cuda.is_available():
        pytest.skip("the mistake is running it without a GPU")
    binary = tmp_path / "binary.csv"
    binary.write_bytes(bytes(range(256)) * 4)
    fill = {"tmp": str(tmp_path), "binary": str(binary)}
    if "{huge}" in args:
        fill["huge"] = str(_huge_pool_capture(tmp_path))
    if "{nested}" in args:
        fill["nested"] = str(_nested_root(tmp_path))
    argv = [a.format(**fill) for a in args]

    def files():
        return sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())

    before = files()
    assert cli.main(argv) == 2
    printed = capsys.readouterr()
    lines = [ln for ln in printed.err.splitlines() if ln.strip()]
    assert len(lines) == 1, printed.err
    assert lines[0].startswith(f"sparse-mla {argv[0]}: error: ") and word in lines[0], lines[0]
    assert "Traceback" not in printed.out + printed.err
    assert files() == before, "a refused command wrote files"


def test_replay_of_a_pool_larger_than_memory_is_one_line(tmp_path, capsys):
    """A capture whose pool is possible (under the 1 TiB format limit) but larger than this
    machine's memory: refused before the rebuild allocates it."""
    from sparse_mla import capture as cap
    from sparse_mla import cli

    have = cli._memory_bytes("cpu")
    num_kv = have // (512 * 2) + 1 if have else None
    if num_kv is None or num_kv * 512 * 2 > cap.MAX_POOL_BYTES:
        pytest.skip("this machine's memory is not known or holds any pool a capture may claim")
    path = _huge_pool_capture(tmp_path, num_kv)
    assert cli.main(["replay", str(path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"num_kv={num_kv}" in err[0] and "memory" in err[0], err
