# ruff: noqa: E501 (the anchors are the kernel file's own lines)
"""Per-phase clock stamps of one ``gluon_ws`` item (each program's first), on the package's
current kernel: PERF_NOTES "No cliffs" step 24's next probe, where the ~0.45 us an item that
ours spends over FlashMLA's with every list empty goes.

``ws_clk_probe.py`` stamps a copy of 19799b9's kernel (``patches/ws_small_call/clk.diff``);
this one inserts the same kind of stamps into ``sparse_mla/gluon/hopper_ws.py`` as it is, by
anchored text edits (it stops if an anchor is gone), loads the copy as a sibling module and runs
it through the public entry in place of the package's kernel (as ``ws_bars_ab.py`` does). Each
stamp is %clock64 (or %globaltimer, to convert cycles to us) written by one partition to
DBG[program, slot] once its operand is ready; medians over programs and 30 L2-flushed runs, in
us after the producer's start. Checked against the fp32 reference first. The stamps add to the
call's time (both times are printed). On an H200, ~60 s, a Triton cache of its own:

    TRITON_CACHE_DIR=/tmp/clk PYTHONPATH=$PWD python experiments/ws_clk_now.py

``--pairs --points ctx65536:128:64`` (twenty-eighth session): a long item's steady state, where
step 21 found ours ~6% slower a tile than FlashMLA with one long item an SM.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile

import torch
from triton.experimental.gluon import language as gl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ws_bars_ab as ab
import ws_clk_probe

from sparse_mla import bench, dispatch, fastlaunch, op
from sparse_mla.gluon import launch
from sparse_mla.prefill import sparse_mla_prefill

NSLOT = 32
NAMES = {  # in the order printed
    24: "K entry", 25: "K barriers set", 0: "P start", 1: "P range back", 5: "P end",
    8: "C0 start", 9: "C0 Q ready", 10: "C0 tile 0L too", 11: "C0 first S done", 12: "C0 PVs done", 13: "C0 sums met (NB_L)",
    14: "C0 stores issued", 22: "C0 stores read", 15: "C0 item end",
    16: "C1 start", 18: "C1 tile 1R landed", 17: "C1 Q (and 1R) ready", 19: "C1 item end",
}  # fmt: skip

STAMP = '''
DBG = gl.constexpr(0)  # set by the probe before the first compile: int64 [programs, 32]


@gluon.jit
def _stamp(slot: gl.constexpr, dep, GT: gl.constexpr = False):
    """Write %clock64 (GT: %globaltimer) to DBG[program, slot] once ``dep`` is available."""
    zero = gl.full([128], 0, gl.int32, layout=LANE)
    d = (zero + dep).to(gl.int32)
    addr = (zero.to(gl.int64) + DBG) + (gl.program_id(0) * 32 + slot) * 8
    if GT:
        gl.inline_asm_elementwise(
            "{ .reg .u64 t; mov.u64 t, %globaltimer; st.global.u64 [$1], t; }\\n mov.b32 $0, $2;",
            "=r,l,r", [addr, d], dtype=gl.int32, is_pure=False, pack=1)
    else:
        gl.inline_asm_elementwise(
            "{ .reg .u64 t; mov.u64 t, %clock64; st.global.u64 [$1], t; }\\n mov.b32 $0, $2;",
            "=r,l,r", [addr, d], dtype=gl.int32, is_pure=False, pack=1)

'''

# (anchor, the text that replaces it); each anchor must occur once in the kernel file
EDITS = [
    ("\n@gluon.jit\ndef _item_range(", STAMP + "\n@gluon.jit\ndef _item_range("),
    # the kernel's entry and its barriers initialised (the default partition's 4 warps, before
    # warp_specialize starts the partitions): how long before the producer's start
    (
        "    q_smem, kv_smem, p0_smem, p1_smem, m0_smem, m1_smem, l_smem, bars, tile_ids = _shared_state(\n"
        "        q_desc.dtype,\n",
        "    _stamp(24, 0)\n"
        "    q_smem, kv_smem, p0_smem, p1_smem, m0_smem, m1_smem, l_smem, bars, tile_ids = _shared_state(\n"
        "        q_desc.dtype,\n",
    ),
    (
        "    # The partitions' arguments written out in each call",
        "    _stamp(25, 0)\n    # The partitions' arguments written out in each call",
    ),
    # producer: start, its first item's range back, end
    (
        "    lsepart_ptr=None, L2_ROWS: gl.constexpr = False,\n):  # fmt: skip\n",
        "    lsepart_ptr=None, L2_ROWS: gl.constexpr = False,\n):  # fmt: skip\n"
        "    _stamp(0, 0)\n    _stamp(6, 0, True)\n",
    ),
    (
        "        num_pairs = (num_tiles + 1) // 2\n        for j in range(num_pairs):\n",
        "        if it == 0:\n            _stamp(1, num_tiles)\n"
        "        num_pairs = (num_tiles + 1) // 2\n        for j in range(num_pairs):\n",
    ),
    (
        "    cp.commit_group()\n    cp.wait_group(0)\n",
        "    cp.commit_group()\n    cp.wait_group(0)\n    _stamp(5, 0)\n",
    ),
    # consumer 0's epilogue: sums met, stores issued, stores read
    (
        "    l_tot = l_i + l_other.load(ROW_S)\n",
        "    l_tot = l_i + l_other.load(ROW_S)\n"
        "    if col0 == 0:\n        _stamp(13, gl.sum(l_tot, 0).to(gl.int32))\n",
    ),
    (  # since step 46 the stores are the lanes' own: issued and the stage read at once
        "            _st_block(c3, stage, base, h0, col0 + 3 * OUT_BLOCK, stride_oh, num_heads)\n",
        "            _st_block(c3, stage, base, h0, col0 + 3 * OUT_BLOCK, stride_oh, num_heads)\n"
        "            if col0 == 0:\n                _stamp(14, 0)\n                _stamp(22, 0)\n",
    ),
    # consumer 0: start, Q ready, PVs done, item end
    (  # the end of consumer 0's docstring
        '    ``stride_oh``; :func:`_epilogue`)."""\n',
        '    ``stride_oh``; :func:`_epilogue`)."""\n    _stamp(8, 0)\n    _stamp(20, 0, True)\n',
    ),
    (
        "        mbarrier.wait(_bar(bars, Q_READY), it & 1)\n        # S of the first pair's tile",
        "        mbarrier.wait(_bar(bars, Q_READY), it & 1)\n        if it == 0:\n"
        "            _stamp(9, 0)\n            if num_pairs > 0:\n"
        "                mbarrier.wait(_bar(bars, READY_0L), 0)\n"
        "                _stamp(10, 0)\n        # S of the first pair's tile",
    ),
    (
        "            s = warpgroup_mma_wait(0, deps=[s])\n        if num_pairs <= 1:\n",
        "            s = warpgroup_mma_wait(0, deps=[s])\n            if it == 0:\n"
        "                _stamp(11, 0)\n        if num_pairs <= 1:\n",
    ),
    (
        "        g0 += num_pairs\n        _epilogue(\n            acc, m_i, l_i, l_smem.index(2 * (it & 1)),",
        "        g0 += num_pairs\n        if it == 0:\n"
        "            _stamp(12, gl.sum(gl.sum(acc, 1), 0).to(gl.int32))\n"
        "        _epilogue(\n            acc, m_i, l_i, l_smem.index(2 * (it & 1)),",
    ),
    (
        "        )  # fmt: skip\n        it += 1  # noqa: SIM113 (Gluon loops have no enumerate)\n"
        "\n\n@gluon.jit\ndef _consumer1(",
        "        )  # fmt: skip\n        if it == 0:\n            _stamp(15, 0)\n"
        "            _stamp(21, 0, True)\n        it += 1  # noqa: SIM113 (Gluon loops have no "
        "enumerate)\n\n\n@gluon.jit\ndef _consumer1(",
    ),
    # consumer 1: start, Q ready, item end
    (  # the end of consumer 1's docstring
        '    start (:func:`_prefetch_call_rows`)."""\n',
        '    start (:func:`_prefetch_call_rows`)."""\n    _stamp(16, 0)\n',
    ),
    (
        "        mbarrier.wait(_bar(bars, Q_READY), it & 1)\n        if num_pairs == 0:\n",
        "        if it == 0:\n            if num_pairs > 0:\n"
        "                mbarrier.wait(_bar(bars, READY_1R), 0)\n"
        "                _stamp(18, 0)\n"
        "        mbarrier.wait(_bar(bars, Q_READY), it & 1)\n        if it == 0:\n"
        "            _stamp(17, 0)\n        if num_pairs == 0:\n",
    ),
    (
        "            HALF, pid_r, pid_h, sink, out, p1_smem.index(0), num_heads,\n"
        "            item % NUM_SPLITS, opart_ptr, lsepart_ptr, NUM_SPLITS, OUT_DIRECT, stride_or,\n"
        "            stride_oh,\n        )  # fmt: skip\n",
        "            HALF, pid_r, pid_h, sink, out, p1_smem.index(0), num_heads,\n"
        "            item % NUM_SPLITS, opart_ptr, lsepart_ptr, NUM_SPLITS, OUT_DIRECT, stride_or,\n"
        "            stride_oh,\n        )  # fmt: skip\n"
        "        if it == 0:\n            _stamp(19, 0)\n",
    ),
]


# ``--pairs``: a long item's steady state, pairs 1-3 of each program's first item: when the
# producer has buffer 0's left half back (and gathers into it), when consumer 0 comes to wait
# for that half (to issue the pair's S) and when the half has landed. Landed minus "wants" is
# the consumer's wait for the gather; landed minus "free" the gather's latency.
PAIR_NAMES = {
    2: "P pair 1 0L free", 26: "C0 pair 1 wants 0L", 27: "C0 pair 1 0L landed",
    3: "P pair 2 0L free", 28: "C0 pair 2 wants 0L", 29: "C0 pair 2 0L landed",
    4: "P pair 3 0L free", 30: "C0 pair 3 wants 0L", 31: "C0 pair 3 0L landed",
}  # fmt: skip
PAIR_EDITS = [
    (
        "            mbarrier.wait(_bar(bars, FREE_0L), ph)\n",
        "            mbarrier.wait(_bar(bars, FREE_0L), ph)\n"
        "            if it == 0:\n"
        "                if j == 1:\n                    _stamp(2, 0)\n"
        "                elif j == 2:\n                    _stamp(3, 0)\n"
        "                elif j == 3:\n                    _stamp(4, 0)\n",
    ),
    (
        "                s = _qk_half(q_tile, buf0, bars, 0, READY_0L, ph ^ 1, s, False)\n",
        "                if it == 0:\n"
        "                    if j == 0:\n                        _stamp(26, 0)\n"
        "                        mbarrier.wait(_bar(bars, READY_0L), ph ^ 1)\n"
        "                        _stamp(27, 0)\n"
        "                    elif j == 1:\n                        _stamp(28, 0)\n"
        "                        mbarrier.wait(_bar(bars, READY_0L), ph ^ 1)\n"
        "                        _stamp(29, 0)\n"
        "                    elif j == 2:\n                        _stamp(30, 0)\n"
        "                        mbarrier.wait(_bar(bars, READY_0L), ph ^ 1)\n"
        "                        _stamp(31, 0)\n"
        "                s = _qk_half(q_tile, buf0, bars, 0, READY_0L, ph ^ 1, s, False)\n",
    ),
]


def stamped_source(src: str, pairs: bool = False) -> str:
    """The kernel file with the stamps in (``pairs``: with :data:`PAIR_EDITS`' too)."""
    for anchor, new in EDITS + (PAIR_EDITS if pairs else []):
        if src.count(anchor) != 1:
            raise SystemExit(f"anchor found {src.count(anchor)} times: {anchor[:70]!r}")
        src = src.replace(anchor, new)
    return src


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", nargs="*", default=["64:64", "64:128"], metavar="[ctx<N>:]T:H",
                    help="ctx<N>: N tokens cached before the call (whole lists), as "
                    "ws_bars_ab.py's points")  # fmt: skip
    ap.add_argument("--pairs", action="store_true",
                    help="also stamp pairs 1-3 of the first item (PAIR_NAMES)")  # fmt: skip
    args = ap.parse_args()
    names = {**NAMES, **PAIR_NAMES} if args.pairs else NAMES
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "sparse_mla", "gluon", "hopper_ws.py")) as f:
        src = stamped_source(f.read(), args.pairs)
    path = os.path.join(tempfile.mkdtemp(), "hopper_ws_clk.py")
    with open(path, "w") as f:
        f.write(src)
    mod = ab.load_before(path)
    dev = torch.device("cuda")
    buf = torch.zeros(132 * NSLOT, dtype=torch.int64, device=dev)
    mod.DBG = gl.constexpr(buf.data_ptr())  # before the first compile
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}, gluon_ws with stamps")
    op.set_plans_enabled(False)
    entry = launch._WS["gluon_ws"]
    variant = (mod._prefill_ws_kernel, entry[1])
    frozen = ab.only_known(variant[0])
    flush = torch.empty(256 << 20, dtype=torch.int8, device=dev)
    for p in args.points:
        kind, T, H, _, context = ab.parse_point(f"{p}:0")  # ws_bars_ab's form, top-k from H
        if kind != "dsv4_csa":
            raise SystemExit(f"points are [ctx<N>:]T:H (dsv4_csa), got {p!r}")
        topk = 1024 if H >= 96 else 512
        w = bench.GridPoint("dsv4_csa", T, H, topk, context).build(dev, seed=0, sink=True,
                                                                   big_buffer=True)  # fmt: skip
        lists = f"whole lists (context {context})" if context else "short prompt"
        for label, wl in (("empty lists", dataclasses.replace(w, kv_indptr=torch.zeros_like(
                w.kv_indptr))), (lists, w)):  # fmt: skip
            q, kv, idx, indptr, scale = wl.args()

            def run(o, stamped, wl=wl, q=q, kv=kv, idx=idx, indptr=indptr, scale=scale):
                if stamped:
                    launch._WS["gluon_ws"], fastlaunch.frozen = variant, frozen
                try:
                    return sparse_mla_prefill(q, kv, idx, indptr, scale, attn_sink=wl.attn_sink,
                                              out=o, config=dispatch.Choice("gluon_ws"))  # fmt: skip
                finally:
                    launch._WS["gluon_ws"], fastlaunch.frozen = entry, ab.FROZEN

            ok, _rel, note = bench._check(
                lambda o: run(o, True), wl, 256, bench._References(wl, 256)
            )
            if not ok:
                raise SystemExit(f"stamped kernel wrong at T={T} H={H} {label}: {note}")
            out = torch.empty_like(q)
            rows = []
            for _ in range(30):
                flush.zero_()
                buf.zero_()
                torch.cuda.synchronize()
                run(out, True)
                torch.cuda.synchronize()
                rows.append(buf.view(132, NSLOT).cpu())
            ms = bench.time_interleaved(
                [lambda o=out: run(o, True), lambda o=out: run(o, False)], 200.0, rounds=4
            )  # fmt: skip
            progs = min(T * ((H + 63) // 64), 132)
            ghz = statistics.median(
                float(d[i, 15] - d[i, 8]) / float(d[i, 21] - d[i, 20])
                for d in rows for i in range(progs) if d[i, 21] > d[i, 20]
            )  # fmt: skip
            starts = [int(rows[-1][i, 6]) for i in range(progs)]
            print(f"T={T} H={H} {label}: {progs} programs; stamped {ms[0] * 1e3:.2f} us, package "
                  f"{ms[1] * 1e3:.2f} us; clock {ghz:.3f} GHz; start skew "
                  f"{(max(starts) - min(starts)) / 1e3:.2f} us", flush=True)  # fmt: skip
            ws_clk_probe.phases(rows, progs, ghz, names)
    op.set_plans_enabled(True)


if __name__ == "__main__":
    main()
