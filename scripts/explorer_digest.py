#!/usr/bin/env python3
"""The explorer on this machine's GPU, once per kernel, as a Markdown digest (issue 23's GPU run).

For every kernel the explorer offers on ``local`` (:func:`sparse_mla.lab.explorer.kernels_for`:
the registered kernels that compile for this GPU's arch and read a pool the panel can feed), an
:class:`~sparse_mla.lab.explorer.ExplorerPanel` is opened on ``local`` at a head count where
``config=None`` runs it (else the first of ``--heads`` the kernel serves), with its tuned or
default launch loaded as on a widget change; it compiles, checks against fp32 on this GPU and
times, and the digest records what the panel shows: the state, its status line, the resource
table, the error run and the time. Exits non-zero when a panel did not end "ok" or its error
run failed.

    python scripts/explorer_digest.py --out digest.md            # GPU machine, widgets installed
    python scripts/explorer_digest.py --out d.md --kernels gluon_ws_small --heads 16
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# The head counts tried per kernel, in order: the first one the kernel serves is used.
HEADS = (16, 64, 128)


def _table(rows) -> list[str]:
    out = ["| resource | value |", "| --- | --- |"]
    out += [f"| {k} | {str(v).replace('|', '/')} |" for k, v, _ in rows]
    return out


def shipped_first(name: str, heads: tuple[int, ...]) -> tuple[int, ...]:
    """``heads`` with those at which ``config=None`` runs ``name`` on this GPU first (T=4096)."""
    import torch

    from sparse_mla import dispatch, runtime

    fmt = dispatch.kernel(name).kv_format

    def ships(H: int) -> bool:
        call = dispatch.Call(runtime.arch(), H, 512, torch.bfloat16, num_tokens=4096,
                             kv_format=fmt)  # fmt: skip
        try:
            return dispatch.choose(call).kernel == name
        except Exception:  # a shape-only question the rule cannot answer: keep the order
            return False

    return tuple(sorted(heads, key=lambda H: not ships(H)))


def digest_one(name: str, heads: tuple[int, ...], error_tokens: int) -> tuple[bool, list[str]]:
    """One kernel's panel on ``local``: (passed, Markdown lines)."""
    from sparse_mla.lab.explorer import ExplorerPanel

    lines = [f"## {name}", ""]
    heads = shipped_first(name, heads)
    last = None
    for H in heads:
        t0 = time.perf_counter()
        p = ExplorerPanel("local", H, 512, kernel=name, error_tokens=error_tokens, start=False)
        try:
            p.update(wait=True)
            if p.phase != "ok" and p.invalid:  # this head count is not the kernel's: next one
                last = f"H={H}: {p.status_text()}"
                continue
            state = p.state()
            lines += [f"- H={H}, {time.perf_counter() - t0:.1f} s: **{p.phase}**",
                      f"- state: `{state.label()}`",
                      f"- status: {p.status_text()}"]  # fmt: skip
            err = p.error.report if p.error is not None else None
            lines.append(f"- error against fp32 ({error_tokens} tokens): {err}")
            lines.append(f"- time: {p.time_ms:.4f} ms" if p.time_ms is not None else "- time: -")
            lines += ["", *_table(p.resource_rows()), ""]
            ok = p.phase == "ok" and err is not None and err.ok and p.time_ms is not None
            return ok, lines
        finally:
            p.close()
    return False, [*lines, f"- no head count of {heads} ran: {last}", ""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="the Markdown digest to write")
    ap.add_argument("--kernels", default=None, help="comma-separated names (default: all offered)")
    ap.add_argument("--heads", default=",".join(map(str, HEADS)),
                    help="head counts to try per kernel, in order")  # fmt: skip
    ap.add_argument("--error-tokens", type=int, default=4)
    args = ap.parse_args(argv)

    import torch
    import triton

    from sparse_mla import runtime
    from sparse_mla.lab.explorer import kernels_for

    if not runtime.has_gpu():
        print("explorer_digest: no GPU here; the panel times and checks only on 'local'")
        return 2
    offered = kernels_for("local")
    names = args.kernels.split(",") if args.kernels else offered
    unknown = [n for n in names if n not in offered]
    if unknown:
        print(f"explorer_digest: not offered on this GPU: {unknown} (offered: {offered})")
        return 2
    heads = tuple(int(h) for h in args.heads.split(","))
    lines = ["# The explorer on this GPU, each kernel", "",
             f"- device: {runtime.device_name()} ({runtime.arch()}); torch {torch.__version__}, "
             f"Triton {triton.__version__}, Python {sys.version.split()[0]}",
             f"- kernels offered on 'local': {', '.join(offered)}", ""]  # fmt: skip
    failed = []
    for name in names:
        t0 = time.perf_counter()
        ok, part = digest_one(name, heads, args.error_tokens)
        print(f"{name}: {'ok' if ok else 'FAILED'} in {time.perf_counter() - t0:.1f} s", flush=True)
        lines += part
        if not ok:
            failed.append(name)
    lines.insert(4, f"- result: {len(names) - len(failed)} of {len(names)} ok"
                    + (f"; failed: {', '.join(failed)}" if failed else ""))  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
