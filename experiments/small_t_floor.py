"""What a small call's time is made of (issue 22's moonshot at T <= 256): at the grid's short
prompts, in turns, with the bench's timing (L2 flushed before each call, calls queued behind a
GPU sleep, one event pair a call), per point:

- ``empty``: a Triton kernel of as many programs as the default's kernel runs that stores one
  value each: the launch and event floor of any kernel timed this way;
- ``default``: ``config=None`` on the workload;
- ``flashmla``: FlashMLA padded as in the grid (``flashmla_pad64`` below 64 heads);
- ``..._no_slots``: both on the same call with every token's list empty (kv_indptr all zero;
  FlashMLA: topk_length 0, its ids all -1): each kernel's fixed cost (Q, sink, O, the programs'
  start) without the ids' chain and the gather (checked too: a wrong output is named, still
  timed).

The moonshot needs ``default`` <= 0.75 x ``flashmla``: at T = 64 H <= 16 the grid of c682036 has
0.77-0.78 (9.6-9.8 us against 12.4-12.5), at H 20-48 0.89-0.95. This says how much of ours is
the floor, how much the fixed cost and how much the lists. On an H200 with `.peers` on
PYTHONPATH, ~60 s:

    PYTHONPATH=$PWD:$PWD/.peers python experiments/small_t_floor.py --points 64:1 64:16 64:48 256:48

``--kernel gluon_ws`` (any registered kernel) forces ours instead of ``config=None``.
``--flush read`` (twenty-eighth session): after the bench's flush (a 256 MiB buffer zeroed,
which leaves L2 full of dirty lines) read another 256 MiB, so each timed call starts with L2
holding clean lines: whether a kernel's time at small T includes writing those dirty lines back
to make room for its Q and O (FlashMLA asks L2 to evict Q's lines first; ours cannot say so).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import triton
import triton.language as tl

from sparse_mla import bench, op


@triton.jit
def _store_one(out_ptr):
    tl.store(out_ptr + tl.program_id(0), 1.0)


def programs_of(w, device, ours: str = "default") -> tuple[int, str]:
    """The programs of the kernel launch of ``ours`` (``default``: the one config=None picks),
    min(items, SMs) for the persistent kernels (items: tokens x head blocks of 64 heads for
    ``gluon_ws``, 16 or 32 for ``gluon_ws_small``; unsplit), and the kernel's name."""
    kernel = ours
    if ours == "default":
        kernel = bench._entry_choice(bench._dispatch_call(w, device)).kernel
    heads = 64 if kernel != "gluon_ws_small" else (16 if w.q.shape[1] <= 16 else 32)
    items = w.q.shape[0] * triton.cdiv(w.q.shape[1], heads)
    return min(items, torch.cuda.get_device_properties(device).multi_processor_count), kernel


def point(T: int, H: int, dev, peers, ours: str = "default") -> str:
    topk = 1024 if H >= 96 else 512
    w = bench.GridPoint("dsv4_csa", T, H, topk, 0).build(dev, seed=0, sink=True, big_buffer=True)
    refs = bench._References(w, 256)
    fns, names = [], []
    programs, kernel = programs_of(w, dev, ours)
    flag = torch.empty(programs, device=dev)
    fns.append(lambda: _store_one[(programs,)](flag))
    names.append(f"empty ({programs} programs)")
    # Each on the call, then on the same call with every list empty: ours through the entry
    # (kv_indices kept, so the choice and split count, which read nnz, are the same), FlashMLA
    # with topk_length 0 (its index matrix is built from the lists: kv_indices empty there)
    w0 = dataclasses.replace(w, kv_indptr=torch.zeros_like(w.kv_indptr))
    flash_w0 = dataclasses.replace(w0, kv_indices=w.kv_indices[:0])
    for wl, refs_l, suffix in ((w, refs, ""), (w0, bench._References(w0, 256), "_no_slots")):
        for name in (ours, "flashmla"):
            try:
                if name == ours:
                    p = bench._provider(ours, wl, dev, peers)
                else:
                    p = bench._provider(bench.flashmla_heads(H)[1], flash_w0 if suffix else wl,
                                        dev, peers)  # fmt: skip
            except bench.Unavailable as e:
                print(f"  {name}{suffix}: unavailable ({e})")
                continue
            ok, _rel, note = bench._check(p.run, wl, 256, refs_l)
            if not ok and not suffix:
                raise SystemExit(f"{name} at T={T} H={H}: wrong ({note})")
            out = torch.empty_like(w.q)
            fns.append(p.timed or (lambda p=p, out=out: p.run(out)))
            names.append(f"{p.name}{suffix}" + ("" if ok else f" (wrong: {note})"))
    ms = bench.time_interleaved(fns, 300.0, rounds=8)
    cells = ", ".join(f"{n} {t * 1e3:.2f} us" for n, t in zip(names, ms, strict=True))
    return f"T={T} H={H} top-k {topk} ({ours} runs {kernel}): {cells}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", nargs="*", default=["64:1", "64:16", "64:48", "256:48", "64:128"],
                    metavar="T:H")  # fmt: skip
    ap.add_argument("--kernel", default="default",
                    help="ours: config=None (default) or a registered kernel, forced")  # fmt: skip
    ap.add_argument("--flush", choices=("write", "read"), default="write",
                    help="write: the bench's flush; read: then 256 MiB read")  # fmt: skip
    args = ap.parse_args()
    dev = torch.device("cuda")
    if args.flush == "read":
        drv = bench._bench_driver()
        other = torch.ones(64 << 20, dtype=torch.int32, device=dev)
        zeroed = drv.clear_cache

        def clear_then_read(cache, zeroed=zeroed, other=other):
            zeroed(cache)
            other.sum()  # 256 MiB read: L2's lines now clean

        drv.clear_cache = clear_then_read
        print("flush: the bench's, then a 256 MiB read")
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    op.set_plans_enabled(False)
    peers = bench.Peers()
    for p in args.points:
        T, H = map(int, p.split(":"))
        print(point(T, H, dev, peers, args.kernel), flush=True)


if __name__ == "__main__":
    main()
