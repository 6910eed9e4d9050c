"""``gluon_ws``'s row gathers asking L2 for 256-byte blocks (``cp.async.cg...L2::256B``), against
the package's kernel, in turns (twenty-eighth session; PERF_NOTES "No cliffs" step 32).

Step 21's probe found that with one long item an SM (whole lists at small T) FlashMLA's tile is
~6% shorter and its L2 hit rate 77% against ours 66%, and read that to its gather asking L2 for
256-byte blocks on each cp.async (one DRAM miss brings two 128-byte lines of the row), which
Gluon's ``async_copy_global_to_shared`` cannot say in Triton 3.6. Triton's compile-stage hook
(``knobs.runtime.add_stages_inspection_hook``) can: it wraps the PTX stage, and for the copy of
the kernel file this script loads (``hopper_ws_l2_256b.py``, told apart by the PTX's ``.file``
line) adds ``.L2::256B`` to every ``cp.async.cg.shared.global``. The copy runs in place of the
package's kernel as ``ws_bars_ab.py``'s ``--before`` does; both are checked against the fp32
reference first. ``TRITON_ALWAYS_COMPILE=1`` is needed: Triton's cache key ignores the file name
and the hook, so the two kernels would otherwise share one cached binary. On an H200:

    TRITON_ALWAYS_COMPILE=1 PYTHONPATH=$PWD python experiments/ws_l2_256b.py \\
        --points ctx65536:128:64:512 ctx65536:64:128:1024 64:128:1024 16384:128:1024

"after / before" in its lines is the package's time over the 256-byte variant's.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile

import torch
from triton import knobs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ws_bars_ab as ab

COPY = "hopper_ws_l2_256b.py"
COUNTS: list[int] = []


def hook(backend, stages, options, language, capability):
    """Wrap the PTX stage: in the copy's kernel, every cp.async.cg asks L2 for 256 bytes."""
    make_ptx = stages["ptx"]

    def ptx(src, metadata):
        text = make_ptx(src, metadata)
        if COPY in text:
            text, n = re.subn(
                r"cp\.async\.cg\.shared\.global \[", "cp.async.cg.shared.global.L2::256B [", text
            )
            COUNTS.append(n)
        return text

    stages["ptx"] = ptx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", nargs="*", default=["ctx65536:128:64:512", "64:128:1024"])
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    if not knobs.compilation.always_compile:
        raise SystemExit("run with TRITON_ALWAYS_COMPILE=1 (see the docstring)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(tempfile.mkdtemp(), COPY)
    shutil.copy(os.path.join(root, "sparse_mla", "gluon", "hopper_ws.py"), path)
    variant = ab.load_before(path)
    knobs.runtime.add_stages_inspection_hook = hook
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}, gluon_ws: package (after) "
          "against its gathers with .L2::256B (before)", flush=True)  # fmt: skip
    ab.run_points([ab.parse_point(p) for p in args.points], variant, args.repeat)
    if not COUNTS or min(COUNTS) == 0:
        raise SystemExit(
            f"the rewrite did not apply (cp.async lines rewritten per build: {COUNTS})"
        )
    print(f"cp.async lines rewritten per build of the variant: {COUNTS}")


if __name__ == "__main__":
    main()
