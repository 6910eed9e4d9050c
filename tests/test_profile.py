"""The profile view: Nsight Compute's stalls per source line (issue 23, goal 5). On CPU: the
message without ncu or a GPU, and the CSV parsers; on the H200 (``-m gpu`` with ncu on PATH):
a real profile of the warp-specialised kernel."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

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


def test_cli_passes_the_workload_context_and_topk(monkeypatch, capsys):
    """``sparse-mla profile --context N --topk K`` profiles the whole-list workload the bench's
    ``--grid --context`` builds; bad values are refused before anything runs."""
    seen = {}

    def fake_profile(kernel, num_heads, head_dim=512, **kw):
        seen.update(kw, kernel=kernel, H=num_heads)
        shape = {"H": num_heads, "D": head_dim, "T": kw["num_tokens"],
                 "context": kw["context"], "topk": kw["topk"] or 512}  # fmt: skip
        return prof.Profile(kernel, {}, shape, [], {"long_scoreboard": 1.0}, "r.ncu-rep", [])

    from sparse_mla import tune

    monkeypatch.setattr(prof, "unavailable", lambda: None)
    monkeypatch.setattr(prof, "profile", fake_profile)
    monkeypatch.setattr(tune, "kernel_launch", lambda *a, **kw: None)  # "local": no GPU here
    argv = ["profile", "--kernel", "triton", "--heads", "64", "--tokens", "128"]
    assert main([*argv, "--context", "65536", "--topk", "1024"]) == 0
    assert (seen["num_tokens"], seen["context"], seen["topk"]) == (128, 65536, 1024)
    assert "T=128 topk=1024 context=65536" in capsys.readouterr().out
    assert main(argv) == 0
    assert (seen["context"], seen["topk"]) == (0, None)  # a short prompt, the grid's top-k
    for bad in (["--context", "-1"], ["--topk", "0"]):
        seen.clear()
        assert main([*argv, *bad]) == 2
        assert not seen and "--context" in capsys.readouterr().err
    monkeypatch.undo()  # the real entry refuses a negative context before anything runs
    with pytest.raises(ValueError, match="context"):
        prof.profile("triton", 16, context=-1)


def test_panel_profile_passes_the_workload(monkeypatch):
    """The workbook's profile tab takes the same workload knobs as the CLI (T, context)."""
    import dataclasses

    from sparse_mla.lab.explorer import ExplorerPanel

    seen = {}

    def fake_profile(kernel, num_heads, head_dim=512, **kw):
        seen.update(kw)
        shape = {"H": num_heads, "D": head_dim, "T": kw["num_tokens"], "context": kw["context"]}
        return prof.Profile(kernel, {}, shape, [], {"barrier": 2.0}, "r.ncu-rep", [])

    monkeypatch.setattr(prof, "unavailable", lambda: None)
    monkeypatch.setattr(prof, "profile", fake_profile)
    panel = ExplorerPanel("sm90", 16, 512, run_errors=False, start=False)
    try:
        local = dataclasses.replace(panel.state(), target="local")
        monkeypatch.setattr(panel, "state", lambda: local)
        panel.profile(num_tokens=128, context=65536)
        assert (seen["num_tokens"], seen["context"]) == (128, 65536)
        assert panel.profile_result is not None and "context=65536" in panel.profile_view.value
        panel.profile_tokens.value, panel.profile_context.value = 64, 1024  # the tab's boxes
        panel.profile_button.click()
        assert (seen["num_tokens"], seen["context"]) == (64, 1024)
    finally:
        panel.close()


def _needs_ncu_on_sm90():
    if prof.ncu_path() is None:
        pytest.skip("ncu is not on PATH")
    if runtime.arch() != "sm90":
        pytest.skip("gluon_ws runs on sm90")


@pytest.mark.gpu
def test_profile_of_the_warp_specialised_kernel_on_the_gpu(tmp_path):
    _needs_ncu_on_sm90()
    p = prof.profile("gluon_ws", 64, num_tokens=1024, out_dir=tmp_path)
    assert os.path.exists(p.report)
    assert p.stalls and all(v > 0 for v in p.stalls.values()), p.stalls
    ws = [pl for pl in p.lines if pl.file == "hopper_ws.py"]
    assert ws and sum(pl.samples() for pl in ws) > 0, [(pl.file, pl.line) for pl in p.lines]
    print(prof.profile_table(p))
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.gpu
def test_profile_on_whole_lists_on_the_gpu(tmp_path):
    """The whole-list workload (context 65536): each token's list is top-k + window slots."""
    _needs_ncu_on_sm90()
    p = prof.profile("gluon_ws", 64, num_tokens=128, context=65536, out_dir=tmp_path)
    assert p.shape == {"H": 64, "D": 512, "T": 128, "context": 65536, "topk": 512}
    ws = [pl for pl in p.lines if pl.file == "hopper_ws.py"]
    assert ws and sum(pl.samples() for pl in ws) > 0
    assert "context=65536" in prof.profile_table(p)
    shutil.rmtree(tmp_path, ignore_errors=True)


# The layouts Nsight Compute writes for `--import R --csv --page source` (2023-2026 releases, as
# parsed by public scripts that read real reports; issue 23: the H200's report parsed to no
# line with the one-layout parser). cuda,sass: context rows, a header whose "Source" comes
# twice, a source line's row (its counters: the sum of its instructions') then its
# instructions' rows; a units row under the header.
CUDA_SASS_CSV = """==PROF== Connected to process 77
"File Path","/work/sparse_mla/gluon/hopper_ws.py"
"Function Name","_prefill_ws_kernel"
"Line No","Source","Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","Instructions Executed","smsp__pcsamp_warps_issue_stalled_long_scoreboard","smsp__pcsamp_warps_issue_stalled_barrier_not_issued"
"","","","","sample","sample","inst","sample","sample"
"266","    mbarrier.wait(ready.index(s), phase)","","","1,520","1,400","2,048","1,200","700"
"","","0x7f00a0","      SYNCS.PHASECHK.TRANS64 P0, [UR4], R2","1,500","1,390","1,024","1,190","690"
"","","0x7f00b0","      @!P0 BRA 0x7f00a0","20","10","1,024","10","10"
"267","    s = warpgroup_mma(q_smem, k.permute((1, 0)), s)","","","310","120","4096","0","0"
"","","...","...","-","-","-","-","-"
"300","    # no samples","","","0","0","0","0","0"
"File Path","/work/sparse_mla/gluon/hopper.py"
"Function Name","_prefill_ws_kernel"
"Line No","Source","Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","Instructions Executed","smsp__pcsamp_warps_issue_stalled_long_scoreboard","smsp__pcsamp_warps_issue_stalled_barrier_not_issued"
"40","    return x","","","","","","",""
"","","0x7f0100","      FFMA R1, R2, R3, R4","5","1","64","0","0"
"","","0x7f0110","      FMUL R1, R1, R5","2","1","64","2","0"
"""  # noqa: E501

SASS_CSV = """"Kernel Name","_prefill_ws_kernel"
"# Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","stall_long_sb","stall_barrier"
"0x7f00a0","      SYNCS.PHASECHK.TRANS64 P0, [UR4], R2","1,500","1,390","1,190","0"
"0x7f00b0","      @!P0 BRA 0x7f00a0","20","10","0","20"
"0x7f00c0","      EXIT","0","0","0","0"
"""  # noqa: E501

RAW_UNITS_CSV = """==WARNING== some note
"ID","Process ID","Kernel Name","smsp__pcsamp_warps_issue_stalled_long_scoreboard.sum","smsp__pcsamp_warps_issue_stalled_wait","smsp__pcsamp_warps_issue_stalled_wait_not_issued","dram__bytes.sum"
"","","","sample","sample","sample","byte"
"0","4242","_prefill_ws_kernel","1,234","56","50","n/a"
"""  # noqa: E501


def test_source_csv_of_the_cuda_sass_view():
    lines = prof.parse_source_csv(CUDA_SASS_CSV)
    got = {(pl.file, pl.line): pl for pl in lines}
    assert sorted(got) == [("hopper.py", 40), ("hopper_ws.py", 266), ("hopper_ws.py", 267)]
    ws = got[("hopper_ws.py", 266)]
    # the line's own row, not the line plus its instructions (1,520, never 3,040)
    assert ws.samples() == 1520.0 and ws.metrics["Instructions Executed"] == 2048.0
    assert "mbarrier.wait" in ws.source  # the source column, not the SASS one
    # a line row without counters: the sum of its instructions' rows
    assert got[("hopper.py", 40)].samples() == 7.0
    assert got[("hopper.py", 40)].metrics["Instructions Executed"] == 128.0
    stalls = prof.stalls_of_lines(lines)
    assert stalls == {"long_scoreboard": 1202.0}  # _not_issued left out
    text = prof.profile_table(
        prof.Profile("gluon_ws", {}, {"H": 64, "D": 512, "T": 1024}, lines, stalls, "r", [])
    )
    assert text.index("hopper_ws.py:266") < text.index("hopper_ws.py:267")


def test_source_csv_of_the_sass_view_and_raw_csv_with_units():
    lines = prof.parse_source_csv(SASS_CSV)
    assert [(pl.file, pl.line, pl.samples()) for pl in lines] == [
        ("(sass)", 0x7F00A0, 1500.0), ("(sass)", 0x7F00B0, 20.0)]  # fmt: skip
    assert lines[0].source.startswith("SYNCS.PHASECHK")
    assert prof.stalls_of_lines(lines) == {"long_sb": 1190.0, "barrier": 20.0}
    assert prof.parse_raw_csv(RAW_UNITS_CSV) == {"long_scoreboard": 1234.0, "wait": 56.0}
    assert prof.parse_raw_csv("") == {} and prof.parse_source_csv("") == []


def test_raw_csv_by_launch():
    """Two launches in one raw page (a units row between header and rows): each keeps its own
    samples under its kernel name, and parse_raw_csv is their sum."""
    raw = RAW_UNITS_CSV + '"1","4242","other_kernel","6","4","9","n/a"\n'
    assert prof.stalls_by_launch(raw) == [
        ("_prefill_ws_kernel", {"long_scoreboard": 1234.0, "wait": 56.0}),
        ("other_kernel", {"long_scoreboard": 6.0, "wait": 4.0}),
    ]
    assert prof.parse_raw_csv(raw) == {"long_scoreboard": 1240.0, "wait": 60.0}
    assert prof.stalls_by_launch("") == []


@pytest.mark.parametrize("cell,want", [("1,520", 1520.0), ('"12.5%"', 12.5), ("1\u00a0234", 1234.0),
                                       ("-", None), ("n/a", None), ("", None), ("0.5", 0.5),
                                       ("1,234,567", 1234567.0), ("abc", None)])  # fmt: skip
def test_number_cells(cell, want):
    assert prof._number(cell) == want


def test_source_csv_of_a_real_h200_report():
    """An excerpt of the `cuda,sass` source page Nsight Compute wrote on the H200 for one
    gluon_ws launch (40 source lines of hopper_ws.py, two of each line's instructions; the
    '...' rows dropped), and that run's raw page, which carried no stall columns: the lines
    parse with their counters, and the stalls come from the source page's per-reason columns."""
    text = (Path(__file__).parent / "data" / "ncu_source_h200_excerpt.csv").read_text()
    lines = prof.parse_source_csv(text)
    assert len(lines) == 40
    assert {pl.file for pl in lines} == {"hopper_ws.py"}
    assert (lines[0].line, lines[0].source) == (195, "pid_h = item % num_hb")
    # Every line has executed instructions but 259, whose source (a PTX string with quotes)
    # ncu wrote into the CSV without doubling its quotes: its cells are shifted, and the
    # parser keeps the line with what it could read rather than failing the page.
    assert sum(pl.metrics.get("Instructions Executed", 0) > 0 for pl in lines) == 39
    samples = sum(pl.metrics.get("Warp Stall Sampling (All Samples)", 0) for pl in lines)
    assert samples == 537
    raw = (
        '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
        '"Block Size","Grid Size","Device","CC"\n"","","","","","","","","","",""\n"0","1580",'
        '"python3.12","127.0.0.1","_prefill_ws_kernel","1","7","(384, 1, 1)","(132, 1, 1)",'
        '"0","9.0"\n'
    )
    assert prof.parse_raw_csv(raw) == {}
    stalls = prof.stalls_of_lines(lines)
    assert max(stalls, key=stalls.get) == "long_sb" and stalls["long_sb"] == 437
