"""``gluon_ws`` with L2 hints on its copies (``--variants``), added to the PTX, against the
package's kernel, in turns (twenty-eighth session, PERF_NOTES "No cliffs" step 32; the
policies, step 36, thirtieth session).

Step 21's probe found that with one long item an SM (whole lists at small T) FlashMLA's tile is
~6% shorter and its L2 hit rate 77% against ours 66%. FlashMLA's gather (csrc/sm90/prefill/
sparse/phase1.cuh, 9241ae3) asks L2 for 256-byte blocks on each cp.async and gives it an
evict_last cache policy; its Q load gives evict_first. Gluon's copies cannot say any of these
in Triton 3.6 (``async_copy_global_to_shared``'s ``eviction_policy`` is dropped by the sm90
lowering; the TMA load has no hint). Triton's compile-stage hook
(``knobs.runtime.add_stages_inspection_hook``) can: it wraps the PTX stage, and for each copy
of the kernel file this script loads (``hopper_ws_l2_<variant>.py``, told apart by the PTX's
``.file`` line) :func:`rewrite` adds the variant's hints:

- ``256B``: ``.L2::256B`` on every ``cp.async.cg.shared.global`` (step 32: no gain);
- ``rows_last``: the same copies with ``.L2::cache_hint`` and an evict_last policy
  (``createpolicy.fractional``, made once at the kernel's entry);
- ``q_first``: Q's TMA loads (``cp.async.bulk.tensor...mbarrier::complete_tx::bytes``) with an
  evict_first policy.

A variant joins them with ``+`` (``rows_last+q_first``). Each copy runs in place of the
package's kernel as ``ws_bars_ab.py``'s ``--before`` does; both are checked against the fp32
reference first. ``TRITON_ALWAYS_COMPILE=1`` is needed: Triton's cache key ignores the file
name and the hook, so the kernels would otherwise share one cached binary. On an H200:

    TRITON_ALWAYS_COMPILE=1 PYTHONPATH=$PWD python experiments/ws_l2_256b.py \\
        --variants rows_last rows_last+q_first \\
        --points ctx65536:128:64:512 ctx65536:64:128:1024 64:128:1024 16384:128:1024

"after / before" in its lines is the package's time over the variant's.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile

HINTS = ("256B", "rows_last", "q_first")
GATHER = "cp.async.cg.shared.global"
Q_LOAD = "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
POLICY = {"rows_last": ("%rdl2p0", "evict_last"), "q_first": ("%rdl2p1", "evict_first")}
COUNTS: dict[str, list[dict[str, int]]] = {}


def hints_of(variant: str) -> tuple[str, ...]:
    hints = tuple(variant.split("+"))
    bad = [h for h in hints if h not in HINTS]
    if bad or not hints:
        raise SystemExit(f"variant {variant!r}: hints are {'+'.join(HINTS)} joined by '+'")
    return hints


def rewrite(text: str, hints: tuple[str, ...]) -> tuple[str, dict[str, int]]:
    """``text`` (one kernel's PTX) with ``hints``; the count of lines each hint changed.
    Stops if an anchor (the entry's 64-bit register declaration, its first block) is not
    found exactly once."""
    counts = {}
    policies = [h for h in hints if h in POLICY]
    if policies:
        decl = re.findall(r"^\s*\.reg \.b64 \s*%rd<\d+>;$", text, flags=re.M)
        entry = re.findall(r"^// %bb\.0:$", text, flags=re.M)
        if len(decl) != 1 or len(entry) != 1:
            raise SystemExit(f"PTX anchors: {len(decl)} .b64 declarations, {len(entry)} entries")
        text = text.replace(decl[0], decl[0] + "\n\t.reg .b64 \t%rdl2p<2>;", 1)
        made = "".join(
            f"\n\tcreatepolicy.fractional.L2::{POLICY[h][1]}.b64 \t{POLICY[h][0]}, 1.0;"
            for h in policies
        )
        text = text.replace(entry[0], entry[0] + made, 1)
    if "rows_last" in hints or "256B" in hints:
        suffix = (".L2::cache_hint" if "rows_last" in hints else "") + (
            ".L2::256B" if "256B" in hints else ""
        )
        tail = ", %rdl2p0;" if "rows_last" in hints else ";"
        text, n = re.subn(
            rf"{re.escape(GATHER)} (\[[^;]*\]), (\[[^;]*\]), 0x10, (%r\d+);",
            rf"{GATHER}{suffix} \1, \2, 0x10, \3{tail}",
            text,
        )
        counts["gathers"] = n
    if "q_first" in hints:
        text, n = re.subn(
            rf"{re.escape(Q_LOAD)} ([^;]*);", rf"{Q_LOAD}.L2::cache_hint \1, %rdl2p1;", text
        )
        counts["q_loads"] = n
    return text, counts


def copy_name(variant: str) -> str:
    return f"hopper_ws_l2_{variant.replace('+', '_')}.py"


def hook(backend, stages, options, language, capability):
    """Wrap the PTX stage: a copy's kernel gets its variant's hints."""
    make_ptx = stages["ptx"]

    def ptx(src, metadata):
        text = make_ptx(src, metadata)
        for variant in COUNTS:
            if copy_name(variant) in text:
                text, n = rewrite(text, hints_of(variant))
                COUNTS[variant].append(n)
        return text

    stages["ptx"] = ptx


def main() -> None:
    import torch
    from triton import knobs

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import ws_bars_ab as ab

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", nargs="*", default=["ctx65536:128:64:512", "64:128:1024"])
    ap.add_argument("--variants", nargs="*", default=["256B"], metavar="HINT[+HINT]")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    for v in args.variants:
        hints_of(v)
    if not knobs.compilation.always_compile:
        raise SystemExit("run with TRITON_ALWAYS_COMPILE=1 (see the docstring)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    knobs.runtime.add_stages_inspection_hook = hook
    points = [ab.parse_point(p) for p in args.points]
    for variant in args.variants:
        path = os.path.join(tempfile.mkdtemp(), copy_name(variant))
        shutil.copy(os.path.join(root, "sparse_mla", "gluon", "hopper_ws.py"), path)
        COUNTS[variant] = []
        module = ab.load_before(path)
        print(f"{torch.cuda.get_device_name()} torch {torch.__version__}, gluon_ws: package "
              f"(after) against its copies with {variant} (before)", flush=True)  # fmt: skip
        ab.run_points(points, module, args.repeat)
        if not COUNTS[variant] or not all(all(c.values()) for c in COUNTS[variant]):
            raise SystemExit(f"{variant}: the rewrite did not apply ({COUNTS[variant]})")
        print(f"{variant}: lines rewritten per build: {COUNTS[variant]}", flush=True)


if __name__ == "__main__":
    main()
