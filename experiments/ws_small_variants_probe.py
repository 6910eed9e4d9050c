"""GPU probe of the H <= 16 kernel's variants (experiments/ws_small_variants.py) against the package
kernel ("base") and FlashMLA padded to 64 heads: edge checks (not for the ablations), then
T = 16384 timing. One variant per process (an illegal address ends the process):

    for v in base pipe gather_only math_only; do
        PYTHONPATH=.:.peers python3 experiments/ws_small_variants_probe.py $v; done
    PYTHONPATH=.:.peers python3 experiments/ws_small_variants_probe.py base,flashmla

Every variant runs through ``mla_gluon`` with the H <= 16 config, the package's kernel object
swapped for the variant's. The log goes to $OUT/var_probe.log (default /tmp).
"""

from __future__ import annotations

import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ws_probe as wp
import ws_small_variants as sv

from sparse_mla import workloads
from sparse_mla.gluon import launch as L
from sparse_mla.gluon.hopper_ws_small import _prefill_ws_small_kernel

SMALL = "gluon_ws_small"
say = wp.logger(os.path.join(os.environ.get("OUT", "/tmp"), "var_probe.log"))


def variant_call(kernel):
    def call(w, out=None):
        L._WS[SMALL] = (kernel, L._WS[SMALL][1])  # the launcher runs what the table names
        return wp.gluon_call(SMALL)(w, out=out)

    return call


def main(names):
    kernels = {
        n: _prefill_ws_small_kernel if n == "base" else getattr(sv, "k_" + n)
        for n in names
        if n != "flashmla"
    }
    checked = {n: variant_call(k) for n, k in kernels.items()}
    for n in ("gather_only", "math_only"):  # ablations: their outputs are not the operator's
        checked.pop(n, None)
    ok = wp.check_edges(say, checked, (1, 8, 16))
    say(f"edge checks {list(checked)} {'ALL OK' if ok else 'FAILURES'}")
    for kind, H, topk in [("csa", 16, 512), ("csa", 8, 512), ("glm", 16, 2048)]:
        if kind == "glm":
            w = workloads.glm_full_topk(
                16384, H, topk=topk, device="cuda", big_buffer=True, seed=1, sink=True
            )
        else:
            w = workloads.dsv4_csa(16384, H, topk=topk, device="cuda", big_buffer=True, seed=1)
        w.kv.normal_()
        gb = w.kv_indices.numel() * 1024 / 1e9
        provs = {n: variant_call(k) for n, k in kernels.items()}
        if "flashmla" in names:
            provs["flashmla_pad64"] = wp.flashmla_call(w)
        for n, call in provs.items():
            ms = triton.testing.do_bench(lambda call=call, w=w: call(w), return_mode="median")
            say(f"{kind} H{H} topk{topk} {n} round0: {ms:.3f} ms {gb / ms:.2f} TB/s of KV rows")
        del w
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1].split(","))
