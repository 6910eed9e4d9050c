"""Cross-compile the sm90 few-heads kernel (``sparse_mla/gluon/hopper_ws_small.py``) at
HEAD_GROUPS = 1 and 2 (16 / 32 heads on wgmma's N) without a GPU and print what each uses:
registers per warp partition (and the highest register each partition's code touches), spills
(local memory), shared memory, wgmma and cp.async counts. CPU only, ~10 s:

    python scripts/ws_small_groups_compile.py [--groups 1 2] [--index int32|int64]
                                              [--dtype bf16|fp16] [--sass-dir DIR]
                                              [--producer-regs N]

``--sass-dir`` writes each variant's SASS (cuobjdump, encodings dropped) to
``DIR/ws_small_g{G}_{index}.sass`` for diffing before/after a change (``git stash``, run, pop,
run, ``diff``; or compile a copy of the old package with ``PYTHONPATH``). A kernel without
the ``HEAD_GROUPS`` parameter (the code before issue 22) is compiled as G = 1.
``--producer-regs`` overrides the producer's register request (the consumer gets the rest): a
probe of either partition's headroom, the smallest budget without spills.

The signature and attributes are the ones the launcher's JIT specialises for an engine's
tensors (pointers 16-byte aligned, KV row stride a multiple of 16 elements), written out here
so that this script does not depend on the launcher.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton import knobs
from triton.experimental.gluon._runtime import GluonASTSource

from sparse_mla import inspect
from sparse_mla.gluon import hopper_ws_small
from sparse_mla.targets import triton_target

WGMMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)\.f32\.(?:bf16|f16)")


def signature(index: str = "int32", dtype: str = "bf16") -> dict[str, str]:
    elem = "*" + dtype
    idx = "*i64" if index == "int64" else "*i32"
    return {
        "q_ptr": elem, "kv_ptr": elem, "idx_ptr": idx, "indptr_ptr": idx, "sink_ptr": "*fp32",
        "out_ptr": elem, "stride_qr": "i32", "stride_qh": "i32", "stride_kvn": "i32",
        "stride_or": "i32", "stride_oh": "i32", "num_heads": "i32", "num_kv": "i32",
        "nnz": "i32", "qk_scale": "fp32", "num_items": "i32",
    }  # fmt: skip


def compile_groups(head_groups: int, index: str = "int32", dtype: str = "bf16"):
    """``triton.compile`` of ``_prefill_ws_small_kernel`` for sm90 at ``head_groups``, with the
    launch options the launcher uses (num_warps=4: the default partition; num_stages=1)."""
    kernel = hopper_ws_small._prefill_ws_small_kernel
    sig = signature(index, dtype)
    constexprs = {}
    if "HEAD_GROUPS" in kernel.arg_names:
        sig["HEAD_GROUPS"] = "constexpr"
        constexprs["HEAD_GROUPS"] = head_groups
    elif head_groups != 1:
        raise ValueError("this kernel has no HEAD_GROUPS parameter (only G = 1 compiles)")
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(kernel.arg_names)
        if sig.get(name, "").startswith("*") or name == "stride_kvn"
    }
    src = GluonASTSource(kernel, sig, constexprs, attrs)
    options = {"num_warps": 4, "num_stages": 1}
    return triton.compile(src, target=triton_target("sm90"), options=options)


def _copy_sizes(ptx: str) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for size in re.findall(r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], (\w+)", ptx):
        sizes[size] = sizes.get(size, 0) + 1
    return sizes


def sass_of(ck) -> str:
    """SASS (``cuobjdump --dump-sass``, Triton's copy) without the encoding-only lines."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        tool = knobs.nvidia.cuobjdump.path
        text = subprocess.run([tool, "--dump-sass", f.name], check=True, capture_output=True,
                              text=True).stdout  # fmt: skip
    lines = []
    for line in text.splitlines():
        if re.match(r"^\s*/\* 0x[0-9a-f]+ \*/$", line):
            continue
        lines.append(re.sub(r"\s*/\* 0x[0-9a-f]+ \*/$", "", line.rstrip()))
    return "\n".join(lines).strip("\n") + "\n"


def max_register_by_region(sass: str) -> list[tuple[str, int]]:
    """The highest register index used between consecutive ``USETMAXREG`` instructions (each
    partition's code runs after its own): (the USETMAXREG that opens the region, max Rn).
    An approximate per-partition register use (the layout of the code, not its control flow)."""
    rows = []
    head, top = "entry", -1
    for line in sass.splitlines():
        if "USETMAXREG" in line:
            rows.append((head, top))
            head = line.split(";")[0].split("*/")[-1].strip()
            top = -1
            continue
        for r in re.findall(r"\bR(\d+)\b", line):
            top = max(top, int(r))
    rows.append((head, top))
    return rows


def report(ck) -> dict:
    """What one compiled variant uses."""
    res = inspect.resources_of(ck, "sm90")
    ptx = ck.asm["ptx"]
    sass = sass_of(ck)
    mma = {}
    for shape in WGMMA.findall(ptx):
        mma[shape] = mma.get(shape, 0) + 1
    setmaxnreg = re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)
    instrs = sum(1 for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln))
    return {
        "warps": ck.metadata.num_warps,
        "partitions": res.partitions,
        "registers (launch)": res.registers,
        "local (spill) bytes": res.local_bytes,
        "stack bytes": res.stack_bytes,
        "shared bytes": res.shared_bytes,
        "wgmma in PTX": mma,
        "cp.async in PTX (by size)": _copy_sizes(ptx),
        "SASS instructions": instrs,
        "HGMMA in SASS": len(re.findall(r"\bHGMMA\.", sass)),
        "setmaxnreg in PTX": sorted(set(setmaxnreg)),
        "max register by USETMAXREG region": max_register_by_region(sass),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--index", choices=["int32", "int64"], default="int32")
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--sass-dir", type=Path)
    ap.add_argument("--producer-regs", type=int, help="the producer's register request (probe)")
    a = ap.parse_args()
    if a.producer_regs:
        hopper_ws_small.PRODUCER_REGS.value = a.producer_regs
    for g in a.groups:
        ck = compile_groups(g, a.index, a.dtype)
        print(f"HEAD_GROUPS={g} ({16 * g} heads per item), {a.dtype}, {a.index} ids")
        for k, v in report(ck).items():
            print(f"  {k}: {v}")
        if a.sass_dir:
            a.sass_dir.mkdir(parents=True, exist_ok=True)
            path = a.sass_dir / f"ws_small_g{g}_{a.index}.sass"
            path.write_text(sass_of(ck))
            print(f"  SASS -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
