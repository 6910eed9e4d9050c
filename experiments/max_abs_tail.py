"""How often a kernel's max abs error passes 2x PyTorch's same-dtype one, over random sinks.

The eighteenth session's GPU suite failed test_gpu_default_prefill_few_heads[int32-sink-700-H1]
once (max_abs 1.166e-2 against 2 x 5.69e-3; rel_l2 2.08e-3 against 3.42e-3) and passed when
rerun: the test's sink came from the unseeded global CUDA generator, so each run drew another.
This draws N sinks per case (seeded) and prints, per kernel, the distribution of
max_abs / baseline max_abs and rel_l2 / baseline rel_l2, and how many draws fail the 2x rule:
a tail the default kernel shares with the others is the rule's, one of its own is a defect.

    PYTHONPATH=$PWD python3 experiments/max_abs_tail.py [--draws 40]
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from test_gluon import _gpu_case

from sparse_mla import dispatch, sparse_mla_prefill
from sparse_mla.reference import error_report, sparse_mla_prefill_ref


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--draws", type=int, default=40)
    p.add_argument("--heads", type=int, nargs="+", default=[1, 8])
    p.add_argument("--kernels", nargs="+", default=["default", "gluon_ws_small", "triton"])
    a = p.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for H in a.heads:
        for dt in (torch.int32, torch.int64):
            c = _gpu_case(300, H, 5000, has_pe=False, index_dtype=dt, seed=H + 700, max_len=700)
            idx, ptr = c["kv_indices"], c["kv_indptr"]
            s, e = int(ptr[7]), int(ptr[8])
            if e - s >= 4:
                idx[s + 1 : e : 2] = idx[s]
            args = (c["q_nope"], c["kv_c"], idx, ptr, 512**-0.5)
            g = torch.Generator(device="cpu").manual_seed(1000 + H)
            stats = {k: [] for k in a.kernels}
            for _ in range(a.draws):
                sink = torch.randn(H, generator=g).cuda()
                ref = sparse_mla_prefill_ref(*args, attn_sink=sink)
                base = sparse_mla_prefill_ref(*args, attn_sink=sink, upcast=False).float()
                for k in a.kernels:
                    cfg = None if k == "default" else dispatch.Choice(k)
                    out = torch.full_like(c["q_nope"], float("nan"))
                    sparse_mla_prefill(*args, attn_sink=sink, out=out, config=cfg)
                    r = error_report(out.float(), ref, base)
                    stats[k].append(
                        (r.max_abs / r.baseline_max_abs, r.rel_l2 / r.baseline_rel_l2, r.ok)
                    )
            for k, v in stats.items():
                ma = sorted(x[0] for x in v)
                rl = sorted(x[1] for x in v)
                fails = sum(not x[2] for x in v)
                print(
                    f"H={H} {str(dt)[6:]} {k:>15}: max_abs ratio median {ma[len(ma) // 2]:.2f} "
                    f"max {ma[-1]:.2f}; rel_l2 ratio median {rl[len(rl) // 2]:.2f} "
                    f"max {rl[-1]:.2f}; fails {fails}/{len(v)}"
                )


if __name__ == "__main__":
    main()
