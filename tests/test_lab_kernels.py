"""The explorer's kernel selector, the tuned launch loaded on a change of target / H / kernel,
and the figures' sizes and axes (issue 23: goal 4, defects 2, 4, 6, 7)."""

from __future__ import annotations

import dataclasses

import pytest

from sparse_mla import configs, dispatch, tune
from sparse_mla import inspect as si
from sparse_mla.lab import figures
from sparse_mla.lab.explorer import POOL_FEEDS, ExplorerPanel, kernels_for, uses_triton_controls

# One target each kernel compiles for whose pool the panel can feed (dense, or the FP8 cache
# quantized from it), and a shape its default launch serves.
DENSE = [n for n, k in dispatch.KERNELS.items() if k.kv_format == "dense"]
FED = [n for n, k in dispatch.KERNELS.items() if k.kv_format in POOL_FEEDS]
CASES = [(name, tune.kernel_targets(name)[0], 64 if name in ("gluon_ws", "gluon_wgmma")
          else 16) for name in FED]  # fmt: skip


@pytest.fixture
def panel():
    p = ExplorerPanel("sm90", 16, 512, run_errors=False, start=False)
    yield p
    p.close()


def test_the_selector_offers_the_kernels_that_compile_for_the_target(panel):
    assert list(panel.w_kernel.options) == kernels_for("sm90")
    assert set(kernels_for("sm90")) == {n for n in FED
                                        if "sm90" in tune.kernel_targets(n)}  # fmt: skip
    assert kernels_for("gfx942")[0] == "triton" and "gluon_ws_small" not in kernels_for("gfx942")
    assert "triton_fp8" in kernels_for("gfx942")  # the FP8-cache kernel: every target
    panel.set(kernel="gluon_ws_small")
    panel.wait()
    panel.w_target.value = "gfx942"  # the Gluon sm90 kernels are not offered there
    panel.wait()
    assert panel.w_kernel.value == "triton"
    assert list(panel.w_kernel.options) == kernels_for("gfx942")


@pytest.mark.parametrize("name,target,H", CASES, ids=[c[0] for c in CASES])
def test_selecting_each_kernel_shows_its_knobs_and_the_same_views(panel, name, target, H):
    # on CPU: Gluon kernels say "not run" (no interpreter); the FP8-cache Triton kernel runs
    panel.run_errors = name != "triton"
    panel.set(target=target, H=H)
    panel.w_kernel.value = name  # the widget, as a user picks it
    panel.wait()
    assert panel.phase == "ok", panel.status_text()
    state = panel.state()
    assert state.kernel == name and panel.result.kernel_name
    want, _ = tune.base_launch(name, target, H)
    if uses_triton_controls(name) and want.EVEN_HD is None:  # the checkbox shows what "auto" picks
        import torch

        from sparse_mla.prefill import launch_constexprs

        even = launch_constexprs(H, 512, torch.bfloat16, want, has_sink=True)["EVEN_HD"]
        want = dataclasses.replace(want, EVEN_HD=even)
    assert state.config == want  # the launch the kernel runs there was loaded
    if uses_triton_controls(name):
        assert panel.knob_box.layout.display == "none" and panel.w_block_k.layout.display is None
        if name != "triton":
            assert panel.error is not None and panel.error.report.ok, panel.error_text.value
    else:
        assert panel.w_block_k.layout.display == "none" and panel.knob_box.layout.display is None
        assert set(panel.knob_widgets) == set(tune.knob_types(name))
        if panel.error is None:
            assert "not run" in panel.error_text.value and "GPU" in panel.error_text.value
        else:  # on a GPU of the kernel's arch: checked against fp32
            assert panel.error.report.ok, panel.error.report
    assert "sml-resource-table" in panel.resources.value and name in panel.resources.value
    assert panel.mix_image.value[:4] == b"\x89PNG" and panel.occupancy_image.value[:4] == b"\x89PNG"
    assert "sml-isa" in panel.isa.value and "sml-by-line" in panel.by_line_view.value
    panel.pin()
    assert "a = pinned" in panel.diff_view.value


def test_a_knob_change_recompiles_and_a_refused_one_says_why(panel):
    panel.set(H=64)
    panel.w_kernel.value = "gluon_wgmma"
    panel.wait()
    first = panel.result
    other = 32 if panel.state().config.BLOCK_K == 64 else 64
    panel.knob_widgets["BLOCK_K"].value = other
    panel.wait()
    assert panel.phase == "ok" and panel.result is not first
    assert f"BLOCK_K={other}" in panel.state().label()
    panel.set(BLOCK_K=64, num_stages=4)  # more shared memory than an SM has
    assert panel.phase == "invalid" and "shared memory" in panel.status_text()
    assert panel.result is None and panel.isa.value == ""


def test_target_and_heads_changes_load_the_tuned_entry(panel):
    panel.w_heads.value = 64  # a user's change: the sm90 H64_D512 entry is loaded
    panel.wait()
    entry = configs.lookup_entry("sm90", 64, 512)
    assert entry is not None
    c = panel.state().config
    assert (c.BLOCK_H, c.BLOCK_K, c.num_warps, c.num_stages) == (
        entry.launch.BLOCK_H, entry.launch.BLOCK_K, entry.launch.num_warps,
        entry.launch.num_stages,
    )  # fmt: skip
    assert "tuned entry H64_D512" in panel.launch_origin.value
    panel.w_target.value = "gfx950"
    panel.wait()
    want, origin = tune.base_launch("triton", "gfx950", 64, 512)
    got = panel.state().config
    assert (got.BLOCK_H, got.BLOCK_K, got.num_warps) == (want.BLOCK_H, want.BLOCK_K,
                                                         want.num_warps)  # fmt: skip
    assert origin.split(" (")[0] in panel.launch_origin.value


def test_figures_fit_the_output_width_and_occupancy_stays_under_the_sm_limit(panel):
    panel.set(H=64, BLOCK_H=64, BLOCK_K=64, num_warps=8, maxnreg=0)
    panel.wait()
    assert panel.phase == "ok", panel.status_text()
    res = panel.result
    for img in (panel.mix_image, panel.occupancy_image):
        w, h = figures.png_size(img.value)
        assert 0 < w <= figures.MAX_WIDTH_PX and h > 0
        assert img.width == str(w)  # drawn at its size, never 0x0 before a change
        assert img.layout.max_width == "100%"
    fig = figures.occupancy_figure(res, res)  # a pinned baseline: the legend outside the axes
    top = fig.axes[0].get_ylim()[1]
    assert si._NV_MAX_WARPS <= top <= 1.1 * si._NV_MAX_WARPS
    assert max(figures.occupancy_curve("sm90", 8)[1]) == si._NV_MAX_WARPS
    assert figures.png_size(figures.to_png(fig))[0] <= figures.MAX_WIDTH_PX
    big = figures.Figure(figsize=(14, 3))
    big.add_subplot(1, 1, 1).plot([0, 1])
    assert figures.png_size(figures.to_png(big))[0] <= figures.MAX_WIDTH_PX


def test_the_process_exiting_marks_the_panel_stale(panel):
    """Issue 23, defect 3: Kernel > Restart stops the process behind the widgets; the atexit
    hook marks every live panel stale, so no green "ok" stays over a dead panel."""
    from sparse_mla.lab import explorer

    panel.update(wait=True)
    assert panel.phase == "ok" and panel in explorer._LIVE
    explorer._mark_panels_stale()
    assert panel.phase == "stale" and "kernel stopped" in panel.status_text()
    assert "data-state='stale'" in panel.status.value
    assert "sml-stale" in panel.resources._dom_classes


def test_notebook_05_compiles_every_kernel_the_explorer_offers():
    """Notebook 05's table: every kernel of kernels_for(target), at the launch it runs there;
    a kernel that cannot take the shape is listed with why, not dropped silently."""
    from sparse_mla.lab import gluon as lab

    done, skipped = lab.compile_kernels("gfx950", 16)
    assert set(done) | set(skipped) == set(kernels_for("gfx950")) and not skipped, skipped
    for name, res in done.items():
        assert res.mix["total"] > 0 and res.resources.occupancy > 0, name
        assert res.options["num_warps"] == tune.base_launch(name, "gfx950", 16)[0].num_warps
    table = lab.modes_table(done)
    assert all(len(row) == 1 + len(done) for row in table)
    done, skipped = lab.compile_kernels("gfx950", 16, head_dim=256)  # FP8 and Gluon need 512
    assert list(done) == ["triton"] and "head_dim" in skipped["triton_fp8"]
