"""The child process in which :func:`sparse_mla.inspect.compile` cross-compiles.

Triton's compiler prints from C++ straight to file descriptor 2 (MLIR's diagnostics, the
failing module, ``LLVM ERROR`` lines). A process has one fd 2 shared by all its threads, so the
only way to keep that text out of the caller's output *without also taking other threads'
output* is to compile in another process. This one is started once per parent process
(``sparse_mla.inspect._Worker``), reads pickled requests on stdin and answers on a private copy
of its original stdout; while it compiles, its own fds 1 and 2 point at a log file the parent
named, so the parent gets everything the compiler printed (even when the compiler crashes the
child).

A request names the kernel by module and qualified name; the child imports it and checks that
its ``cache_key`` (its source) is the parent's, else answers ``"stale"`` and the parent compiles
in-process instead.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import traceback


def _stage(e: BaseException) -> str | None:
    stage = None
    for frame in traceback.extract_tb(e.__traceback__):
        if frame.name.startswith("make_") and "triton" in frame.filename:
            stage = frame.name.removeprefix("make_")
    return stage


def _compile(req: dict) -> dict:
    import importlib

    import triton

    from sparse_mla import inspect as si

    obj = importlib.import_module(req["module"])
    for part in req["qualname"].split("."):
        obj = getattr(obj, part)
    jit = si._unwrap(obj)
    if jit.cache_key != req["cache_key"]:
        return {"status": "stale"}
    if si._is_gluon(jit):
        from triton.experimental.gluon._runtime import GluonASTSource as Source
    else:
        from triton.compiler.compiler import ASTSource as Source
    src = Source(jit, req["signature"], req["constexprs"], req["attrs"])
    try:
        with si.call_site_line_info():
            ck = triton.compile(src, target=req["target"], options=req["options"])
    except Exception as e:
        return {
            "status": "error",
            "type": type(e).__name__,
            "message": str(e),
            "traceback": "".join(traceback.format_exception(type(e), e, e.__traceback__)),
            "stage": _stage(e),
        }
    return {"status": "ok", "asm": dict(ck.asm), "metadata": ck.metadata._asdict()}


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).fflush(None)


def main() -> None:
    answers = os.fdopen(os.dup(1), "wb")
    requests = sys.stdin.buffer
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    pickle.dump({"status": "ready"}, answers)
    answers.flush()
    while True:
        try:
            req = pickle.load(requests)
        except EOFError:
            return
        sys.path[:] = req["path"]
        log = os.open(req["log"], os.O_WRONLY | os.O_APPEND)
        os.dup2(log, 1)
        os.dup2(log, 2)
        try:
            reply = _compile(req)
        except Exception as e:  # the kernel could not be found or imported: compile in-process
            reply = {"status": "stale", "why": f"{type(e).__name__}: {e}"}
        _flush()
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        os.close(log)
        try:
            data = pickle.dumps(reply)
        except Exception as e:
            data = pickle.dumps({"status": "stale", "why": f"reply: {type(e).__name__}: {e}"})
        answers.write(data)
        answers.flush()


if __name__ == "__main__":
    main()
