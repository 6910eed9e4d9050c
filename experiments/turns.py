"""What the split probes (``ws_split_premise.py``, ``ws_split.py``, ``ws_small_split.py``)
share: their calls checked, FlashMLA padded timed in turns beside them (``ws_small_call.py``
takes that too), a line of times and ratios, and the loop over points."""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from sparse_mla import bench, reference, runtime


def add_flashmla(w, dev: torch.device, peers: bench.Peers, q: torch.Tensor, fns: list,
                 names: list, *, refs=None, out: torch.Tensor | None = None) -> None:  # fmt: skip
    """Append FlashMLA padded's checked, timed call of workload ``w`` to ``fns`` / ``names``
    (a line saying why not when it is unavailable); ``refs``: the workload's references if the
    caller has them, ``out``: the buffer its timed calls write (None: one of its own)."""
    try:
        fm = bench._provider("flashmla", w, dev, peers)
        out = torch.empty_like(q) if out is None else out
        _res, timer = bench._check_and_time(fm, w, dev, 256, False, refs=refs, budget_ms=40.0,
                                           defer=True, out=out)  # fmt: skip
        if timer is not None:
            fns.append(timer)
            names.append(fm.name)
    except bench.Unavailable as e:
        print(f"  flashmla: {e}", flush=True)


def add_checked(name: str, run: Callable, args: tuple, attn_sink, fns: list,
                names: list) -> str | None:  # fmt: skip
    """Check ``run(out)`` (into a NaN-poisoned output) against the fp32 reference of ``args``
    (q, kv, kv_indices, kv_indptr, scale) and, if right, append its timed call (into a buffer of
    its own) to ``fns`` / ``names``; the failed check's report otherwise."""
    q = args[0]
    got = run(torch.full_like(q, float("nan")))
    rep = reference.check_against_reference(got, *args, attn_sink=attn_sink)
    if not rep.ok:
        return str(rep)
    scratch = torch.empty_like(q)
    fns.append(lambda: run(scratch))
    names.append(name)
    return None


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
