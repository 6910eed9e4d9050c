"""Tuned launch configs: configs/<arch>/triton/attention/sparse_attention_dsv4/DEFAULT.json.

Entries are keyed by shape (``"H16_D512"``) and hold the launch plus its provenance. A missing
file or entry is the normal case for most shapes and is silent: the launcher then uses
:func:`sparse_mla.prefill.default_config`.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

__all__ = ["CONFIG_ROOT", "config_path", "lookup", "shape_key"]

CONFIG_ROOT = Path(__file__).resolve().parents[1] / "configs"
_OP_DIR = Path("triton/attention/sparse_attention_dsv4")


class ConfigFileError(ValueError):
    """A tuned-config file that cannot be used; the message names the file."""


def shape_key(num_heads: int, head_dim: int) -> str:
    return f"H{num_heads}_D{head_dim}"


def config_path(arch: str, root: Path | None = None) -> Path:
    return Path(root or CONFIG_ROOT) / arch / _OP_DIR / "DEFAULT.json"


@functools.lru_cache(maxsize=64)
def _load(path: Path, mtime_ns: int) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigFileError(f"{path}: not a readable JSON file ({e})") from e
    if not isinstance(data, dict):
        raise ConfigFileError(f"{path}: top level must be an object keyed by shape")
    return data


def lookup(arch: str | None, num_heads: int, head_dim: int, root: Path | None = None):
    """The tuned PrefillConfig for (arch, H, D), or None (silently) when there is none."""
    from .prefill import PrefillConfig

    if arch is None:
        return None
    path = config_path(arch, root)
    if not path.is_file():
        return None
    entry = _load(path, path.stat().st_mtime_ns).get(shape_key(num_heads, head_dim))
    if entry is None:
        return None
    try:
        return PrefillConfig.from_dict(dict(entry["launch"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigFileError(f"{path}: entry {shape_key(num_heads, head_dim)}: {e}") from e
