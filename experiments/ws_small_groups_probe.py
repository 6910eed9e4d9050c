"""GPU probe for the few-heads kernel's head groups (issue 22): time ``_prefill_ws_small_kernel``
at HEAD_GROUPS = 1 and 2 on DSv4 CSA (and GLM full top-k) at T = 16384, launched as the
launcher does, each call checked against the fp32 reference on a sample of tokens first.

Run on an H200 from the repository root:
    PYTHONPATH=. python3 experiments/ws_small_groups_probe.py --out $OUT/ws_small_groups.log

HEAD_GROUPS=1 at 32 heads is the way this kernel served 17-32 heads before issue 22 (two items
per token, each gathering the token's rows); HEAD_GROUPS=2 gathers them once for 32 heads.
``--module`` runs another module's ``_prefill_ws_small_kernel`` (same signature), e.g. the
two-consumer design of commit 8cabe83:
    git show 8cabe83:sparse_mla/gluon/hopper_ws_small.py > sparse_mla/gluon/_ws_small_8cabe83.py
    ... --module sparse_mla.gluon._ws_small_8cabe83 --cases csa:32:512:2,glm:32:2048:2
Results of this session: data/bench/ws_small_groups_h200.log.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import math

import torch
import triton

from sparse_mla import workloads
from sparse_mla.reference import check_against_reference

LOG2E = 1.4426950408889634
CASES = [  # (kind, H, top-k, HEAD_GROUPS)
    ("csa", 16, 512, 1),
    ("csa", 32, 512, 1),
    ("csa", 32, 512, 2),
    ("csa", 24, 512, 2),
    ("csa", 17, 512, 2),
    ("glm", 16, 2048, 1),
    ("glm", 32, 2048, 2),
]


KERNEL = None  # _prefill_ws_small_kernel of --module


def launch(w, out, groups):
    q, kv, idx, ptr = w.q, w.kv, w.kv_indices, w.kv_indptr
    R, H, _ = q.shape
    sink = w.attn_sink if w.attn_sink is not None else torch.full((H,), -math.inf, device="cuda")
    items = R * triton.cdiv(H, 16 * groups)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    KERNEL[(min(items, sms),)](
        q, kv, idx, ptr, sink, out, q.stride(0), q.stride(1), kv.stride(0), out.stride(0),
        out.stride(1), H, kv.shape[0], idx.numel(), w.softmax_scale * LOG2E, items,
        HEAD_GROUPS=groups, num_warps=4, num_stages=1,
    )  # fmt: skip


def sample_rows(w, step):
    """(q, indices, indptr) of every ``step``-th token."""
    ptr = w.kv_indptr.to(torch.int64)
    toks = torch.arange(0, w.q.shape[0], step, device=ptr.device)
    lens = ptr[toks + 1] - ptr[toks]
    new_ptr = torch.zeros(toks.numel() + 1, dtype=torch.int64, device=ptr.device)
    new_ptr[1:] = lens.cumsum(0)
    pieces = [w.kv_indices[int(ptr[t]) : int(ptr[t + 1])] for t in toks.tolist()]
    return toks, torch.cat(pieces), new_ptr.to(w.kv_indptr.dtype)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--module",
        default="sparse_mla.gluon.hopper_ws_small",
        help="the module whose _prefill_ws_small_kernel runs (a variant's copy)",
    )
    ap.add_argument("--cases", help="comma-separated kind:H:topk:groups (default: CASES)")
    a = ap.parse_args()
    global KERNEL
    KERNEL = importlib.import_module(a.module)._prefill_ws_small_kernel
    cases = CASES
    if a.cases:
        cases = [(k, int(h), int(t), int(g)) for k, h, t, g in
                 (c.split(":") for c in a.cases.split(","))]  # fmt: skip

    def say(msg):
        print(msg, flush=True)
        with open(a.out, "a") as f:
            f.write(msg + "\n")

    say(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} "
        f"{datetime.datetime.now()} kernel {a.module}")  # fmt: skip
    built = {}
    for kind, H, topk, groups in cases:
        key = (kind, H, topk)
        if key not in built:
            built.clear()
            torch.cuda.empty_cache()
            if kind == "glm":
                w = workloads.glm_full_topk(a.tokens, H, topk=topk, device="cuda",
                                            big_buffer=True, seed=1, sink=True)  # fmt: skip
            else:
                w = workloads.dsv4_csa(a.tokens, H, topk=topk, device="cuda", big_buffer=True,
                                       seed=1)  # fmt: skip
            w.kv.normal_()
            built[key] = w
        w = built[key]
        out = torch.full_like(w.q, float("nan"))
        launch(w, out, groups)
        torch.cuda.synchronize()
        toks, idx, ptr = sample_rows(w, max(1, a.tokens // 256))
        rep = check_against_reference(out[toks].contiguous(), w.q[toks].contiguous(), w.kv, idx,
                                      ptr, w.softmax_scale, attn_sink=w.attn_sink)  # fmt: skip
        times = [
            triton.testing.do_bench(
                lambda w=w, o=out, g=groups: launch(w, o, g), return_mode="median"
            )
            for _ in range(a.rounds)
        ]
        ms = sorted(times)[len(times) // 2]
        gathered = w.valid_slots * 1024 * triton.cdiv(H, 16 * groups)  # bytes of KV rows read
        say(f"{kind} H{H} topk{topk} HEAD_GROUPS={groups}: {ms:.3f} ms (rounds "
            f"{', '.join(f'{t:.3f}' for t in times)}), {gathered / ms / 1e9:.2f} TB/s gathered, "
            f"check {rep}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
