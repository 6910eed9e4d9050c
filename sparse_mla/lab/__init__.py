"""The workbook's widgets and figures: what the notebooks in ``notebooks/`` call.

One module per notebook (``softmax`` for 01, ``explorer`` for 02, ``sweep`` for 03, ``captures``
for 04, ``gluon`` for 05, ``roofline``, ``grid`` (the H x T grid run) and ``fp8_bench`` (the
FP8 cache's run) for 06, ``pipeline`` and ``gather`` for 07) plus ``figures`` (shared drawing
and HTML helpers). Figures are drawn on ``matplotlib.figure.Figure`` objects (never pyplot
state), so a panel can draw them from a worker thread; widgets show them as PNG images.
Nothing here reads the environment or prints at import; ``ipywidgets`` is imported only by the
functions that build widgets.
"""

from __future__ import annotations

import os

__all__ = ["small_mode"]


def small_mode() -> bool:
    """True when ``SPARSE_MLA_SMALL`` is set to a true value (the tests run notebooks that way)."""
    return os.environ.get("SPARSE_MLA_SMALL", "").strip().lower() not in ("", "0", "false", "no")
