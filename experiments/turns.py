"""What the split probes (``ws_split_premise.py``, ``ws_split.py``) share: FlashMLA padded
timed in turns beside their calls, a line of times and ratios, and the loop over points."""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from sparse_mla import bench, runtime


def add_flashmla(w, dev: torch.device, peers: bench.Peers, q: torch.Tensor, fns: list,
                 names: list) -> None:  # fmt: skip
    """Append FlashMLA padded's checked, timed call of workload ``w`` to ``fns`` / ``names``
    (a line saying why not when it is unavailable)."""
    try:
        fm = bench._provider("flashmla", w, dev, peers)
        _res, timer = bench._check_and_time(fm, w, dev, 256, False, budget_ms=40.0, defer=True,
                                           out=torch.empty_like(q))  # fmt: skip
        if timer is not None:
            fns.append(timer)
            names.append(fm.name)
    except bench.Unavailable as e:
        print(f"  flashmla: {e}", flush=True)


def in_turns(head: str, fns: list, names: list, ratio: Callable[[str], bool]) -> str:
    """Time ``fns`` in turns (8 rounds, 40 ms a call's budget): ``head``, each one's us, and
    those ``ratio`` keeps over FlashMLA's."""
    ms = bench.time_interleaved(fns, 40.0, rounds=8)
    us = dict(zip(names, (m * 1e3 for m in ms), strict=True))
    line = f"{head}: " + "  ".join(f"{n} {v:.2f}" for n, v in us.items()) + " us"
    fl = next((v for n, v in us.items() if n.startswith("flashmla")), None)
    if fl:
        line += "  /flashmla: " + " ".join(
            f"{n} {v / fl:.3f}" for n, v in us.items() if ratio(n) and not n.startswith("flashmla")
        )
    return line


def main(point: Callable, points: list[tuple]) -> None:
    """Print the device line, then ``point(*p, dev, peers)`` for each point (``TxHx...`` on
    the command line in place of ``points``)."""
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton "
          f"{runtime.triton_version()}", flush=True)  # fmt: skip
    peers = bench.Peers()
    pts = points if len(sys.argv) < 2 else [tuple(map(int, a.split("x"))) for a in sys.argv[1:]]
    for p in pts:
        print(point(*p, dev, peers), flush=True)
