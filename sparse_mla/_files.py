"""Atomic file writes shared by captures and tuned-config exports."""

from __future__ import annotations

import contextlib
import os
import re
import time
import uuid
from pathlib import Path

__all__ = ["atomic_write", "clean_stale_temps"]

# ".<target name>.<writer pid>.<8 hex>.tmp": the temp files atomic_write leaves only when its
# process is killed between creating and renaming one.
_TEMP_RE = re.compile(r"^\..+\.(\d+)\.[0-9a-f]{8}\.tmp$")
STALE_SECONDS = 3600.0  # a temp this old is stale even if a process with its pid runs


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # exists (another user's) or cannot tell: keep it
    return True


def clean_stale_temps(folder: str | os.PathLike, *, max_age: float = STALE_SECONDS) -> list[Path]:
    """Delete this package's temp files in ``folder`` whose writer is gone (its pid no longer
    runs on this machine) or that are older than ``max_age`` seconds; returns those deleted.
    A writer killed mid-write (SIGKILL, power loss) leaves one; the next write cleans it."""
    removed = []
    now = time.time()
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        m = _TEMP_RE.match(entry.name)
        if m is None or not entry.is_file(follow_symlinks=False):
            continue
        pid = int(m.group(1))
        try:
            age = now - entry.stat(follow_symlinks=False).st_mtime
        except OSError:
            continue
        if _alive(pid) and age < max_age:
            continue
        with contextlib.suppress(OSError):
            os.unlink(entry.path)
            removed.append(Path(entry.path))
    return removed


def atomic_write(path: str | os.PathLike, data: bytes, *, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` via a temp file in the same folder, fsync, then os.replace:
    readers see the old file or the new one, and nothing partial remains on any error. Stale
    temp files of killed writers in that folder are removed first (:func:`clean_stale_temps`).
    ``mode``: the new file's permission bits (default: the umask's)."""
    path = Path(path)
    clean_stale_temps(path.parent)
    # A hidden, unique name beside the target; "x" mode gives normal (umask) permissions.
    tmp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
