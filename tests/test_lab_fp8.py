"""The explorer with a kernel of the FP8 KV cache (issue 23): the panel offers every registered
kernel whose pool format it can feed, keyed on ``Kernel.kv_format`` (never a name), quantizes
its random pool for it and checks it against the fp32 reference over the dequantized rows."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sparse_mla import dispatch, fp8
from sparse_mla.lab.explorer import (
    FP8_BLOCK_SIZE,
    POOL_FEEDS,
    ExplorerPanel,
    PanelState,
    error_run,
    kernels_for,
)
from sparse_mla.prefill import PrefillConfig
from sparse_mla.reference import sparse_mla_prefill_ref

FP8_KERNELS = [n for n, k in dispatch.KERNELS.items() if k.kv_format == fp8.KV_FORMAT]


@pytest.fixture
def spy_fp8(monkeypatch):
    """A copy of the Triton FP8-cache kernel under another name, recording what it was given
    (the registry's change is undone after the test)."""
    seen: list = []
    base = dispatch.kernel("triton_fp8")

    def run(q, kv, *args):
        seen.append(kv)
        return base.run(q, kv, *args)

    k = dataclasses.replace(base, name="spy_fp8", run=run)
    monkeypatch.setitem(dispatch.KERNELS, "spy_fp8", k)
    return seen


def test_every_kernel_of_a_fed_format_is_offered_on_its_targets(monkeypatch):
    assert FP8_KERNELS, "no FP8-cache kernel is registered"
    for name in FP8_KERNELS:
        k = dispatch.kernel(name)
        for t in ("sm90", "gfx950", "gfx942"):
            offered = name in kernels_for(t)
            assert offered == (k.compile_args is not None and ("*" in k.targets or t in k.targets))
    # keyed on the format, never the name: an sm90-only FP8 kernel under any name
    other = dataclasses.replace(dispatch.kernel("triton_fp8"), name="zz_fp8", targets=("sm90",))
    monkeypatch.setitem(dispatch.KERNELS, "zz_fp8", other)
    assert "zz_fp8" in kernels_for("sm90") and "zz_fp8" not in kernels_for("gfx950")
    # a format the panel cannot feed is not offered
    monkeypatch.setitem(dispatch.FORMATS, "paged_int4", "a made-up format")
    odd = dataclasses.replace(other, name="zz_int4", kv_format="paged_int4")
    monkeypatch.setitem(dispatch.KERNELS, "zz_int4", odd)
    assert "zz_int4" not in kernels_for("sm90") and "paged_int4" not in POOL_FEEDS


def test_the_fp8_feed_quantizes_the_pool_and_the_reference_reads_it_dequantized():
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(100, 512, generator=g).bfloat16()
    cache, rows = POOL_FEEDS[fp8.KV_FORMAT](kv)
    assert isinstance(cache, fp8.FP8Cache) and cache.block_size == FP8_BLOCK_SIZE
    assert cache.num_slots == 128 and rows.shape == (128, 512)
    assert torch.equal(rows, fp8.dequantize(cache))
    assert not torch.equal(rows[:100], kv)  # the NoPE part is quantized: the rows differ
    assert torch.equal(rows[:100, 448:], kv[:, 448:])  # RoPE is kept in bf16


def test_error_run_of_an_fp8_kernel_checks_against_the_dequantized_rows(spy_fp8):
    cfg = PrefillConfig(BLOCK_H=16, BLOCK_K=16)
    state = PanelState("gfx950", 16, 512, cfg, "spy_fp8")
    run = error_run(state, tokens=2, slots=48, seed=3)
    assert len(spy_fp8) == 1 and isinstance(spy_fp8[0], fp8.FP8Cache)
    assert not run.out.isnan().any()
    assert run.report.ok, run.report
    # the reference is the fp32 one over the dequantized cache: recompute it independently
    from sparse_mla.workloads import flashmla_uniform

    w = flashmla_uniform(2, 16, 48, 256, invalid_frac=0.1, D=512, sink=True, seed=3)
    rows = fp8.dequantize(fp8.quantize(w.kv, FP8_BLOCK_SIZE))
    q, _, idx, indptr, scale = w.args()
    want = sparse_mla_prefill_ref(q, rows, idx, indptr, scale, **w.kwargs())
    assert torch.equal(run.ref, want)
    # and it differs from the bf16 pool's reference by more than the kernel's error: the check
    # would fail a kernel that read the unquantized rows
    dense = sparse_mla_prefill_ref(*w.args(), **w.kwargs())
    assert (dense - want).abs().max() > 4 * (run.out.float() - want).abs().max()


def test_an_fp8_kernel_that_leaves_its_output_unwritten_fails_the_check(monkeypatch):
    base = dispatch.kernel("triton_fp8")
    lazy = dataclasses.replace(base, name="lazy_fp8", run=lambda q, kv, *a: None)
    monkeypatch.setitem(dispatch.KERNELS, "lazy_fp8", lazy)
    panel = ExplorerPanel("sm90", 16, 512, start=False, kernel="lazy_fp8")
    try:
        panel.update(wait=True)
        assert panel.error is not None and not panel.error.report.ok
        assert panel.error.out.isnan().any()  # the NaN poison shows
        assert "#b00" in panel.error_text.value
    finally:
        panel.close()


@pytest.mark.parametrize("target", ["sm90", "gfx950"])
def test_the_panel_selects_an_fp8_kernel_like_any_other(spy_fp8, target):
    panel = ExplorerPanel(target, 16, 512, start=False)
    try:
        assert "spy_fp8" in panel.w_kernel.options
        panel.w_kernel.value = "spy_fp8"  # as a user picks it
        panel.wait()
        assert panel.phase == "ok", panel.status_text()
        state = panel.state()
        assert state.kernel == "spy_fp8" and isinstance(state.config, PrefillConfig)
        assert state.config.BLOCK_K == 16  # the FP8 kernel's default, not the bf16 kernel's
        assert panel.w_block_k.layout.display is None  # Triton's widgets: a PrefillConfig
        assert panel.result.kernel_name == "_sparse_mla_prefill_fp8_kernel"
        assert "spy_fp8" in panel.resources.value
        isa = panel.isa.value
        assert ("SASS" if target == "sm90" else "AMDGCN") in isa
        assert "sml-by-line" in panel.by_line_view.value
        assert "FP8 KV cache" in panel.default_text.value
        assert panel.error is not None and panel.error.report.ok, panel.error_text.value
        assert spy_fp8 and all(isinstance(c, fp8.FP8Cache) for c in spy_fp8)
        panel.set(D=256)  # the FP8 kernels read 512-wide rows
        assert panel.phase == "invalid" and "head_dim 512" in panel.status_text()
    finally:
        panel.close()
