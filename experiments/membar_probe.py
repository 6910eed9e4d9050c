"""When does Triton 3.6 put a warpgroup barrier between two shared-memory accesses?

A CPU-only cross-compile (sm90) of one small Gluon kernel, four warps storing two [64, 32] int32
tiles into shared memory and loading the first back, in three forms; it prints the ``bar.sync``
lines of each PTX. Read on 2026-12-02 (Triton 3.6.0): two column slices of one allocation, two
barriers (one between the stores, one before the load); two indices of one [2, 64, 32]
allocation, two; two allocations, one (before the load only). So the compiler's hazard analysis
(membar) sees whole allocations, not the disjoint slices or indices of one: every store of a
slice after a store of another slice of the same allocation costs a barrier, as does an mbarrier
wait behind an arrive on another slot of one mbarrier array (``gluon_ws_fp8``'s producer: ~20
a pair of tiles; ``gluon_ws``: experiments/patches/ws_bars_by_role.diff, docs/PERF_NOTES.md).

    python experiments/membar_probe.py      # ~10 s, no GPU
"""

from __future__ import annotations

import re

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from sparse_mla import inspect

L = gl.constexpr(gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0]))
S = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))
FORMS = ("two slices of one allocation", "two indices of one allocation", "two allocations")


@gluon.jit
def _two_stores(x_ptr, y_ptr, FORM: gl.constexpr):
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, L))
    c = gl.arange(0, 32, layout=gl.SliceLayout(0, L))
    p = x_ptr + r[:, None] * 32 + c[None, :]
    a = gl.load(p)
    b = gl.load(p + 2048)
    if FORM == 0:
        buf = gl.allocate_shared_memory(gl.int32, [64, 64], S)
        buf.slice(0, 32, dim=1).store(a)
        buf.slice(32, 32, dim=1).store(b)
        back = buf.slice(0, 32, dim=1).load(L)
    elif FORM == 1:
        buf = gl.allocate_shared_memory(gl.int32, [2, 64, 32], S)
        buf.index(0).store(a)
        buf.index(1).store(b)
        back = buf.index(0).load(L)
    else:
        b0 = gl.allocate_shared_memory(gl.int32, [64, 32], S)
        b1 = gl.allocate_shared_memory(gl.int32, [64, 32], S)
        b0.store(a)
        b1.store(b)
        back = b0.load(L)
    gl.store(y_ptr + r[:, None] * 32 + c[None, :], back)


def main() -> None:
    for form, what in enumerate(FORMS):
        res = inspect.compile(_two_stores, "sm90", {"FORM": form}, {"num_warps": 4},
                              {"x_ptr": "*i32", "y_ptr": "*i32"})  # fmt: skip
        bars = re.findall(r"bar\.sync[^;]*", res.asm["ptx"])
        print(f"{what}: {len(bars)} bar.sync")


if __name__ == "__main__":
    main()
