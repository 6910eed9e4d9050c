"""Notebook 03's export step at its default size on a CPU machine and its heatmaps (issue 23,
defects 1 and 8)."""

from __future__ import annotations

import itertools

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from sparse_mla import configs, tune
from sparse_mla.lab import figures
from sparse_mla.lab.sweep import export_and_reload, heatmaps, scratch_config_root

# Notebook 03's default targets and shapes (SPARSE_MLA_SMALL unset), one config each.
TARGETS = ["gfx950", "gfx942", "sm90"]
SHAPES = [(16, 512), (64, 512)]
GRID = {"BLOCK_H": [16, 64], "BLOCK_K": [16], "num_warps": [4]}


@pytest.fixture(scope="module")
def rows():
    return tune.sweep(GRID, SHAPES, TARGETS, mode="compile", jobs=0, progress=False)


def test_export_step_at_default_size_handles_entries_without_a_time(rows):
    # The shipped gfx942 H16_D512 entry is timed (mode "time") with time_ms null: the cell
    # that says which timed entry a candidate keeps formatted None with :.3f.
    shipped = configs.lookup_entry("gfx942", 16, 512)
    assert shipped is not None and shipped.provenance.get("mode") == "time"
    best = tune.best_per_shape(rows)
    assert {k[0] for k in best} == set(TARGETS)
    before = {k: configs.lookup(*k) for k in best}
    with scratch_config_root() as root:
        lines = export_and_reload(best, root)
    text = "\n".join(lines)
    assert "refused" in text  # compile-only candidates over timed entries
    kept = [ln for ln in lines if "keeps its timed entry" in ln]
    assert kept
    if shipped.provenance.get("time_ms") is None:
        assert any("gfx942 H=16 D=512" in ln and "time not recorded" in ln for ln in kept)
    assert {k: configs.lookup(*k) for k in best} == before


def _overlaps(fig) -> list[tuple[str, str]]:
    FigureCanvasAgg(fig).draw()
    bad = []
    for ax in fig.axes:
        texts = [t for t in ax.texts if t.get_text().strip()]
        boxes = [t.get_window_extent() for t in texts]
        for (i, a), (j, b) in itertools.combinations(enumerate(boxes), 2):
            if a.overlaps(b):
                bad.append((texts[i].get_text(), texts[j].get_text()))
    return bad


@pytest.mark.parametrize("target", ["sm90", "gfx950"])
def test_heatmaps_of_a_compile_only_sweep(rows, target):
    fig = heatmaps(rows, target=target, H=64, D=512)
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titles and not any("time" in t for t in titles), titles  # no empty time panel
    assert "not measured" in fig._suptitle.get_text()
    if target == "sm90":
        assert not any("VGPR" in t or "SIMD" in t for t in titles), titles
        assert any("registers / thread" in t for t in titles)
    else:
        assert any("VGPRs" in t for t in titles) and any("waves/SIMD" in t for t in titles)
    assert not _overlaps(fig)
    assert figures.png_size(figures.to_png(fig))[0] <= figures.MAX_WIDTH_PX


def test_shipped_kernel_reads_the_list_length():
    """The workbook's "which kernel ships" answers as the dispatch at the call's list length:
    the shipped sm90 file splits its small-T choice by slots per token."""
    from sparse_mla import dispatch
    from sparse_mla.lab.sweep import shipped_kernel

    bounds = dispatch.slot_bounds("sm90", 16, 512)
    assert bounds, "the shipped sm90 H16 choice no longer splits by list length"
    for slots in (1, *bounds, 100_000):
        want = dispatch.choose(dispatch.Call("sm90", 16, 512, num_tokens=4, nnz=4 * slots))
        assert shipped_kernel("sm90", 16, num_tokens=4, slots_per_token=slots) == want.kernel
    kinds = {shipped_kernel("sm90", 16, num_tokens=4, slots_per_token=s) for s in (1, 100_000)}
    assert len(kinds) == 2, kinds  # short and whole lists run different kernels there
    assert shipped_kernel("sm90", 16, num_tokens=4) == shipped_kernel(
        "sm90", 16, num_tokens=4, slots_per_token=100_000
    )  # unknown length: the longest lists'
    with pytest.raises(ValueError, match="needs num_tokens"):
        shipped_kernel("sm90", 16, slots_per_token=8)
