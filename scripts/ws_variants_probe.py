"""GPU probe of H >= 64 kernel variants against the package kernel and FlashMLA, same process.

Each variant is a copy of ``sparse_mla/gluon/hopper_ws.py`` in a file of its own (the kernel
``_prefill_ws_kernel``), run through ``mla_gluon`` with the package's kernel object swapped:

    PYTHONPATH=.:.peers python3 scripts/ws_variants_probe.py pkg base=scripts/_ws_base.py ...

``pkg`` is the package's kernel as it stands; names starting ``abl_`` are ablations whose
output is not the operator's (not checked). Edge checks first (every variant, H 64 and 128),
then DSv4 CSA at T = 16384, H 64 and 128, every variant and FlashMLA timed in interleaved
rounds (the median
of the rounds reported). The log goes to $OUT/ws_variants.log (default /tmp).
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ws_probe as wp

from sparse_mla import workloads
from sparse_mla.gluon import launch as L
from sparse_mla.gluon.hopper_ws import _prefill_ws_kernel

WS = "gluon_ws"
say = wp.logger(os.path.join(os.environ.get("OUT", "/tmp"), "ws_variants.log"))


def load_variant(name, path):
    spec = importlib.util.spec_from_file_location("ws_variant_" + name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


PACKAGE_LAUNCH = L._launch_persistent


def package_launch(out_tma):
    """The package's launcher, told how the variant writes O (a pointer, or TMA) whatever the
    package's kernel module says."""

    def launch(*args, **kw):
        kw["out_tma"] = out_tma
        return PACKAGE_LAUNCH(*args, **kw)

    return launch


def variant_call(kernel, launch=PACKAGE_LAUNCH):
    """A provider running ``kernel`` through ``mla_gluon``, launched by ``launch`` (a variant
    whose kernel takes other arguments brings its own)."""

    def call(w, out=None):
        L._WS[WS] = (kernel, L._WS[WS][1])  # the launcher runs what the registry table names
        L._launch_persistent = launch
        return wp.gluon_call(WS)(w, out=out)

    return call


def main(specs, rounds=7):
    calls = {}
    for spec in specs:
        name, _, path = spec.partition("=")
        if name == "pkg":
            calls[name] = variant_call(_prefill_ws_kernel)
        else:
            mod = load_variant(name, path)
            launch = getattr(mod, "launch", None) or package_launch(
                getattr(mod, "OUT_BY_TMA", False)
            )
            calls[name] = variant_call(mod._prefill_ws_kernel, launch)
    say(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    checked = {n: c for n, c in calls.items() if not n.startswith("abl_")}  # ablations: no output
    ok = wp.check_edges(say, checked, (64, 128))
    say(f"edge checks {list(checked)} {'ALL OK' if ok else 'FAILURES'}")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda a=a: a @ a, return_mode="median")
    say(f"matmul ceiling {2 * 8192**3 / ms / 1e9:.0f} TFLOP/s")
    del a
    for H, topk in ((64, 512), (128, 1024)):
        w = workloads.dsv4_csa(16384, H, topk=topk, device="cuda", big_buffer=True, seed=1)
        w.kv.normal_()
        provs = dict(calls)
        provs["flashmla"] = wp.flashmla_call(w)
        times = {n: [] for n in provs}
        for r in range(rounds):
            for n, call in provs.items():
                ms = triton.testing.do_bench(lambda call=call, w=w: call(w), return_mode="median")
                times[n].append(ms)
                say(f"csa H{H} topk{topk} {n} round{r}: {ms:.3f} ms "
                    f"{w.flops() / ms / 1e9:.0f} TFLOP/s")  # fmt: skip
        med = {n: statistics.median(t) for n, t in times.items()}
        ref = med["flashmla"]
        say(f"  median of {rounds} rounds: " + ", ".join(
            f"{n} {t:.3f} ({t / ref:.3f} of FlashMLA)" for n, t in med.items()))  # fmt: skip
        del w
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
