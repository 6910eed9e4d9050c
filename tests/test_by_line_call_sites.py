"""`isa --by-line` puts inlined helpers on their call sites (issue 23, defect 5).

Triton inlines every ``@triton.jit`` helper; without the inlining chain both matmuls of the
prefill land on ``_mma``'s ``return tl.dot(...)``. Cross-compiles of the Triton kernel for sm90
and gfx950 (the in-memory cache shares them within this module)."""

from __future__ import annotations

import inspect as pyinspect
from dataclasses import replace

import pytest

from sparse_mla import inspect as si
from sparse_mla import prefill
from sparse_mla.prefill import resolve_config


def _line_of(fn_source: str, needle: str, start: int) -> int:
    for i, text in enumerate(fn_source.splitlines()):
        if needle in text:
            return start + i
    raise AssertionError(f"{needle!r} not found")


def _lines():
    """(helper's tl.dot line, QK call site, PV call site) in prefill.py, read from the source."""
    helper, h0 = pyinspect.getsourcelines(prefill._mma.fn)
    kernel, k0 = pyinspect.getsourcelines(prefill._sparse_mla_prefill_kernel.fn)
    dot = _line_of("".join(helper), "return tl.dot(a, b, acc)", h0)
    qk = _line_of("".join(kernel), "qk = _mma(q, tl.trans(kv)", k0)
    pv = _line_of("".join(kernel), "acc = _mma(_round_to(p", k0)
    return dot, qk, pv


def test_call_site_locations_follows_the_chain_to_the_outermost_site():
    llir = "\n".join([
        "!5 = distinct !DISubprogram(name: \"k\")",
        "!10 = !DILocation(line: 37, column: 24, scope: !34, inlinedAt: !11)",
        "!11 = !DILocation(line: 60, column: 9, scope: !34, inlinedAt: !12)",
        "!12 = !DILocation(line: 140, column: 14, scope: !5)",
        "!13 = !DILocation(line: 99, column: 1, scope: !5)",
    ])  # fmt: skip
    out = si.call_site_locations(llir).splitlines()
    assert out[1] == "!10 = !DILocation(line: 140, column: 14, scope: !5)"
    assert out[2] == "!11 = !DILocation(line: 140, column: 14, scope: !5)"
    assert out[3:] == llir.splitlines()[3:]
    assert "inlinedAt" not in "\n".join(out)


@pytest.mark.parametrize("target", ["sm90", "gfx950"])
def test_matmuls_land_on_their_call_sites(target):
    dot, qk, pv = _lines()
    cfg = resolve_config(64, 512, None, target)
    res = si.compile_prefill(target, cfg, num_heads=64, head_dim=512)
    assert "inlinedAt" not in res.asm["llir"]
    lm = si.by_line(res)
    matrix = {(s.file, s.line): sum(s.mix.get(k, 0) for k in ("mfma", "mma", "wgmma"))
              for s in lm.lines}  # fmt: skip
    total = sum(res.mix.get(k, 0) for k in ("mfma", "mma", "wgmma"))
    assert total > 0
    assert matrix.get(("prefill.py", dot), 0) == 0, matrix
    assert matrix.get(("prefill.py", qk), 0) > 0 and matrix.get(("prefill.py", pv), 0) > 0, matrix
    on_sites = matrix[("prefill.py", qk)] + matrix[("prefill.py", pv)]
    # ptxas' line table puts a few HGMMAs of a scheduled loop on a neighbouring line; the
    # AMDGCN .loc directives are exact.
    assert on_sites >= (0.9 * total if target == "sm90" else total), matrix
    assert lm.totals() == res.mix  # every instruction is on exactly one line


def test_no_line_stays_small_on_gfx950_with_and_without_even_hd():
    base = resolve_config(64, 512, None, "gfx950")
    results = [si.compile_prefill("gfx950", replace(base, EVEN_HD=e), num_heads=64,
                                  head_dim=512) for e in (False, True)]  # fmt: skip
    for res in results:
        none = sum(s.mix["total"] for s in si.by_line(res).lines if s.line == 0)
        assert none <= 0.1 * res.mix["total"], (none, res.mix["total"])
    rows = si.diff_by_line(*results)
    no_line = [r for r in rows if r[0] == "(no line)"]
    assert not no_line or abs(int(no_line[0][3])) <= 0.05 * results[0].mix["total"], rows
