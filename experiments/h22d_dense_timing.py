"""Issue 22, dense ids (branch h22d): gluon_ws (and config=None) on CSR against the dense [T, K]
form, same lists, same process, interleaved rounds; GPU time by ``bench.time_budget`` (L2
flushed before each call, calls queued behind a GPU sleep). Writes a log and a CSV under $OUT.

Points: T = 64 at H 64/96/128 (CSA, top-k 1024 + window 128: ~80 slots a token), with the dense
ids as FlashMLA's provider gets them (K = the longest list rounded up to 128: 128 here) and as
an engine's untrimmed buffer would be (K = 1152 = top-k + window, -1 padded); and T = 16384 at
H128 (K = 1152), where the first 4096 tokens' lists are shorter than K.
"""

from __future__ import annotations

import csv
import os
import statistics
import sys
import time

import torch

from sparse_mla import bench, dispatch, sparse_mla_prefill, workloads
from sparse_mla.reference import check_against_reference

OUT = os.environ.get("OUT", "/tmp")
ROUNDS = int(os.environ.get("ROUNDS", "7"))
BUDGET_MS = float(os.environ.get("BUDGET_MS", "20"))
POINTS = [(64, 64), (64, 96), (64, 128), (16384, 128)]


def log(msg, f):
    print(msg, flush=True)
    f.write(msg + "\n")
    f.flush()


def main() -> int:
    t_start = time.time()
    rows = []
    ok_all = True
    with open(os.path.join(OUT, "h22d_dense_timing.log"), "w") as f:
        log(f"{torch.cuda.get_device_name()} torch {torch.__version__}", f)
        for T, H in POINTS:
            w = workloads.dsv4_csa(T, H, topk=1024, device="cuda")
            q, kv, idx, ptr, scale = w.args()
            s = w.attn_sink
            d128, _ = bench._dense_topk(idx, ptr, kv.shape[0], 128)
            full = torch.full((T, 1152), -1, dtype=torch.int32, device="cuda")
            full[:, : d128.shape[1]] = d128
            ws = dispatch.Choice("gluon_ws")
            variants = {
                "ws_csr": (idx, ptr, ws),
                f"ws_dense{d128.shape[1]}": (d128, None, ws),
                "default_csr": (idx, ptr, None),
                f"default_dense{d128.shape[1]}": (d128, None, None),
            }
            if d128.shape[1] != 1152:
                variants["ws_dense1152"] = (full, None, ws)
            outs = {}
            for name, (a, b, cfg) in variants.items():
                out = torch.full_like(q, float("nan"))
                sparse_mla_prefill(q, kv, a, b, scale, attn_sink=s, out=out, config=cfg)
                torch.cuda.synchronize()
                outs[name] = out
                if T <= 256:
                    rep = check_against_reference(out, q, kv, idx, ptr, scale, attn_sink=s)
                    ok_all &= rep.ok
                    log(f"T={T} H={H} {name}: {rep}", f)
            same = torch.equal(outs["ws_csr"], outs[f"ws_dense{d128.shape[1]}"])
            ok_all &= same
            log(f"T={T} H={H}: ws dense == ws CSR bitwise: {same}", f)
            times = {n: [] for n in variants}
            names = list(variants)
            for r in range(ROUNDS):
                order = names[r % len(names) :] + names[: r % len(names)]
                for name in order:
                    a, b, cfg = variants[name]
                    o = outs[name]

                    def fn(q=q, kv=kv, a=a, b=b, scale=scale, s=s, cfg=cfg, o=o):
                        sparse_mla_prefill(q, kv, a, b, scale, attn_sink=s, out=o, config=cfg)

                    times[name].append(bench.time_budget(fn, BUDGET_MS) * 1e3)  # us
            base = statistics.median(times["ws_csr"])
            for name in names:
                med = statistics.median(times[name])
                spread = (max(times[name]) - min(times[name])) / med
                log(
                    f"T={T:5d} H={H:3d} {name:16s} {med:9.2f} us  (vs ws_csr {med - base:+7.2f}"
                    f" us, rounds' spread {spread:.1%})",
                    f,
                )
                rows.append(
                    {
                        "T": T,
                        "H": H,
                        "variant": name,
                        "us": med,
                        "vs_ws_csr_us": med - base,
                        "rounds": ROUNDS,
                        "spread": spread,
                    }
                )
            del w, q, kv, idx, ptr, d128, full, outs
            torch.cuda.empty_cache()
        log(f"total {time.time() - t_start:.0f} s; checks ok: {ok_all}", f)
    with open(os.path.join(OUT, "h22d_dense_timing.csv"), "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
