"""The profile view: Nsight Compute's stalls per source line (issue 23, goal 5). On CPU: the
message without ncu or a GPU, and the CSV parsers; on the H200 (``-m gpu`` with ncu on PATH):
a real profile of the warp-specialised kernel."""

from __future__ import annotations

import os
import shutil

import pytest

from sparse_mla import profile as prof
from sparse_mla import runtime
from sparse_mla.cli import main


def test_without_ncu_every_entry_says_so(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv(prof.NCU_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no ncu on it
    why = prof.unavailable()
    assert why and "ncu" in why and "not on PATH" in why
    assert main(["profile", "--kernel", "gluon_ws", "--heads", "64"]) == 1
    err = capsys.readouterr().err
    assert "ncu" in err and "not on PATH" in err and "Traceback" not in err
    with pytest.raises(RuntimeError, match="ncu"):
        prof.profile("triton", 16)
    from sparse_mla.lab.explorer import ExplorerPanel

    panel = ExplorerPanel("sm90", 16, 512, run_errors=False, start=False)
    try:
        assert panel.profile_button.disabled and "not on PATH" in panel.profile_view.value
        panel.profile()
        assert "not on PATH" in panel.profile_view.value and panel.profile_result is None
    finally:
        panel.close()


@pytest.mark.skipif(runtime.has_gpu(), reason="the no-GPU message")
def test_with_ncu_but_no_gpu_says_no_gpu(monkeypatch, tmp_path):
    fake = tmp_path / "ncu"
    fake.write_text("#!/bin/sh\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv(prof.NCU_ENV, str(fake))
    assert prof.ncu_path() == str(fake)
    assert "no GPU" in prof.unavailable()


SOURCE_CSV = """==PROF== Disconnected from process 1234
"File: /repo/sparse_mla/gluon/hopper_ws.py"
"#","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","Instructions Executed"
"266","    mbarrier.wait(ready.index(s), phase)","1,520","1,400","2048"
"267","    s = warpgroup_mma(q_smem, k.permute((1, 0)), s)","310","120","4096"
"268","    # a comment","0","0","0"
"File: /repo/sparse_mla/gluon/standard.py"
"#","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","Instructions Executed"
"40","    return x","7","2","64"
"""  # noqa: E501

RAW_CSV = """"ID","Kernel Name","smsp__pcsamp_warps_issue_stalled_long_scoreboard","smsp__pcsamp_warps_issue_stalled_barrier","smsp__pcsamp_warps_issue_stalled_barrier_not_issued","smsp__pcsamp_warps_issue_stalled_wait"
"","","sample","sample","sample","sample"
"0","_prefill_ws_kernel","1,200","800","700","0"
"""  # noqa: E501


def test_source_and_raw_csv_parsers():
    lines = prof.parse_source_csv(SOURCE_CSV)
    got = [(pl.file, pl.line, pl.samples()) for pl in lines]
    assert got == [("hopper_ws.py", 266, 1520.0), ("hopper_ws.py", 267, 310.0),
                   ("standard.py", 40, 7.0)]  # fmt: skip
    assert lines[1].metrics["Instructions Executed"] == 4096.0
    assert "mbarrier.wait" in lines[0].source
    stalls = prof.parse_raw_csv(RAW_CSV)
    assert stalls == {"long_scoreboard": 1200.0, "barrier": 800.0}
    p = prof.Profile("gluon_ws", {}, {"H": 64, "D": 512, "T": 4096}, lines, stalls, "r.ncu-rep",
                     [])  # fmt: skip
    text = prof.profile_table(p)
    assert "long_scoreboard" in text and "60.0%" in text  # 1200 of 2000 samples
    assert text.index("hopper_ws.py:266") < text.index("hopper_ws.py:267")  # most samples first


@pytest.mark.gpu
def test_profile_of_the_warp_specialised_kernel_on_the_gpu(tmp_path):
    if prof.ncu_path() is None:
        pytest.skip("ncu is not on PATH")
    if runtime.arch() != "sm90":
        pytest.skip("gluon_ws runs on sm90")
    p = prof.profile("gluon_ws", 64, num_tokens=1024, out_dir=tmp_path)
    assert os.path.exists(p.report)
    assert p.stalls and all(v > 0 for v in p.stalls.values()), p.stalls
    ws = [pl for pl in p.lines if pl.file == "hopper_ws.py"]
    assert ws and sum(pl.samples() for pl in ws) > 0, [(pl.file, pl.line) for pl in p.lines]
    print(prof.profile_table(p))
    shutil.rmtree(tmp_path, ignore_errors=True)
