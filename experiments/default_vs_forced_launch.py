"""The launch ``config=None`` makes against the one ``config=Choice("gluon_ws")`` makes, on CPU.

With Triton's driver replaced by the stand-in of ``scripts/host_cost.py --cpu-launch`` (sm90
compiles, a no-op launch that here records its arguments), both calls run at H, T and list
length K (argv; default 112 16384 64) with plans off and on, and the last launch of each is
printed: kernel name, grid, and every scalar argument (tensors by address). Shown on 2026-12-01 at
H112 T16384: the four launches are the same kernel with the same arguments (grid 132, the
TMA map shapes, CONSUMER_REGS 224, PRODUCER_REGS 48, the large-call order), so the grids' 3-6%
between `default` and the forced kernel at the heavy points is not a different launch.

    .venv/bin/python experiments/default_vs_forced_launch.py [H T K]
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def main(H: int = 112, T: int = 16384, K: int = 64) -> None:
    spec = importlib.util.spec_from_file_location("host_cost", ROOT / "scripts" / "host_cost.py")
    hc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hc)
    hc._fake_sm90()
    from triton.backends.nvidia import driver as nvd
    from triton.runtime import driver

    rec: list[tuple[str, tuple]] = []
    cls = driver.active.launcher_cls
    init = cls.__init__

    def recording_init(self, src, metadata):
        init(self, src, metadata)
        meta = getattr(metadata, "tensordesc_meta", None)
        name = getattr(metadata, "name", "?")
        self.launch = nvd.wrap_handle_tensordesc(
            lambda *a, name=name: rec.append((name, a)), dict(src.signature), meta
        )

    cls.__init__ = recording_init
    from sparse_mla import dispatch, op, prefill, sparse_mla_prefill

    prefill._arch_of = lambda q: "sm90"
    for name, k in list(dispatch.KERNELS.items()):
        if name != "triton":
            dispatch.KERNELS[name] = replace(k, unavailable=lambda call: None)
    N = 65536
    q = torch.randn(T, H, 512).to(torch.bfloat16)
    kv = torch.randn(N, 512).to(torch.bfloat16)
    idx = torch.randint(0, N, (T * K,), dtype=torch.int32)
    indptr = torch.arange(0, T * K + 1, K, dtype=torch.int32)
    sink = torch.zeros(H, dtype=torch.float32)
    out = torch.empty_like(q)
    shown = {}
    for plans in (False, True):
        for label, cfg in (("default", None), ("forced", dispatch.Choice("gluon_ws"))):
            op.set_plans_enabled(plans)
            rec.clear()
            for _ in range(3):
                sparse_mla_prefill(q, kv, idx, indptr, 0.05, attn_sink=sink, out=out, config=cfg)
            name, args = rec[-1]
            # a tensor as its address: what Triton's C launcher reads of it (a plan's replay
            # passes the address itself, fastlaunch._POINTER_INTS)
            scalars = [a.data_ptr() if isinstance(a, torch.Tensor) else a
                       if isinstance(a, (int, float, str, tuple, type(None))) else
                       type(a).__name__ for a in args]  # fmt: skip
            shown[(label, plans)] = (name, scalars)
            print(f"{label} plans={'on' if plans else 'off'}: {name} {scalars}")
    op.set_plans_enabled(True)
    same = len({repr(v) for v in shown.values()}) == 1
    print("all four launches the same" if same else "the launches differ")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
