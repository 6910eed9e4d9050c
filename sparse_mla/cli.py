"""The ``sparse-mla`` command. Each subcommand is a thin layer over one package module."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _cmd_check(args: argparse.Namespace) -> int:
    """Run the prefill kernel on random inputs and compare it with the fp32 reference."""
    import torch

    from . import runtime
    from .prefill import sparse_mla_prefill
    from .reference import check_against_reference

    device = "cuda" if runtime.has_gpu() and not args.cpu else "cpu"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    gen = torch.Generator().manual_seed(args.seed)
    T, H, D, N, K = args.tokens, args.heads, args.head_dim, args.pool, args.slots
    q = torch.randn(T, H, D, generator=gen).to(device=device, dtype=dtype)
    kv = torch.randn(N, D, generator=gen).to(device=device, dtype=dtype)
    lengths = torch.randint(0, K + 1, (T,), generator=gen)
    indptr = torch.zeros(T + 1, dtype=torch.int32)
    indptr[1:] = lengths.cumsum(0)
    idx = torch.randint(-1, N, (int(indptr[-1]),), generator=gen, dtype=torch.int32)
    sink = torch.randn(H, generator=gen).to(device) if args.sink else None
    indptr, idx = indptr.to(device), idx.to(device)
    out = sparse_mla_prefill(q, kv, idx, indptr, D**-0.5, attn_sink=sink)
    report = check_against_reference(out, q, kv, idx, indptr, D**-0.5, attn_sink=sink)
    print(f"device: {runtime.device_name() if device == 'cuda' else 'cpu (Triton interpreter)'}")
    print(f"T={T} H={H} D={D} N={N} slots<={K} dtype={args.dtype} sink={args.sink}")
    print(report)
    return 0 if report.ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparse-mla", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("check", help="run the prefill kernel once and compare with fp32")
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=512)
    p.add_argument("--pool", type=int, default=1024)
    p.add_argument("--slots", type=int, default=128, help="most slots per token")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--sink", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", action="store_true", help="use the interpreter even with a GPU")
    p.set_defaults(func=_cmd_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
