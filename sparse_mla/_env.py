"""``os.environ.get`` for the per-call paths: the same value, read from os.environ's own dict.

On POSIX ``os.environ`` keeps the environment in a dict of bytes (``_data``) that every
``os.environ[k] = v`` / ``del os.environ[k]`` / ``putenv`` through it updates; ``get`` on it
skips the str encode of the key (~1 us a read on a slow host). The value is decoded as
``os.environ`` decodes it. Elsewhere (Windows keeps str keys) the plain ``os.environ.get``.
"""

from __future__ import annotations

import os

_DATA = getattr(os.environ, "_data", None) if os.name == "posix" else None
if not isinstance(_DATA, dict):
    _DATA = None


def getenv(name: str) -> str | None:
    """``os.environ.get(name)``."""
    if _DATA is None:
        return os.environ.get(name)
    v = _DATA.get(name.encode())
    return None if v is None else os.fsdecode(v)
