"""Benchmark module: work model, floor, torch provider, gather-sum kernel, CSV rows, CLI."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch
from conftest import make_case

from sparse_mla import bench, cli, runtime
from sparse_mla.reference import check_against_reference

MiB, GiB = 1 << 20, 1 << 30


def test_work_model_hand_computed():
    # 10 valid slots, 16 heads, D 512: 2 FLOPs x (QK + PV) x 10 x 16 x 512; rows of 1 KiB once.
    flops, nbytes = bench.work_model(10, 16, 512)
    assert flops == 4 * 10 * 16 * 512 == 327_680
    assert nbytes == 10 * 512 * 2 == 10_240
    assert bench.work_model(3, 8, 64, elem_size=4) == (4 * 3 * 8 * 64, 3 * 64 * 4)
    with pytest.raises(ValueError, match="nnz"):
        bench.work_model(-1, 16, 512)


def test_floor_from_given_ceilings():
    rates = {4 * MiB: 9e12, 64 * MiB: 6e12, GiB: 4e12}
    ceil = bench.Ceilings(matmul_flops=500e12, copy_bytes=4e12, gather_bytes=rates)
    # Smallest measured pool at least as large as the workload's; past the largest, the largest.
    assert ceil.gather_rate(4 * MiB) == 9e12
    assert ceil.gather_rate(4 * MiB + 1) == 6e12
    assert ceil.gather_rate(100 * MiB) == 4e12
    assert ceil.gather_rate(3 * GiB) == 4e12
    # Gather-bound: 12e9 bytes from a 20 MiB pool (64 MiB rate, 6 TB/s) = 2 ms > 0.5e12 FLOP at
    # 500 TFLOP/s = 1 ms.
    assert bench.floor_ms(0.5e12, 12e9, 20 * MiB, ceil) == pytest.approx(2.0)
    # Compute-bound: 5e12 FLOP at 500 TFLOP/s = 10 ms over 12e9 bytes from HBM (3 ms).
    assert bench.floor_ms(5e12, 12e9, 2 * GiB, ceil) == pytest.approx(10.0)
    with pytest.raises(ValueError, match="gather"):
        bench.Ceilings(1.0, 1.0).gather_rate(1)


@pytest.mark.parametrize(
    "dtype, index_dtype, sink, chunk, seed",
    [
        (torch.bfloat16, torch.int32, True, None, 1),
        (torch.float16, torch.int64, False, 3, 2),
        (torch.bfloat16, torch.int64, True, 5, 3),
    ],
)
def test_torch_provider_matches_reference(dtype, index_dtype, sink, chunk, seed):
    c = make_case(13, 4, 64, N=50, max_slots=40, dtype=dtype, index_dtype=index_dtype, sink=sink,
                  seed=seed)  # fmt: skip
    out = torch.full_like(c.q, float("nan"))
    got = bench.torch_gather_prefill(*c.args(), attn_sink=c.attn_sink, out=out, chunk_tokens=chunk)
    assert got is out
    assert not torch.isnan(out).any()
    rep = check_against_reference(out, *c.args(), attn_sink=c.attn_sink)
    assert rep.ok, rep
    empty = (c.kv_indptr[1:] == c.kv_indptr[:-1]).nonzero().flatten()
    assert empty.numel() and (out[empty] == 0).all()


def test_torch_provider_max_slots_matches_measured():
    c = make_case(9, 2, 32, N=30, max_slots=20, seed=7)
    a = bench.torch_gather_prefill(*c.args(), attn_sink=c.attn_sink)
    width = int((c.kv_indptr[1:] - c.kv_indptr[:-1]).max())
    b = bench.torch_gather_prefill(*c.args(), attn_sink=c.attn_sink, max_slots=width + 7)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_gather_sum_interpreter_sums_the_right_rows():
    g = torch.Generator().manual_seed(3)
    pool = torch.randn(37, 64, generator=g).to(torch.bfloat16)
    R, P = 8, 5
    slots = torch.randint(0, 37, (P * R,), generator=g, dtype=torch.int32)
    out = torch.full((P, 64), float("nan"))
    got = bench.gather_sum(pool, slots, rows_per_program=R, block=4, out=out)
    expect = pool.float()[slots.long()].view(P, R, 64).sum(1)
    assert got is out
    torch.testing.assert_close(out, expect, rtol=1e-6, atol=1e-5)
    # Off-by-one rows would be caught: the sum of the next rows differs.
    wrong = pool.float()[(slots.long() + 1) % 37].view(P, R, 64).sum(1)
    assert not torch.allclose(out, wrong, atol=1e-2)
    with pytest.raises(ValueError, match="multiple"):
        bench.gather_sum(pool, slots[:-1], rows_per_program=R, block=4)


def _row(**kw):
    base = {c: None for c in bench.CSV_COLUMNS}
    base.update(kw)
    return base


def test_csv_writer_columns_and_append(tmp_path):
    path = tmp_path / "sub" / "dev.csv"
    r1 = _row(workload="csa_h16_topk512", provider="triton", config={"BLOCK_H": 16}, ok=True,
              ms=1.5, rel_l2=float("nan"), T=16)  # fmt: skip
    r2 = _row(provider="ceiling:copy", ok=True, gather_tbs=4.2)
    bench.append_rows(path, [r1])
    bench.append_rows(path, [r2, r1])
    with path.open(newline="") as f:
        lines = list(csv.reader(f))
    assert tuple(lines[0]) == bench.CSV_COLUMNS
    assert len(lines) == 4 and lines[2] != lines[0]  # one header, three rows
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows[0]["provider"] == "triton" and rows[0]["ms"] == "1.5"
    assert json.loads(rows[0]["config"]) == {"BLOCK_H": 16}
    assert rows[0]["rel_l2"] == "" and rows[0]["floor_ms"] == ""
    assert rows[1]["provider"] == "ceiling:copy" and float(rows[1]["gather_tbs"]) == 4.2
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="columns"):
        bench.append_rows(other, [r1])


def test_device_slug():
    assert bench.device_slug("NVIDIA H200") == "nvidia-h200"
    assert bench.device_slug("AMD Instinct MI300X") == "amd-instinct-mi300x"


def test_cli_without_gpu_exits_2(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(runtime, "has_gpu", lambda: False)
    out = tmp_path / "x.csv"
    assert cli.main(["bench", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "needs a GPU" in err and "--cpu" in err
    assert not out.exists()


def test_cli_cpu_end_to_end(capsys, tmp_path):
    out = tmp_path / "cpu.csv"
    rc = cli.main(["bench", "--cpu", "--tokens", "8", "--quick", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "gluon: skipped" in text and "frac_of_floor" in text
    with out.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["provider"] for r in rows] == ["triton", "torch"]
    for r in rows:
        assert r["ok"] == "True" and r["workload"] == "csa_h8_topk512"
        assert (r["T"], r["H"], r["D"]) == ("8", "8", "512")
        assert float(r["ms"]) > 0 and float(r["rel_l2"]) < 1e-2
        # nnz: the valid slots, sum over p < 8 of (p+1)//4 + (p+1).
        assert int(r["nnz"]) == sum((p + 1) // 4 + (p + 1) for p in range(8))
        assert r["floor_ms"] == ""  # ceilings skipped on CPU
    assert json.loads(rows[0]["config"])["BLOCK_H"] >= 16


def test_failing_provider_is_recorded_and_not_timed(monkeypatch):
    real = bench._provider

    def broken(name, w, device):
        call, cfg = real(name, w, device)

        def wrong(out):
            call(out)
            out[-1] *= 2  # one token's output off by 2x
            return out

        return wrong, cfg

    monkeypatch.setattr(bench, "_provider", broken)
    rows = bench.run_bench(["csa_h8_topk512"], tokens=6, providers=["torch"], device="cpu",
                           ceilings=False, log=None)  # fmt: skip
    assert len(rows) == 1
    r = rows[0]
    assert r["ok"] is False and r.get("ms") is None and r["rel_l2"] > 1e-2
    assert "tokens [0, 6)" in r["note"]
    assert not math.isnan(r["rel_l2"])


def test_token_slices():
    assert bench._token_slices(10, 256) == [(0, 10)]
    assert bench._token_slices(16384, 256) == [(0, 128), (16256, 16384)]
    assert bench._token_slices(0, 4) == []


@pytest.mark.gpu
def test_gpu_bench_small(tmp_path):
    rows = bench.run_bench(["csa_h16_topk512"], tokens=512, device="cuda", quick=True,
                           out_path=tmp_path / "g.csv", log=None)  # fmt: skip
    provs = {r["provider"]: r for r in rows}
    assert provs["triton"]["ok"] and provs["torch"]["ok"]
    assert provs["triton"]["frac_of_floor"] > 0
    assert any(p.startswith("ceiling:gather_") for p in provs)
