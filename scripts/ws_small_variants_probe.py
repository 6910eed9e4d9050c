"""GPU probe of the H <= 16 kernel's variants (scripts/ws_small_variants.py) against the package
kernel ("base") and FlashMLA padded to 64 heads: edge checks (not for the ablations), then
T = 16384 timing. One variant per process (an illegal address ends the process):

    for v in base pipe gather_only math_only; do
        PYTHONPATH=.:.peers python3 scripts/ws_small_variants_probe.py $v; done
    PYTHONPATH=.:.peers python3 scripts/ws_small_variants_probe.py base,flashmla

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
from sparse_mla.gluon import GluonConfig
from sparse_mla.gluon import launch as L
from sparse_mla.gluon.hopper_ws_small import _prefill_ws_small_kernel
from sparse_mla.reference import check_against_reference

SMALL = GluonConfig(16, 64, 4, warp_specialized=True)
LOG = os.path.join(os.environ.get("OUT", "/tmp"), "var_probe.log")


def say(msg):
    print(msg, flush=True)
    with open(LOG, "a") as f:
        f.write(msg + "\n")


def variant_call(kernel):
    def call(w, out=None):
        L._prefill_ws_small_kernel = kernel
        return wp.gluon_call(SMALL)(w, out=out)

    return call


def flashmla_call(w, H):
    import flash_mla

    idx3, tl = wp.dense_for_flashmla(w)
    kv3 = w.kv.view(-1, 1, 512)
    qp = torch.zeros(w.q.shape[0], 64, 512, dtype=w.q.dtype, device="cuda")
    qp[:, :H] = w.q
    sp = torch.zeros(64, dtype=torch.float32, device="cuda")
    sp[:H] = w.attn_sink

    def call(w, out=None):
        return flash_mla.flash_mla_sparse_fwd(
            qp, kv3, idx3, w.softmax_scale, d_v=512, attn_sink=sp, topk_length=tl
        )

    return call


def main(names):
    kernels = {
        n: _prefill_ws_small_kernel if n == "base" else getattr(sv, "k_" + n)
        for n in names
        if n != "flashmla"
    }
    ok_all = True
    for n in [n for n in kernels if n not in ("gather_only", "math_only")]:
        call = variant_call(kernels[n])
        for H in (1, 8, 16):
            for dt in (torch.int32, torch.int64):
                for sink in (True, False):
                    w = wp.edge_workload(H, dt, sink, seed=H + sink)
                    out = torch.full_like(w.q, float("nan"))
                    call(w, out=out)
                    torch.cuda.synchronize()
                    rep = check_against_reference(out, *w.args(), attn_sink=w.attn_sink)
                    out2 = torch.full_like(w.q, float("nan"))
                    call(w, out=out2)
                    ok = rep.ok and torch.equal(out, out2) and bool((out[30] == 0).all())
                    ok_all &= ok
                    if not ok:
                        say(f"FAIL {n} H{H} {dt} sink={sink} {rep}")
    checked = [n for n in kernels if n not in ("gather_only", "math_only")]
    say(f"edge checks {checked} {'ALL OK' if ok_all else 'FAILURES'}")
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
            provs["flashmla_pad64"] = flashmla_call(w, H)
        for n, call in provs.items():
            ms = triton.testing.do_bench(lambda call=call, w=w: call(w), return_mode="median")
            say(f"{kind} H{H} topk{topk} {n} round0: {ms:.3f} ms {gb / ms:.2f} TB/s of KV rows")
        del w
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1].split(","))
