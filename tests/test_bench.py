"""Benchmark module: work model, floor, torch provider, gather-sum kernel, CSV rows, CLI."""

from __future__ import annotations

import csv
import json
import math
import sys
import textwrap
from dataclasses import replace

import pytest
import torch
from conftest import make_case

from sparse_mla import bench, cli, dispatch, runtime
from sparse_mla.reference import check_against_reference, sparse_mla_prefill_ref

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
    assert "frac_of_floor" in text
    # Every registered kernel but Triton needs a GPU: each is one skip line, no row.
    others = [k for k in dispatch.KERNELS if k != "triton"]
    assert others and all(f"  {k}: skipped" in text for k in others)
    with out.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["provider"] for r in rows] == [
        "triton", "default", "default_dense", "default_dense_len", "default_dense_wide", "torch",
    ]  # fmt: skip
    for r in rows:
        assert r["ok"] == "True" and r["workload"] == "csa_h8_topk512"
        assert (r["T"], r["H"], r["D"]) == ("8", "8", "512")
        assert float(r["ms"]) > 0 and float(r["rel_l2"]) < 1e-2
        # nnz: the valid slots, sum over p < 8 of (p+1)//4 + (p+1).
        assert int(r["nnz"]) == sum((p + 1) // 4 + (p + 1) for p in range(8))
        assert r["floor_ms"] == ""  # ceilings skipped on CPU
    assert json.loads(rows[0]["config"])["BLOCK_H"] >= 16
    # default: what config=None runs, Triton in the interpreter, with its launch.
    assert json.loads(rows[1]["config"]) == {"kernel": "triton", **json.loads(rows[0]["config"])}
    # default_dense: the same on FlashMLA's dense ids (K: the longest list rounded up to 128).
    ids = "dense [T, 128] as they are"
    want = {"kernel": "triton", "ids": ids, **json.loads(rows[0]["config"])}
    assert json.loads(rows[2]["config"]) == want
    # default_dense_len: the same with the rows' lengths (kv_lengths, FlashMLA's topk_length).
    want["ids"] = "dense [T, 128] with lengths as they are"
    assert json.loads(rows[3]["config"]) == want
    # default_dense_wide: the ids at the engine's width (top-k 512 + window 128) with the
    # lengths and their bound (the longest list: 8 // 4 + 8 slots at T = 8).
    want["ids"] = "dense [T, 640] with lengths and max_kv_length 10 as they are"
    assert json.loads(rows[4]["config"]) == want
    assert "flashmla: skipped" in text and "aiter: skipped" in text


def test_failing_provider_is_recorded_and_not_timed(monkeypatch):
    real = bench._provider

    def broken(name, w, device, peers=None):
        p = real(name, w, device, peers)

        def wrong(out):
            p.run(out)
            out[-1] *= 2  # one token's output off by 2x
            return out

        return replace(p, run=wrong)

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
                           providers=[*dispatch.KERNELS, "default", "torch"],
                           out_path=tmp_path / "g.csv", log=None)  # fmt: skip
    provs = {r["provider"]: r for r in rows}
    assert provs["triton"]["ok"] and provs["torch"]["ok"] and provs["default"]["ok"]
    assert provs["default"]["config"]["kernel"] in dispatch.KERNELS
    assert provs["triton"]["frac_of_floor"] > 0
    assert any(p.startswith("ceiling:gather_") for p in provs)


# ---------------------------------------------------------------------------------------------
# Peers: FlashMLA and aiter as providers (fakes with the peers' calls; the real ones on the GPU)
# ---------------------------------------------------------------------------------------------

# A tiny torch FlashMLA with upstream's call and constraints (bf16, H 64/128, [N, 1, D] pool,
# [T, 1, topk] int32 indices with topk a multiple of 128, -1 / >= N absent, topk_length).
FAKE_FLASH_MLA = """
import torch

calls = []


def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
    T, H, D = q.shape
    assert q.dtype == torch.bfloat16 and H in (64, 128) and d_v == D
    assert kv.dim() == 3 and kv.shape[1] == 1 and indices.dtype == torch.int32
    assert indices.shape[:2] == (T, 1) and indices.shape[2] % 128 == 0
    calls.append({"H": H, "topk": indices.shape[2], "topk_length": topk_length is not None})
    idx = indices[:, 0, :].long()
    pool = kv[:, 0, :].float()
    valid = (idx >= 0) & (idx < pool.shape[0])
    if topk_length is not None:
        valid &= torch.arange(idx.shape[1], device=idx.device)[None, :] < topk_length[:, None]
    rows = pool[idx.clamp(0, max(pool.shape[0] - 1, 0))]
    logits = torch.einsum("thd,tkd->thk", q.float(), rows) * sm_scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    if attn_sink is not None:
        sink = attn_sink.float()[None, :, None].expand(T, H, 1)
        logits = torch.cat([logits, sink], dim=-1)
        rows = torch.cat([rows, rows.new_zeros(T, 1, D)], dim=1)
    p = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    out = torch.einsum("thk,tkd->thd", p, rows)
    return out.to(q.dtype), logits.amax(-1), torch.logsumexp(logits, -1)


def get_mla_metadata(*args, **kwargs):
    return {"filled": False}, None


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v,
                           tile_scheduler_metadata, num_splits=None, softmax_scale=None,
                           causal=False, is_fp8_kvcache=False, indices=None, attn_sink=None,
                           extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None,
                           extra_topk_length=None):
    # FlashMLA's sparse FP8 decode (MODEL1) in torch: the cache's rows dequantized, then the
    # same attention as the prefill above over the b x s_q queries, each with its own ids and
    # its batch entry's topk_length
    from sparse_mla import fp8

    b, s_q, H, D = q.shape
    assert is_fp8_kvcache and not causal and H in (64, 128) and head_dim_v == D
    assert block_table is None and cache_seqlens is None and num_splits is None
    assert k_cache.dim() == 4 and k_cache.shape[2:] == (1, 584) and k_cache.stride(1) == 584
    assert indices.shape[:2] == (b, s_q) and indices.dtype == torch.int32
    assert topk_length is None or topk_length.shape == (b,)
    calls.append({"H": H, "decode": True, "meta_filled": tile_scheduler_metadata["filled"],
                  "b_sq": (b, s_q)})
    tile_scheduler_metadata["filled"] = True
    rows = fp8.dequantize(fp8.FP8Cache(k_cache, k_cache.shape[1]))
    lens = None if topk_length is None else topk_length.repeat_interleave(s_q)
    out, _, lse = flash_mla_sparse_fwd(q.reshape(b * s_q, H, D), rows[:, None, :],
                                       indices.reshape(b * s_q, 1, -1), softmax_scale, D,
                                       attn_sink, lens)
    return out.reshape(b, s_q, H, D), lse.reshape(b, s_q, H).transpose(1, 2)
"""


@pytest.fixture
def fake_flash_mla(tmp_path, monkeypatch):
    (tmp_path / "flash_mla").mkdir()
    (tmp_path / "flash_mla" / "__init__.py").write_text(FAKE_FLASH_MLA)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_mla", raising=False)
    yield
    sys.modules.pop("flash_mla", None)


def test_fake_flash_mla_is_a_provider(fake_flash_mla, monkeypatch):
    # FlashMLA needs sm90; the fake runs anywhere, so let the CPU run take it.
    monkeypatch.setattr(bench, "_flashmla_unavailable", lambda device: None)
    rows = bench.run_bench(["csa_h8_topk512", "csa_h64_topk512"], tokens=7, device="cpu",
                           providers=["flashmla"], ceilings=False, log=None)  # fmt: skip
    import flash_mla

    assert [r["provider"] for r in rows] == ["flashmla_pad64", "flashmla"]
    for r in rows:
        assert r["ok"] is True and r["rel_l2"] < 1e-2 and r["ms"] > 0, r
    assert [c["H"] for c in flash_mla.calls[:1]] == [64] and flash_mla.calls[0]["topk_length"]
    assert rows[0]["config"]["heads"] == 64 and rows[0]["config"]["topk"] % 128 == 0


def test_flashmla_heads_pad_to_64_or_128():
    assert bench.flashmla_heads(1) == (64, "flashmla_pad64")
    assert bench.flashmla_heads(63) == (64, "flashmla_pad64")
    assert bench.flashmla_heads(64) == (64, "flashmla")
    assert bench.flashmla_heads(65) == (128, "flashmla_pad128")
    assert bench.flashmla_heads(112) == (128, "flashmla_pad128")
    assert bench.flashmla_heads(128) == (128, "flashmla")
    with pytest.raises(bench.Unavailable, match="at most 128"):
        bench.flashmla_heads(129)
    with pytest.raises(ValueError, match="num_heads"):
        bench.flashmla_heads(0)


def test_fake_flash_mla_pads_65_to_127_heads_to_128(fake_flash_mla, monkeypatch):
    # The fake refuses any H but 64 and 128 (as FlashMLA does): 96 and 112 heads only get rows
    # because they are padded to 128; the check compares the real heads with the reference.
    monkeypatch.setattr(bench, "_flashmla_unavailable", lambda device: None)
    rows = bench.run_grid(heads=[8, 64, 96, 112, 128], tokens=[5], device="cpu", quick=True,
                          providers=["flashmla"], ceilings=False, log=None)  # fmt: skip
    import flash_mla

    assert [r["provider"] for r in rows] == ["flashmla_pad64", "flashmla", "flashmla_pad128",
                                             "flashmla_pad128", "flashmla"]  # fmt: skip
    assert [r["config"]["heads"] for r in rows] == [64, 64, 128, 128, 128]
    assert [r["H"] for r in rows] == [8, 64, 96, 112, 128]
    for r in rows:
        assert r["ok"] is True and r["rel_l2"] < 1e-2 and r["ms"] > 0, r
    assert {c["H"] for c in flash_mla.calls} == {64, 128}


def test_padding_heads_cannot_change_the_real_heads():
    # A head's softmax (sink included) is its own: whatever the padding heads' sink, the first
    # H heads of a padded call are the unpadded call's (FlashMLA reads attn_sink per head row).
    c = make_case(6, 5, 32, N=40, max_slots=20, seed=4)
    qp, sp = bench._pad_heads(c.q, c.attn_sink, 8)
    assert qp.shape == (6, 8, 32) and torch.equal(qp[:, :5], c.q) and not qp[:, 5:].any()
    assert torch.equal(sp[:5], c.attn_sink) and not sp[5:].any()
    ref = sparse_mla_prefill_ref(*c.args(), attn_sink=c.attn_sink)
    for pad_sink in (0.0, 30.0, float("-inf")):
        sink = sp.clone()
        sink[5:] = pad_sink
        got = sparse_mla_prefill_ref(qp, *c.args()[1:], attn_sink=sink)
        torch.testing.assert_close(got[:, :5], ref, rtol=1e-6, atol=1e-6)
    q, s = bench._pad_heads(c.q, None, 5)
    assert q is c.q and s is None


def test_flash_mla_rows_are_checked(fake_flash_mla, monkeypatch):
    # A peer whose numbers are wrong gets a row with ok=False and no time, like the kernels.
    monkeypatch.setattr(bench, "_flashmla_unavailable", lambda device: None)
    import flash_mla

    real = flash_mla.flash_mla_sparse_fwd
    monkeypatch.setattr(flash_mla, "flash_mla_sparse_fwd",
                        lambda *a, **kw: (real(*a, **kw)[0] * 1.5, None, None))  # fmt: skip
    rows = bench.run_bench(["csa_h8_topk512"], tokens=5, device="cpu", providers=["flashmla"],
                           ceilings=False, log=None)  # fmt: skip
    assert len(rows) == 1 and rows[0]["ok"] is False and rows[0].get("ms") is None


def test_missing_peers_give_a_log_line_and_no_row(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "flash_mla", None)  # import flash_mla -> ImportError
    monkeypatch.setattr(bench, "_flashmla_unavailable", lambda device: None)
    monkeypatch.setattr(bench, "_aiter_unavailable", lambda device: None)
    lines = []
    rows = bench.run_bench(["csa_h8_topk512"], tokens=4, device="cpu", ceilings=False,
                           providers=["flashmla", "aiter", "torch"], log=lines.append,
                           aiter_module=str(tmp_path / "no_such_aiter.py"))  # fmt: skip
    assert [r["provider"] for r in rows] == ["torch"]
    skipped = [ln for ln in lines if "skipped" in ln]
    assert len(skipped) == 2
    assert skipped[0].strip().startswith("flashmla: skipped (flash_mla is not importable")
    assert skipped[1].strip().startswith("aiter: skipped") and "no_such_aiter" in skipped[1]


# aiter's kernel as its autotuner wraps it: ``.fn[grid](...)`` with its argument order. The
# fake computes the fp32 reference from the tensors it is given, except at BLOCK_K == 64, where
# it drops the sink (a wrong config the gate must keep out of the ranking).
FAKE_AITER = """
from sparse_mla.reference import sparse_mla_prefill_ref

launches = []


class _Fn:
    def __getitem__(self, grid):
        def launch(q, kv, idx, indptr, sink, out, sqt, sqh, sqd, skn, skd, sot, soh, sod,
                   num_heads, head_dim, num_kv, scale, *, HAS_ATTN_SINK, BLOCK_H, BLOCK_D,
                   BLOCK_K, num_warps, num_stages):
            launches.append((grid, BLOCK_H, BLOCK_K, num_warps, num_stages))
            assert grid == (q.shape[0], -(-num_heads // BLOCK_H)) and BLOCK_D == 512
            assert (num_heads, head_dim, num_kv) == (q.shape[1], q.shape[2], kv.shape[0])
            use_sink = sink if HAS_ATTN_SINK and BLOCK_K != 64 else None
            out.copy_(sparse_mla_prefill_ref(q, kv, idx, indptr, scale, attn_sink=use_sink))

        return launch


class _Autotuner:
    fn = _Fn()


_sparse_attn_prefill_kernel = _Autotuner()
"""


def test_aiter_from_a_module_path_best_of_its_grid(tmp_path, monkeypatch):
    path = tmp_path / "my_aiter_kernels.py"
    path.write_text(textwrap.dedent(FAKE_AITER))
    monkeypatch.setattr(bench, "_aiter_unavailable", lambda device: None)
    rows = bench.run_bench(["csa_h8_topk512"], tokens=6, device="cpu", providers=["aiter"],
                           ceilings=False, log=None, aiter_module=str(path))  # fmt: skip
    assert len(rows) == 1
    r = rows[0]
    grid = bench.aiter_configs(8)
    wrong = [c for c in grid if c["BLOCK_K"] == 64]
    assert r["provider"] == "aiter" and r["ok"] is True and r["ms"] > 0 and r["rel_l2"] < 1e-2
    assert r["config"]["tried"] == len(grid) <= 6 and r["config"]["passed"] == len(grid) - len(
        wrong
    )
    winner = {k: r["config"][k] for k in ("BLOCK_H", "BLOCK_K", "num_warps", "num_stages")}
    assert winner in grid and winner not in wrong


@pytest.mark.parametrize("mode", ["raise", "wrong"])
def test_aiter_when_no_config_works(tmp_path, monkeypatch, mode):
    # Every config raising (none compiles here): a log line, no row. Every config wrong: a
    # row with ok=False and no time.
    body = {"raise": "    raise RuntimeError('out of resources')\n",
            "wrong": "    out.fill_(1.0)\n"}[mode]  # fmt: skip
    path = tmp_path / "bad_aiter.py"
    path.write_text(
        "class _Fn:\n    def __getitem__(self, grid):\n        return _launch\n\n\n"
        "def _launch(q, kv, idx, indptr, sink, out, *args, **kw):\n" + body + "\n\n"
        "class _Autotuner:\n    fn = _Fn()\n\n\n_sparse_attn_prefill_kernel = _Autotuner()\n"
    )
    monkeypatch.setattr(bench, "_aiter_unavailable", lambda device: None)
    lines = []
    rows = bench.run_bench(["csa_h8_topk512"], tokens=4, device="cpu", providers=["aiter"],
                           ceilings=False, log=lines.append, aiter_module=str(path))  # fmt: skip
    n = len(bench.aiter_configs(8))
    assert any(f"{n} of {n} configs out" in ln for ln in lines)
    if mode == "raise":
        assert rows == [] and any("aiter: skipped (no config compiled" in ln for ln in lines)
    else:
        assert len(rows) == 1 and rows[0]["ok"] is False and rows[0].get("ms") is None
        assert rows[0]["config"] == {"tried": n}


def test_aiter_configs_small_and_cover_the_heads():
    for H in (8, 16, 64, 128):
        grid = bench.aiter_configs(H)
        assert 1 <= len(grid) <= 6
        assert all(c["BLOCK_H"] in (32, 64) and c["BLOCK_H"] >= min(H, 64) // 2 for c in grid)
        # shared memory of a KV ring at its largest: within sm90's 227 KiB
        assert all(512 * c["BLOCK_K"] * 2 * c["num_stages"] <= 227 * 1024 for c in grid)


def test_dense_topk_pads_to_128_and_never_wraps_int64_slots():
    idx = torch.tensor([3, -1, 2**32 + 5, 7, 1, 9, 100], dtype=torch.int64)
    indptr = torch.tensor([0, 3, 3, 7], dtype=torch.int64)
    dense, lengths = bench._dense_topk(idx, indptr, num_kv=10, multiple=128)
    assert dense.dtype == torch.int32 and dense.shape == (3, 128)
    assert lengths.tolist() == [3, 0, 4]
    assert dense[0, :3].tolist() == [3, -1, -1]  # 2**32 + 5 must not become slot 5
    assert dense[2, :4].tolist() == [7, 1, 9, -1]  # 100 >= N
    assert (dense[:, 4:] == -1).all() and (dense[1] == -1).all()


@pytest.mark.gpu
def test_gpu_fake_flash_mla_is_a_provider(fake_flash_mla):
    rows = bench.run_bench(["csa_h16_topk512"], tokens=256, device="cuda", quick=True,
                           providers=["flashmla", "default"], ceilings=False, log=None)  # fmt: skip
    provs = {r["provider"]: r for r in rows}
    if "flashmla_pad64" not in provs:  # FlashMLA serves sm90/sm100 only
        assert runtime.arch() not in ("sm90", "sm100")
        return
    assert provs["flashmla_pad64"]["ok"] and provs["flashmla_pad64"]["ms"] > 0
    assert provs["default"]["ok"] and "kernel" in provs["default"]["config"]


def test_csv_of_an_older_layout_gains_the_new_columns(tmp_path):
    path = tmp_path / "old.csv"
    old_cols = bench.CSV_COLUMNS[: bench.CSV_COLUMNS.index("pool_bytes")]
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(old_cols)
        w.writerow([f"v{i}" for i in range(len(old_cols))])
    bench.append_rows(path, [{"workload": "w2", "pool_bytes": 1024}])
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == bench.CSV_COLUMNS
    assert [rows[0][c] for c in old_cols] == [f"v{i}" for i in range(len(old_cols))]
    assert rows[0]["pool_bytes"] == "" and rows[1]["pool_bytes"] == "1024"
    assert rows[0]["host_us"] == "" and rows[1]["host_us"] == ""
    assert rows[1]["workload"] == "w2"


# ---------------------------------------------------------------------------------------------
# FP8 KV cache (issue 25): the FP8 run, its workspace peer and its rows
# ---------------------------------------------------------------------------------------------


def _fp8_cache(num_rows, block_size, seed=0):
    from sparse_mla import fp8

    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(num_rows, 512, generator=g)
    # Per-row magnitudes from 2^-20 to 2^12: e4m3 subnormals, many ue8m0 scales.
    kv = kv * torch.exp2(torch.randint(-20, 13, (num_rows, 1), generator=g).float())
    return fp8.quantize(kv.to(torch.bfloat16), block_size)


@pytest.mark.parametrize("block_size, num_rows, index_dtype", [(64, 200, torch.int32),
                         (5, 23, torch.int64), (2, 9, torch.int32)])  # fmt: skip
def test_fp8_gather_dequantize_equals_dequantize_bitwise(block_size, num_rows, index_dtype):
    from sparse_mla import fp8

    cache = _fp8_cache(num_rows, block_size, seed=block_size)
    n_slots = cache.num_slots
    full = fp8.dequantize(cache)
    g = torch.Generator().manual_seed(1)
    valid = torch.randint(0, n_slots, (40,), generator=g)
    invalid = torch.tensor([-1, n_slots, n_slots + 7, -(2**31)])
    if index_dtype == torch.int64:
        invalid = torch.cat([invalid, torch.tensor([2**40, 2**32 + 1])])  # never wrap to valid
    slots = torch.cat([valid, invalid, valid[:3]]).to(index_dtype)
    out = torch.full((slots.numel(), 512), float("nan"), dtype=torch.bfloat16)
    got = bench.gather_dequantize(cache, slots, out=out)
    assert got is out
    ok = (slots >= 0) & (slots < n_slots)
    want = full[slots.long().clamp(0, n_slots - 1)]
    assert torch.equal(out[ok].view(torch.int16), want[ok].view(torch.int16))
    assert (out[~ok].view(torch.int16) == 0).all()  # +0.0 rows, no NaN
    # The same bytes as a uint8 [num_blocks, bytes] cache (FP8Cache's other form).
    raw = fp8.FP8Cache(cache.as_bytes().contiguous(), block_size)
    assert torch.equal(bench.gather_dequantize(raw, slots).view(torch.int16), out.view(torch.int16))
    # A NaN scale byte (255) decodes as dequantize decodes it, bit for bit.
    cache.as_bytes()[0, block_size * 576 + 3] = 255
    slot0 = torch.tensor([0], dtype=index_dtype)
    a = bench.gather_dequantize(cache, slot0)
    b = fp8.dequantize(cache)[:1]
    assert torch.isnan(a).any() and torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert bench.gather_dequantize(cache, slots[:0]).shape == (0, 512)
    with pytest.raises(ValueError, match="out must be"):
        bench.gather_dequantize(cache, slots, out=out[:-1])


def test_fp8_points_and_providers():
    pts = bench.fp8_points()
    assert [(p.T, p.H, p.topk) for p in pts] == [
        (16384, 8, 512), (16384, 16, 512), (16384, 32, 512), (16384, 64, 512),
        (16384, 128, 1024), (1024, 16, 512), (256, 16, 512)]  # fmt: skip
    assert all(p.kind == "dsv4_csa" for p in pts)
    names = bench.fp8_provider_names()
    fp8_kernels = [n for n, k in dispatch.KERNELS.items() if k.kv_format == "fp8_model1"]
    assert fp8_kernels and set(names) == {"fp8_default", "fp8_default_dense_len",
                                          *(f"fp8_{k}" for k in fp8_kernels),
                                          "flashmla_fp8ws", "flashmla_fp8decode",
                                          "bf16_default_dequant"}  # fmt: skip
    assert names[0] == "fp8_default" and names[-1] == "fp8_triton_fp8"  # the slow one last
    with pytest.raises(ValueError, match="unknown"):
        bench.run_fp8(providers=["triton"], device="cpu", ceilings=False, log=None)


_FP8_CEILINGS = bench.Ceilings(matmul_flops=500e12, copy_bytes=4e12,
                               gather_bytes={4 * MiB: 8e12, GiB: 4e12})  # fmt: skip


def test_fp8_bench_cpu_rows_fill_the_schema(fake_flash_mla, monkeypatch, tmp_path):
    from sparse_mla import fp8

    # The fake FlashMLA runs anywhere: let the CPU run take peer (a), the workspace one.
    monkeypatch.setattr(bench, "_flashmla_unavailable", lambda device: None)
    path = tmp_path / "fp8.csv"
    said = []
    rows = bench.run_fp8(heads=[8], tokens=[8], device="cpu", quick=True, out_path=path,
                         ceilings=_FP8_CEILINGS, commit="c" * 40, log=said.append)  # fmt: skip
    import flash_mla

    got = bench.read_rows(path)
    assert (
        [r["provider"] for r in got]
        == [r["provider"] for r in rows]
        == [
            "fp8_default",
            "fp8_default_dense_len",
            "flashmla_pad64_fp8ws",
            "flashmla_pad64_fp8decode",
            "bf16_default_dequant",
            "fp8_triton_fp8",
        ]
    )
    log = "\n".join(said)
    assert "fp8_gluon_ws_small_fp8: skipped" in log and "flashmla_fp8decode (peer b)" in log
    nnz = sum((p + 1) // 4 + (p + 1) for p in range(8))
    flops = 4 * nnz * 8 * 512
    floor = max(flops / 500e12, nnz * 584 / 8e12) * 1e3  # the FP8 bytes at the 4 MiB rate
    for r in got:
        # every column filled but host_us (--host only) and note (failures, untimed rows)
        empty = [c for c in bench.CSV_COLUMNS if r.get(c) is None]
        assert empty == ["note", "host_us"], (r["provider"], empty)
        assert r["ok"] is True and r["rel_l2"] < 1e-2 and r["ms"] > 0
        assert (r["T"], r["H"], r["D"], r["topk"], r["nnz"]) == (8, 8, 512, 512, nnz)
        assert r["commit"] == "c" * 40 and r["workload"] == "csa_h8_topk512"
        assert r["floor_ms"] == pytest.approx(floor, rel=1e-5)
        slot = r["config"]["slot_bytes"]
        assert slot == (1024 if r["provider"] in ("flashmla_pad64_fp8ws",
                                                  "bf16_default_dequant") else 584)  # fmt: skip
        assert r["gather_tbs"] == pytest.approx(nnz * slot / (r["ms"] * 1e-3) / 1e12, rel=1e-4)
        assert r["tflops"] == pytest.approx(flops / (r["ms"] * 1e-3) / 1e12, rel=1e-4)
        assert r["frac_of_floor"] == pytest.approx(floor / r["ms"], rel=1e-4)
    by = {r["provider"]: r for r in got}
    assert by["fp8_default"]["config"]["kernel"] == "triton_fp8"  # the interpreter's choice
    lens = by["fp8_default_dense_len"]["config"]
    assert lens["kernel"] == "triton_fp8" and lens["ids"] == "dense [T, 128] with lengths as CSR"
    assert by["bf16_default_dequant"]["config"]["kernel"] == "triton"
    ws = by["flashmla_pad64_fp8ws"]["config"]
    assert ws["heads"] == 64 and ws["topk"] == 128 and ws["workspace_rows"] == 10
    assert flash_mla.calls and {c["H"] for c in flash_mla.calls} == {64}
    dec = by["flashmla_pad64_fp8decode"]["config"]
    assert dec["heads"] == 64 and dec["topk"] == 128 and dec["slot_bytes"] == 584
    assert not dec["topk_length"] and dec["queries"].startswith("all tokens one batch entry")
    # vLLM's mixed batch: all T tokens one batch entry
    assert {c["b_sq"] for c in flash_mla.calls if c.get("decode")} == {(1, 8)}
    # peer (b): FlashMLA's scheduling metadata filled by the first call, reused by the rest
    decode = [c for c in flash_mla.calls if c.get("decode")]
    assert len(decode) >= 2 and not decode[0]["meta_filled"]
    assert all(c["meta_filled"] for c in decode[1:])
    # the cache's bytes: the 192 pool rows at T=8 in 3 blocks of 64 slots, padded to 576 bytes
    assert {r["pool_bytes"] for r in got} == {3 * fp8.block_bytes(64)} == {3 * 37440}


def test_fp8_bench_catches_a_workspace_row_left_unwritten(fake_flash_mla, monkeypatch):
    # The workspace is NaN-poisoned before the check: a gather that misses a row shows.
    monkeypatch.setattr(bench, "_flashmla_unavailable", lambda device: None)
    real = bench.gather_dequantize

    def short(cache, slots, *, out=None):
        real(cache, slots[:-1], out=out[:-1])
        return out

    monkeypatch.setattr(bench, "gather_dequantize", short)
    rows = bench.run_fp8(heads=[8], tokens=[8], device="cpu", quick=True, ceilings=False,
                         providers=["flashmla_fp8ws"], log=None)  # fmt: skip
    assert len(rows) == 1 and rows[0]["ok"] is False and rows[0].get("ms") is None
    assert "NaN" in rows[0]["note"]


def test_fp8_bench_slow_provider_is_checked_not_timed(monkeypatch):
    # One-call estimates fixed (in the interpreter the two providers' real ones are close and
    # noisy): the second is 100x the first, past a 10x rule.
    estimates = iter([1.0, 100.0])
    monkeypatch.setattr(bench, "_one_call_ms", lambda fn, device: next(estimates))
    said = []
    rows = bench.run_fp8(heads=[8], tokens=[8], device="cpu", quick=True, ceilings=False,
                         providers=["bf16_default_dequant", "fp8_triton_fp8"], slow_factor=10.0,
                         log=said.append)  # fmt: skip
    first, slow = rows
    assert first["ok"] and first["ms"] > 0
    assert slow["ok"] and slow["rel_l2"] < 1e-2 and slow.get("ms") is None
    assert slow.get("gather_tbs") is None and "not timed" in slow["note"]
    assert any("fp8_triton_fp8 at csa_h8_topk512 T=8: not timed" in s for s in said)


def test_fp8_cli_cpu_and_its_usage_errors(capsys, tmp_path):
    out = tmp_path / "fp8.csv"
    rc = cli.main(["bench", "--fp8", "--cpu", "--quick", "--providers", "fp8_default",
                   "--out", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0, text
    rows = bench.read_rows(out)
    assert [(r["provider"], r["T"], r["H"], r["ok"]) for r in rows] == [
        ("fp8_default", 16, 8, True)
    ]
    assert rows[0]["config"]["kernel"] == "triton_fp8" and rows[0]["config"]["slot_bytes"] == 584
    assert cli.main(["bench", "--fp8", "--grid", "--cpu"]) == 2
    assert "--grid does not go with --fp8" in capsys.readouterr().err
