"""The split kernels' reduce fused into their launch, against the reduce as a second launch.

``gluon_mma`` and ``gluon_wgmma`` can combine their KV splits' partials in the same launch on
sm90 (the last split of a (row, head block) to arrive reduces them: ``algorithm._epilogue``'s
``FUSED_REDUCE``); gfx950 keeps ``_mla_reduce_kernel`` as a second launch. Which calls fuse is
``launch.fused_reduce``'s rule, set from this experiment's first run (every split call fused:
faster with 16-head blocks, slower with 64-head ones): head blocks of at most 16.

Prediction before the first run (GPU time): -1..-4 us a call where the call splits (T <= 64:
the second launch's gap and its own ramp; the combine itself the same work, now overlapped
with other programs' tiles), no change where it does not. Host time: one launch fewer (-4..-10
us a call on the H200's host, ``scripts/host_cost.py``). Measured: docs/PERF_NOTES.md.

Here, at small T of DSv4 CSA top-k 512 + window 128 (top-k 1024 at H128) after 16384 cached
tokens (full lists: the calls that split): both forms of the same kernel, chosen per
call by ``launch.fused_reduce`` (forced fused / not around each call through ``mla_gluon``,
whatever the rule says),
each call's counters lent from one kept zero buffer as a plan's replay lends its kept set (no
memset a call), checked against the fp32 reference, compared bit for bit, and timed in turns
(``bench.time_interleaved``, balanced orders, 8 rounds).

    python experiments/fused_reduce.py [T x H x kernel ...]     # an H200; ~1-2 min

Since the combiner programs (``algorithm._combiner``: 32- and 64-head blocks fuse too, one
program a 16-head part after waiting for the splits' arrivals), ``gluon_mma`` runs its own
head blocks here (the launch given as a copy, which ``run_validated`` does not trade for
16-head blocks). Prediction for the combiners against two launches (before their first run):
-0.5..-2 us of GPU time a split call (the second launch's gap gone, the combine spread as the
reduce kernel spreads it; +0.3-0.5 us for each program's ticket), i.e. the losses of the
last-arrival form at 32/64-head blocks (+2..+35 us) gone.

``--split-config``: instead, ``gluon_mma``'s default launch (32/64-head blocks above 16 heads:
splits, fused by combiners since they exist; a second launch before) against ``config=None``,
which for prefill calls that split takes 16-head blocks (``launch.SPLIT_CONFIG``: 4x the
programs, fewer splits, the reduce fused), at H 32/64/128 and the same T. Prediction, before
running it: 16-head blocks faster at T = 4/16 (the T=4 H16 call, 10 splits over 4 programs,
took 19.3 us fused; the 64-head form of T=4 H64 33.9 us two launches), about even or slower at
T = 64 (four times the row gathers, no split).
"""

from __future__ import annotations

import sys
from dataclasses import replace

import torch

from sparse_mla import bench, fastlaunch, workloads
from sparse_mla.gluon import choose_num_splits, launch, mla_gluon

POINTS = [
    (T, H, k)
    for k, heads in (("gluon_mma", (16, 32, 64, 128)), ("gluon_wgmma", (64, 128)))
    for H in heads
    for T in (4, 16, 64)
]
CONTEXT = 16384
_REAL_RULE = launch.fused_reduce
_KEPT: list = []


def _kept_zeros(n, dtype, device):
    if not _KEPT or _KEPT[0].numel() < n:
        _KEPT[:] = [torch.zeros(max(n, 1 << 16), dtype=dtype, device=device)]
    return _KEPT[0][:n]


def point(T: int, H: int, kernel: str, dev: torch.device) -> str:
    # A chunk late in a long prompt (16384 tokens cached before it): full lists, so T <= 64
    # splits them (at the bench grid's T = 64 the prompt is the chunk: lists of <= 64 + 16).
    w = workloads.dsv4_csa(T, H, topk=bench._grid_topk(H), context=CONTEXT, device=dev, seed=0,
                           big_buffer=True)  # fmt: skip
    q, kv, idx, indptr, scale = w.args()
    kv = kv[:, 0, :] if kv.dim() == 3 else kv
    refs = bench._References(w, 256)
    cfg = launch.resolve_launch(kernel, None, H, launch.get_target("sm90"))
    splits = choose_num_splits(T, H, idx.numel(), cfg, launch._num_compute_units(0))
    # gluon_mma's own launch given as a copy: the default object itself would be traded for
    # 16-head blocks at these T (run_validated); here the kernel's head blocks are the point.
    given = replace(cfg) if kernel == "gluon_mma" else None
    out = torch.empty_like(q)
    fns, outs = [], []
    for fused in (True, False):

        def run(o, fused=fused):
            launch.fused_reduce = lambda s, t, bh, *_, f=fused: f and s > 1 and t.backend == "cuda"
            try:
                return mla_gluon(q, None, kv, None, idx, indptr, scale, has_pe=False,
                                 attn_sink=w.attn_sink, out=o, kernel=kernel,
                                 config=given)  # fmt: skip
            finally:
                launch.fused_reduce = _REAL_RULE

        ok, _rel, note = bench._check(run, w, 256, refs)
        if not ok:
            raise SystemExit(f"T={T} H={H} {kernel} fused={fused}: wrong ({note})")
        outs.append(run(torch.full_like(q, float("nan"))).clone())
        fns.append(lambda run=run: run(out))
    same = torch.equal(outs[0], outs[1])
    ms = bench.time_interleaved(fns, 30.0, rounds=8)
    f, t = (m * 1e3 for m in ms)
    how = f"{launch.combiners(cfg.BLOCK_H)} combiners" if cfg.BLOCK_H > 16 else "last arrival"
    return (f"{kernel:11s} T={T:4d} H={H:3d} ({cfg.BLOCK_H:2d}-head blocks, fused by {how}) "
            f"nnz={idx.numel():6d} splits={splits:2d}: "
            f"fused {f:7.2f} us  two launches {t:7.2f} us  fused-two {f - t:+6.2f} us  "
            f"bit-equal {same}")  # fmt: skip


def split_config_point(T: int, H: int, dev: torch.device) -> str:
    """``gluon_mma`` forced with its default launch (head blocks of 32/64 above 16 heads: splits
    and a second launch) against ``config=None``, which for a prefill call that splits takes
    ``launch.SPLIT_CONFIG`` (16-head blocks, fused reduce)."""
    w = workloads.dsv4_csa(T, H, topk=bench._grid_topk(H), context=CONTEXT, device=dev, seed=0,
                           big_buffer=True)  # fmt: skip
    q, kv, idx, indptr, scale = w.args()
    kv = kv[:, 0, :] if kv.dim() == 3 else kv
    refs = bench._References(w, 256)
    sm90 = launch.get_target("sm90")
    units = launch._num_compute_units(0)
    # a copy: the default object itself is the kernel's own launch, which run_validated trades
    default = replace(launch._default_mma(H, sm90))
    splits = [
        choose_num_splits(T, H, idx.numel(), c, units) for c in (default, launch.SPLIT_CONFIG)
    ]
    out = torch.empty_like(q)
    fns = []
    for cfg in (default, None):

        def run(o, cfg=cfg):
            return mla_gluon(q, None, kv, None, idx, indptr, scale, has_pe=False,
                             attn_sink=w.attn_sink, out=o, kernel="gluon_mma",
                             config=cfg)  # fmt: skip

        ok, _rel, note = bench._check(run, w, 256, refs)
        if not ok:
            raise SystemExit(f"T={T} H={H} config={cfg}: wrong ({note})")
        fns.append(lambda run=run: run(out))
    ms = bench.time_interleaved(fns, 30.0, rounds=8)
    a, b = (m * 1e3 for m in ms)
    groups = T * -(-H // default.BLOCK_H)
    fused = launch.fused_reduce(splits[0], sm90, default.BLOCK_H, groups, units)
    two = "one launch" if fused else "two launches"
    return (f"gluon_mma T={T:4d} H={H:3d}: {default.BLOCK_H}-head blocks ({splits[0]} splits, "
            f"{two}) {a:7.2f} us  16-head blocks ({splits[1]} splits, one launch) "
            f"{b:7.2f} us  16/default {b / a:.3f}")  # fmt: skip


def main() -> None:
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    fastlaunch.zeroed = _kept_zeros
    argv = sys.argv[1:]
    if "--split-config" in argv:  # only the second table
        only = [tuple(map(int, a.split("x"))) for a in argv if a != "--split-config"]
        for T, H in only or [(T, H) for H in (32, 64, 128) for T in (4, 16, 64)]:
            print(split_config_point(T, H, dev), flush=True)
        argv = []
        pts = []
    else:
        pts = POINTS
    if argv:
        pts = [(int(a), int(b), c) for a, b, c in (x.split("x") for x in argv)]
    for T, H, k in pts:
        print(point(T, H, k, dev), flush=True)
    torch.cuda.synchronize()
    assert not _KEPT or int(_KEPT[0].abs().sum()) == 0, "a counter was left non-zero"
    print("counters zero at rest after every call: yes", flush=True)


if __name__ == "__main__":
    main()
