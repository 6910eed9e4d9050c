"""Widget and figure logic of sparse_mla.lab, driven from Python (no browser)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from sparse_mla import check_against_reference, inspect, sparse_mla_prefill
from sparse_mla.lab import figures
from sparse_mla.lab import softmax as lab
from sparse_mla.lab.explorer import (
    ExplorerPanel,
    PanelState,
    check_state,
    default_kernel_line,
    default_kernel_map,
)
from sparse_mla.prefill import PrefillConfig

# ------------------------------------------------------------------------------------------------
# Notebook 01 helpers
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_exp2", [False, True])
@pytest.mark.parametrize("block_k", [1, 5, 8, 64])
def test_online_softmax_matches_dense(block_k, use_exp2):
    tok = lab.make_token(num_slots=37, pool=50, head_dim=16, num_invalid=6, seed=3)
    dense = lab.dense_attention(tok)
    steps = lab.online_softmax(tok, block_k, use_exp2=use_exp2)
    assert len(steps) == math.ceil(37 / block_k) + 1  # tiles + the sink
    assert steps[-1].tile == -1
    assert steps[-1].err < 1e-12
    assert abs(steps[-1].lse - dense.lse) < 1e-12
    torch.testing.assert_close(steps[-1].out, dense.out, rtol=1e-12, atol=1e-12)
    ms = [s.m_i for s in steps]
    assert ms == sorted(ms), "the running max never decreases"


def test_dense_attention_ignores_invalid_slots_and_sums_to_one():
    tok = lab.make_token(num_slots=20, pool=30, head_dim=8, num_invalid=4, seed=1)
    d = lab.dense_attention(tok)
    assert int((~tok.valid).sum()) == 4
    assert (d.p[~tok.valid] == 0).all()
    assert abs(float(d.p.sum()) + d.p_sink - 1.0) < 1e-12
    no_sink = lab.dense_attention(tok, with_sink=False)
    torch.testing.assert_close(d.out, no_sink.out * (1 - d.p_sink), rtol=1e-12, atol=1e-12)


def test_empty_token_gives_zeros():
    tok = lab.make_token(num_slots=6, pool=10, head_dim=8, num_invalid=6, sink=0.5)
    assert not tok.valid.any()
    assert (lab.dense_attention(tok).out == 0).all()
    assert (lab.online_softmax(tok, 4)[-1].out == 0).all()


def test_exp_vs_exp2_folds_log2e():
    tok = lab.make_token(seed=2)
    r = lab.exp_vs_exp2(tok)
    assert r["qk_scale under USE_EXP2 (scale * log2 e)"] == pytest.approx(tok.scale * lab.LOG2E)
    assert r["max |out_exp - out_exp2|"] < 1e-12


def test_tile_stepper_slider_redraws():
    tok = lab.make_token(num_slots=24, seed=0)
    box = lab.tile_stepper(tok, block_k=8)
    assert box.slider.max == len(box.steps) == 4
    first_png, first_info = box.image.value, box.info.value
    box.slider.value = 3
    assert box.image.value != first_png
    assert box.info.value != first_info and "tile 2" in box.info.value
    box.slider.value = 4
    assert "sink" in box.info.value


def test_invalid_and_empty_batch_through_the_kernel():
    b = lab.invalid_and_empty_batch(num_heads=16, head_dim=64)
    assert b["kv"].isnan().any(), "unreferenced rows must be poisoned"
    out = torch.full_like(b["q"], float("nan"))
    args = (b["q"], b["kv"], b["kv_indices"], b["kv_indptr"], b["softmax_scale"])
    sparse_mla_prefill(*args, attn_sink=b["attn_sink"], out=out)
    assert not out.isnan().any()
    assert (out[2] == 0).all()
    assert check_against_reference(out, *args, attn_sink=b["attn_sink"]).ok


def test_figures_draw():
    tok = lab.make_token(seed=4)
    steps = lab.online_softmax(tok)
    for fig in (lab.dense_figure(tok), lab.sink_figure(tok), lab.online_figure(tok, steps, 2)):
        assert figures.to_png(fig)[:4] == b"\x89PNG"
    out = torch.randn(2, 4, 8)
    assert figures.to_png(figures.error_figure(out + 1e-3, out, out + 2e-3))[:4] == b"\x89PNG"


def test_occupancy_chart_marks_the_right_step():
    from sparse_mla import inspect as si

    # The formula's own steps: 256 unified VGPRs -> 2 waves, 257 -> 1; 168 -> 3.
    xs, ys = figures.occupancy_curve("gfx950")
    step = dict(zip(xs, ys, strict=True))
    assert (step[64], step[65], step[168], step[169], step[256], step[257]) == (8, 7, 3, 2, 2, 1)
    nxs, nys = figures.occupancy_curve("sm90", num_warps=4)
    nstep = dict(zip(nxs, nys, strict=True))
    assert nstep[128] == 16 and nstep[255] == 8  # 65536 / (128 * 32) = 16 warps
    # A known kernel: the mark sits on the curve at its own register count and limit.
    r = si.compile_prefill("gfx950", PrefillConfig(BLOCK_H=16, BLOCK_K=32, num_warps=4,
                                                   num_stages=2, EVEN_HD=False))  # fmt: skip
    pinned = si.compile_prefill("gfx950", PrefillConfig(BLOCK_H=16, BLOCK_K=16, num_warps=4,
                                                        num_stages=2))  # fmt: skip
    fig = figures.occupancy_figure(r, pinned)
    x, y = fig.marks["current"]
    assert x == r.resources.total_vgprs and y == step[x] == r.resources.limits["registers"]
    assert fig.marks["pinned"] == (pinned.resources.total_vgprs, step[pinned.resources.total_vgprs])
    assert figures.to_png(fig)[:4] == b"\x89PNG"


def test_error_figure_draws_the_tolerance_and_a_token_head_heatmap():
    out = torch.randn(3, 4, 8)
    fig = figures.error_figure(out + 1e-3, out, out + 2e-3, title="error of BLOCK_K=32")
    ax_hist, ax_head, ax_heat = fig.axes[:3]
    labels = [ln.get_label() for ln in ax_head.get_lines()]
    assert "tolerance (2x torch)" in labels
    tol = next(ln for ln in ax_head.get_lines() if ln.get_label().startswith("tolerance"))
    base = figures.per_head_rel_l2(out + 2e-3, out)
    assert list(tol.get_ydata()) == pytest.approx((2 * base).tolist())
    assert ax_heat.get_images()[0].get_array().shape == (3, 4)  # token x head
    assert fig.legends and not ax_hist.get_legend() and not ax_head.get_legend()  # off the data
    assert fig._suptitle.get_text() == "error of BLOCK_K=32"


def test_html_helpers_escape():
    t = figures.html_table([("<b>", None)], ["a&b", "c"])
    assert "&lt;b&gt;" in t and "a&amp;b" in t and ">-<" in t
    p = figures.pre_block("x < y")
    assert "x &lt; y" in p and "overflow:auto" in p and "max-height" in p


# ------------------------------------------------------------------------------------------------
# Notebook 02: the explorer panel
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def panel():
    p = ExplorerPanel("gfx950", 16, 512, error_tokens=1, error_slots=32, start=False)
    yield p
    p.close()


def test_check_state_reasons():
    ok = PanelState("gfx950", 16, 512, PrefillConfig(EVEN_HD=True))
    assert check_state(ok) is None
    why = check_state(PanelState("gfx950", 8, 512, PrefillConfig(BLOCK_H=16, EVEN_HD=True)))
    assert "H % BLOCK_H" in why and "H=8" in why
    why = check_state(PanelState("gfx950", 16, 576, PrefillConfig(EVEN_HD=True)))
    assert "576" in why
    assert "kpack" in check_state(PanelState("gfx950", 16, 512, PrefillConfig(kpack=2)))
    assert check_state(PanelState("gfx942", 16, 512, PrefillConfig(kpack=2))) is None
    assert "BLOCK_K" in check_state(PanelState("sm90", 16, 512, PrefillConfig(BLOCK_K=8)))


def test_panel_even_hd_toggle_updates_table_and_plots(panel):
    panel.update(wait=True)
    assert panel.invalid is None and panel.result is not None
    table = panel.resources.value
    assert "sml-resource-table" in table and "arch VGPRs" in table and "occupancy" in table
    assert "next step" in table
    assert panel.result.resources.occupancy >= 1
    assert panel.mix_image.value[:4] == b"\x89PNG"
    assert panel.occupancy_image.value[:4] == b"\x89PNG"
    assert "sml-isa" in panel.isa.value and "v_mfma" in panel.isa.value
    assert panel.error is not None and panel.error.report.ok
    assert panel.error_image.value[:4] == b"\x89PNG"
    assert "no GPU" in panel.time_text.value or "time" in panel.time_text.value
    assert panel.phase == "ok" and "data-state='ok'" in panel.status.value
    assert panel.progress.value == panel.progress.max
    mix_before, isa_before = panel.mix_image.value, panel.isa.value

    panel.w_even.value = False  # the observer starts a recompile
    panel.wait()
    assert panel.result.constexprs["EVEN_HD"] is False
    assert panel.resources.value != table
    assert "EVEN_HD=False" in panel.resources.value
    assert panel.mix_image.value != mix_before and panel.isa.value != isa_before


def test_panel_invalid_combination_says_why(panel):
    panel.update(wait=True)
    # set() changes only what it names (a change of H in the widget loads the shape's launch,
    # EVEN_HD included): EVEN_HD stays ticked and H=8 is not a multiple of BLOCK_H=16.
    panel.set(H=8)
    panel.wait()
    assert panel.result is None
    assert "sml-invalid" in panel.resources.value
    assert "H % BLOCK_H" in panel.resources.value
    assert "Traceback" not in panel.resources.value
    panel.w_even.value = False  # now valid again
    panel.wait()
    assert panel.result is not None and "sml-resource-table" in panel.resources.value
    panel.w_kpack.value = 2
    assert "kpack=2 is a gfx942 option" in panel.resources.value


def test_panel_amd_only_controls_follow_target(panel):
    assert panel.w_kpack.layout.display is None and panel.w_waves.layout.display is None
    assert panel.w_maxnreg.layout.display == "none"
    panel.w_maxnreg.value = 128  # hidden on AMD and ignored there
    panel.wait()
    assert panel.state().config.maxnreg is None
    panel.set(target="sm90")  # set() keeps the other knobs (the widget loads the entry's)
    panel.wait()
    assert panel.w_kpack.layout.display == "none" and panel.w_waves.layout.display == "none"
    assert panel.w_maxnreg.layout.display is None
    assert panel.state().config.kpack is None and panel.state().config.maxnreg == 128
    # Hiding the AMD-only controls hides only them.
    shown = [w for w in panel.controls if w not in (panel.w_kpack, panel.w_waves)]
    assert all(w.layout.display is None for w in shown), [w.description for w in shown]
    assert "registers" in panel.resources.value and "warps/SM" in panel.resources.value
    assert "sml-isa" in panel.isa.value


def test_panel_maxnreg_caps_registers_and_a_refused_cap_says_why(panel, capsys):
    panel.run_errors = False
    panel.set(target="sm90")
    panel.wait()
    free = panel.result.resources.registers
    assert panel.result.options.get("maxnreg") is None and free > 128
    panel.set(maxnreg=128)
    panel.wait()
    assert panel.result.options["maxnreg"] == 128 and panel.result.resources.registers <= 128
    assert "maxnreg=128" in panel.state().label()
    # 64 heads x 512 columns of fp32 accumulator in 4 warps cannot fit under 128 registers:
    # ptxas refuses, and the panel shows ptxas's line, not Triton's PTX dump.
    panel.set(H=64, BLOCK_H=64)
    panel.wait()
    assert panel.result is None and panel.failure.startswith("ptxas (stage cubin) failed: ptxas")
    assert "registers" in panel.resources.value and "compile failed" in panel.status.value
    assert panel.phase == "failed" and "maxnreg=128" in panel.failure
    assert ".entry" not in capsys.readouterr().out


def _shown(panel) -> dict[str, bool]:
    """Which views show something (a hidden image or an empty text shows nothing)."""
    names = ["resources", "mix_image", "isa", "diff_view", "error_text", "error_image"]
    out = {}
    for n in names:
        v = getattr(panel, n)
        out[n] = bool(v.value) and v.layout.display != "none"
    return out


def test_panel_failed_compile_clears_every_view_and_names_the_pass(panel, capfd):
    panel.update(wait=True)
    assert panel.phase == "ok" and panel.error is not None
    # Triton 3.6's AMD pipeliner fails on this setting ("PassManager::run failed").
    panel.set(BLOCK_K=64, num_warps=1, num_stages=4)
    panel.wait()
    assert panel.phase == "failed" and panel.result is None and panel.error is None
    assert "data-state='failed'" in panel.status.value
    assert "TritonAMDGPUPipeline" in panel.failure and "stage ttgir" in panel.failure
    assert "BLOCK_K=64" in panel.failure and "num_stages=4" in panel.failure
    assert "\n" not in panel.failure  # one line
    shown = _shown(panel)
    assert shown.pop("resources")  # the failure itself
    assert not any(v for k, v in shown.items() if k != "diff_view"), shown
    assert "v_mfma" not in panel.isa.value and panel.mix_image.value == b""
    assert "sml-failed" in panel.resources.value and panel.failure_log in panel.resources.value
    log = Path(panel.failure_log).read_text()
    assert "mlir_reproducer" in log and "TritonAMDGPUPipeline" in log
    # The reproducer went to the file, not to the process's output.
    printed = capfd.readouterr()
    assert "mlir_reproducer" not in printed.out + printed.err


def test_panel_invalid_setting_clears_views_and_hides_images(panel):
    panel.update(wait=True)
    panel.set(H=8)  # EVEN_HD with H % BLOCK_H != 0
    assert panel.phase == "invalid" and "data-state='invalid'" in panel.status.value
    assert panel.mix_image.layout.display == "none"  # no broken-image icon
    assert panel.error_image.layout.display == "none"
    assert panel.isa.value == "" and panel.error_text.value == ""
    panel.set(H=16)
    panel.wait()
    assert panel.phase == "ok" and panel.error_image.layout.display is None
    assert panel.mix_image.value[:4] == b"\x89PNG"


def test_panel_cannot_launch_is_its_own_state(panel):
    # 131 KiB of LDS for one workgroup: more than gfx942's 64 KiB per CU.
    panel.set(target="gfx942", BLOCK_K=128)
    panel.wait()
    assert panel.phase == "cannot-launch", panel.status_text()
    assert panel.result.resources.occupancy == 0
    assert "data-state='cannot-launch'" in panel.status.value and "LDS" in panel.status_text()
    assert panel.error is None and "not run" in panel.error_text.value
    assert panel.error_image.layout.display == "none"
    assert "sml-resource-table" in panel.resources.value  # the resources say why


def test_panel_greys_older_views_while_working_and_says_cache_hits(panel):
    import threading

    panel.run_errors = False
    panel.update(wait=True)
    first = panel.result.compile_seconds
    gate = threading.Event()
    panel._executor.submit(gate.wait)  # hold the worker so the next update stays pending
    panel.set(BLOCK_K=16)
    assert panel.phase == "compiling" and "data-state='compiling'" in panel.status.value
    for v in (panel.resources, panel.mix_image, panel.isa):
        assert "sml-stale" in v._dom_classes
    gate.set()
    panel.wait()
    assert panel.phase == "ok"
    assert all("sml-stale" not in v._dom_classes for v in panel.views)
    panel.set(BLOCK_K=32)  # compiled above: the in-memory cache answers
    panel.wait()
    assert panel.result.from_cache and "from the in-memory cache" in panel.status_text()
    assert f"{first:.2f} s" in panel.status_text()
    panel.close()
    assert panel.phase == "stale" and "data-state='stale'" in panel.status.value


def test_panel_isa_search_main_loop_and_by_line_views(panel):
    panel.run_errors = False
    panel.update(wait=True)
    assert (
        "sml-by-line" in panel.by_line_view.value and "main loop body" in panel.by_line_view.value
    )
    assert "_mma(" in panel.by_line_view.value  # the matmuls, on their call sites
    panel.isa_search.value = "v_mfma"
    n = panel.result.mix["mfma"]
    assert f"{n} lines match" in panel.isa.value
    panel.isa_scope.value = "main loop"
    loop = inspect.by_line(panel.result).loop
    assert (
        f"{loop.mix['mfma']} lines match" in panel.isa.value and "main loop body" in panel.isa.value
    )
    panel.isa_search.value = "("  # not a regular expression: said, not raised
    assert "not a regular expression" in panel.isa.value
    panel.isa_search.value = ""
    panel.isa_scope.value = "whole kernel"
    panel.pin()
    panel.set(EVEN_HD=False)
    panel.wait()
    assert "sml-diff-by-line" in panel.diff_view.value and "<details>" in panel.diff_view.value


def test_panel_states_have_their_own_colour_and_words():
    from sparse_mla.lab.explorer import STATES

    need = {"compiling", "ok", "invalid", "failed", "cannot-launch", "stale"}
    assert need <= set(STATES)
    colours = [STATES[k][0] for k in need]
    words = [STATES[k][1] for k in need]
    assert len(set(colours)) == len(need) and len(set(words)) == len(need)


def test_panel_pin_and_diff(panel):
    panel.update(wait=True)
    assert "pin a compile" in panel.diff_view.value
    panel.pin()
    panel.set(BLOCK_K=16)
    panel.wait()
    assert "pinned" in panel.resources.value  # the table gains a pinned column
    assert "a = pinned" in panel.diff_view.value and "sml-diff" in panel.diff_view.value
    assert "BLOCK_K=32" in panel.diff_view.value and "BLOCK_K=16" in panel.diff_view.value
    panel.unpin()
    assert "pin a compile" in panel.diff_view.value


def test_panel_drops_stale_results(panel):
    panel.run_errors = False
    panel.update()
    panel.w_block_k.value = 16
    panel.w_warps.value = 8  # three states queued; only the last may be shown
    panel.wait()
    assert panel.result.constexprs["BLOCK_K"] == 16
    assert panel.result.options["num_warps"] == 8
    assert panel.dropped >= 1
    assert "num_warps=8" in panel.resources.value


def test_panel_set_rejects_unknown(panel):
    with pytest.raises(ValueError, match="unknown control"):
        panel.set(BLOCK_Q=3)


# ------------------------------------------------------------------------------------------------
# Notebooks 03-05 helpers
# ------------------------------------------------------------------------------------------------


def test_slot_pattern_helpers():
    from sparse_mla.lab.captures import neighbour_overlap, slot_heatmap, slots_per_token

    idx = torch.tensor([0, 1, -1, 1, 2, 9, 5])  # N = 5: -1 and 9 are invalid
    ptr = torch.tensor([0, 3, 6, 7, 7])
    valid, invalid = slots_per_token(idx, ptr, 5)
    assert valid.tolist() == [2, 2, 0, 0] and invalid.tolist() == [1, 1, 1, 0]
    heat = slot_heatmap(idx, ptr, 5)
    assert heat.shape == (4, 5) and heat.sum() == 4 and heat[1, 2] == 1
    ov = neighbour_overlap(idx, ptr, 5)
    assert ov.tolist() == pytest.approx([1 / 3, 0.0, 1.0])


def test_slot_pattern_figure_of_a_capture():
    from pathlib import Path

    from sparse_mla.capture import load_capture
    from sparse_mla.lab.captures import slot_pattern_figure

    path = Path(__file__).parent.parent / "data" / "captures" / "glm_h8_topk2048_t64.safetensors"
    png = figures.to_png(slot_pattern_figure(load_capture(path)))
    assert png[:4] == b"\x89PNG"


def test_sweep_heatmaps_and_scratch_root():
    from sparse_mla import configs
    from sparse_mla.lab.sweep import heatmaps, scratch_config_root

    rows = [
        {"target": "gfx950", "H": 16, "D": 512, "BLOCK_H": bh, "BLOCK_K": bk, "status": "ok",
         "time_ms": None, "registers": 100 + bk, "occupancy": 2 if bk == 16 else 1}
        for bh in (16, 32) for bk in (16, 32)
    ]  # fmt: skip
    assert figures.to_png(heatmaps(rows, target="gfx950", H=16, D=512))[:4] == b"\x89PNG"
    # Cells name the config they show on the grid's other axes (here num_warps varies).
    rows4 = [{**r, "num_warps": w, "registers": r["registers"] + (0 if w == 8 else 5)}
             for r in rows for w in (4, 8)]  # fmt: skip
    fig = heatmaps(rows4, target="gfx950", H=16, D=512, metrics=("registers",))
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "116\nw8" in texts and all("\nw8" in t for t in texts), texts
    with pytest.raises(ValueError, match="no rows"):
        heatmaps(rows, target="sm90", H=16, D=512)
    original = configs.roots()
    with scratch_config_root() as root:
        assert configs.roots() == (root,) and root not in original
        path = configs.config_path("gfx950")
        assert str(path).startswith(str(root))
    assert original == configs.roots() and configs.roots()[-1] == configs.CONFIG_ROOT
    assert not root.exists()


def test_gluon_layout_ownership():
    from triton.experimental.gluon import language as gl

    from sparse_mla.lab.gluon import ownership

    mfma = gl.amd.AMDMFMALayout(version=4, instr_shape=[16, 16, 32], transposed=True,
                                warps_per_cta=[1, 4])  # fmt: skip
    own = ownership(mfma, (16, 64))
    assert (own["copies"] == 1).all()
    # The kernel's own tile (BLOCK_K=32) is narrower than 4 warps x 16 columns: the figure of
    # that tile says each element has two holders.
    from sparse_mla.lab.gluon import layout_figure

    assert (ownership(mfma, (16, 32))["copies"] == 2).all()
    fig = layout_figure(mfma, (16, 32), title="S tile")
    assert "held by 2" in fig.axes[0].get_title() and fig.axes[0].get_images()[0].get_array(
        ).shape == (16, 32)  # fmt: skip
    # Transposed MFMA: lane l owns row l % 16 and 4 consecutive columns from 4 * (l // 16).
    assert own["lane"][3, 0] == 3 and own["lane"][3, 4] == 19 and own["lane"][3, 12] == 51
    assert own["warp"][:, :16].eq(0).all() and own["warp"][:, 48:].eq(3).all()
    nv = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 4], instr_shape=[16, 8])
    own = ownership(nv, (16, 64))
    assert (own["copies"] == 1).all()
    assert own["lane"][0, :8].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert own["lane"][8, 0] == 0 and own["reg"][8, 0] != own["reg"][0, 0]


@pytest.mark.gpu
def test_panel_times_and_checks_on_the_local_gpu():
    # The GPU branch of the explorer: compile for this GPU, run the error check there, time it.
    p = ExplorerPanel("local", 16, 512, error_tokens=4, start=False)
    try:
        p.update(wait=True)
        assert p.invalid is None and p.result is not None
        assert p.error is not None and p.error.device == "cuda" and p.error.report.ok
        assert "time on" in p.time_text.value and " ms " in p.time_text.value
    finally:
        p.close()


def test_panel_says_which_kernel_config_none_runs(panel):
    # The committed sm90 configs record the warp-specialised Gluon kernels from the grid bench
    # (data/bench/nvidia-h200_grid.csv); a head count it did not measure follows the rule.
    line = default_kernel_line(PanelState("sm90", 64, 512, PrefillConfig()))
    assert line.startswith("config=None runs, on sm90 H=64 D=512: gluon_ws (recorded H64_D512")
    line = default_kernel_line(PanelState("sm90", 8, 512, PrefillConfig()))
    assert "sm90 H=8 D=512: gluon_ws_small (recorded H8_D512" in line
    line = default_kernel_line(PanelState("sm90", 17, 512, PrefillConfig()))
    assert "sm90 H=17 D=512: gluon_ws_small (rule for sm90 H=17" in line
    panel.update()
    assert "gfx950 H=16 D=512: triton (no tuned entry)" in panel.default_text.value
    assert "by token count and list length" in panel.default_text.value
    panel.wait()


def test_panel_maps_the_choice_over_tokens_and_list_lengths():
    # Every cell is the entry's own choice for that T and list length: the shipped sm90 file
    # splits its small-T choice by slots a token, so the map's columns must differ there
    from sparse_mla import dispatch

    state = PanelState("sm90", 64, 512, PrefillConfig())
    lines = default_kernel_map(state, tokens=(1, 16384), slots=(8, 640)).splitlines()
    assert lines[0].split() == ["T", "\\", "slots/token", "8", "640"]
    cells = {int(r.split()[0]): r.split()[1:] for r in lines[1:]}
    for t, row in cells.items():
        for s, got in zip((8, 640), row, strict=True):
            call = dispatch.Call.of_shape("sm90", 64, 512, num_tokens=t, slots_per_token=s)
            assert got == dispatch.choose(call).kernel, (t, s)
    assert cells[1][0] != cells[1][1]  # short and whole lists run different kernels at T = 1
    assert cells[16384] == ["gluon_ws", "gluon_ws"]
