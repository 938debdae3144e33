"""Atomic shard checkpoints: temporary file, fsync, rename; a JSON manifest written last.

Layout: ``<dir>/shard-<s>/clock-<t>.npz`` (arrays by name) and ``clock-<t>.json`` (clock, shard,
book digest, array names, SHA-256 of the npz). A checkpoint counts only when its manifest exists
and the npz matches it, so a crash mid-write leaves the previous checkpoint in force. Arrays are
read with ``allow_pickle=False``: a checkpoint file cannot execute code.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path
from typing import Mapping, Optional

import numpy as np

from ..errors import CheckpointError


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that a crash leaves either the old file or the new one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def shard_dir(root: str, shard: int) -> Path:
    return Path(root) / f"shard-{shard}"


def write(root: str, shard: int, clock: int, digest: str, arrays: Mapping[str, np.ndarray]) -> Path:
    """Write shard ``shard``'s state at ``clock``; return the manifest's path."""
    where = shard_dir(root, shard)
    where.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    blob = buf.getvalue()
    data_path = where / f"clock-{clock:010d}.npz"
    write_atomic(data_path, blob)
    manifest = {
        "clock": clock,
        "shard": shard,
        "book": digest,
        "arrays": sorted(arrays),
        "sha256": hashlib.sha256(blob).hexdigest(),
    }
    meta_path = where / f"clock-{clock:010d}.json"
    write_atomic(meta_path, json.dumps(manifest).encode())
    fsync_dir(where)
    return meta_path


def complete_clocks(root: str, shard: int, digest: str) -> list:
    """Clocks with a complete, verified checkpoint of this shard for this book, ascending."""
    where = shard_dir(root, shard)
    if not where.is_dir():
        return []
    clocks = []
    for meta in sorted(where.glob("clock-*.json")):
        try:
            info = json.loads(meta.read_text())
            blob = meta.with_suffix(".npz").read_bytes()
        except (OSError, ValueError):
            continue
        if info.get("book") == digest and hashlib.sha256(blob).hexdigest() == info.get("sha256"):
            clocks.append(int(info["clock"]))
    return sorted(clocks)


def read(root: str, shard: int, clock: int, digest: str) -> dict:
    """Load shard ``shard``'s arrays at ``clock``.

    Raises:
        CheckpointError: missing, corrupt, or written for another information book.
    """
    meta = shard_dir(root, shard) / f"clock-{clock:010d}.json"
    try:
        info = json.loads(meta.read_text())
        blob = meta.with_suffix(".npz").read_bytes()
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"shard {shard} has no readable checkpoint at clock {clock} in {meta.parent}: {exc}"
        ) from None
    if info.get("book") != digest:
        raise CheckpointError(
            f"checkpoint {meta} was written for another model or cluster shape "
            f"(book {str(info.get('book'))[:12]}, this job {digest[:12]})"
        )
    if hashlib.sha256(blob).hexdigest() != info.get("sha256"):
        raise CheckpointError(f"checkpoint {meta.with_suffix('.npz')} does not match its manifest (corrupt)")
    with np.load(io.BytesIO(blob), allow_pickle=False) as npz:
        return {name: npz[name] for name in npz.files}


def newest_common(clocks_by_shard: Mapping[int, list]) -> Optional[int]:
    """The newest clock every shard completed, or ``None``."""
    sets = [set(c) for c in clocks_by_shard.values()]
    common = set.intersection(*sets) if sets else set()
    return max(common) if common else None
