"""Trainer checkpoints: one file per rank and clock, written atomically, read without executing code.

Layout: ``<dir>/step-<clock>/rank-<r>.pt`` (``torch.save`` of the rank's state) beside
``rank-<r>.json`` (clock, rank, world size, model digest, SHA-256 of the ``.pt``), the JSON written
last. A rank's checkpoint at a clock counts only when both files exist and agree, so a process
killed mid-write leaves the previous checkpoint in force. Files are read with
``torch.load(weights_only=True)``: tensors and plain containers only, no code runs.

Every rank writes its own file, so the layout works with or without a shared file system; at
restore the ranks agree, through the rendezvous, on the newest clock all of them have.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..ps.checkpoint import fsync_dir, newest_common, write_atomic

FORMAT = 1

log = logging.getLogger("poseidon_aio.train")

__all__ = [
    "complete_clocks",
    "for_world",
    "load",
    "newest_common",
    "newest_everywhere",
    "newest_of_rank_0",
    "prune",
    "read",
    "snapshot",
    "write",
]


def _step_dir(root: str, clock: int) -> Path:
    return Path(root) / f"step-{clock:010d}"


def write(root: str, clock: int, rank: int, world: int, model_digest: str, state: dict) -> Path:
    """Write rank ``rank``'s ``state`` at ``clock``; return the ``.pt`` path."""
    where = _step_dir(root, clock)
    where.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    blob = buf.getvalue()
    data = where / f"rank-{rank}.pt"
    write_atomic(data, blob)
    meta = {
        "format": FORMAT,
        "clock": clock,
        "rank": rank,
        "world": world,
        "model": model_digest,
        "sha256": hashlib.sha256(blob).hexdigest(),
    }
    write_atomic(where / f"rank-{rank}.json", json.dumps(meta).encode())
    fsync_dir(where)
    return data


def _meta(root: str, clock: int, rank: int):
    try:
        return json.loads((_step_dir(root, clock) / f"rank-{rank}.json").read_text())
    except (OSError, ValueError):
        return None


def complete_clocks(root: str, rank: int, world, model_digest: str) -> list:
    """Clocks at which rank ``rank`` has a complete checkpoint of this model and world size
    (``world`` None: of any world size)."""
    base = Path(root)
    if not base.is_dir():
        return []
    clocks = []
    for where in base.glob("step-*"):
        try:
            clock = int(where.name.split("-", 1)[1])
        except ValueError:
            continue
        meta = _meta(root, clock, rank)
        if (
            meta
            and (world is None or meta.get("world") == world)
            and meta.get("model") == model_digest
            and (where / f"rank-{rank}.pt").is_file()
        ):
            clocks.append(clock)
    return sorted(clocks)


def read(root: str, clock: int, rank: int) -> dict:
    """Rank ``rank``'s state at ``clock``.

    Raises:
        CheckpointError: the files are missing or do not match their manifest.
    """
    where = _step_dir(root, clock)
    meta = _meta(root, clock, rank)
    try:
        blob = (where / f"rank-{rank}.pt").read_bytes()
    except OSError as exc:
        raise CheckpointError(f"rank {rank} has no checkpoint at clock {clock} in {where}: {exc.strerror}") from None
    if meta is None or hashlib.sha256(blob).hexdigest() != meta.get("sha256"):
        raise CheckpointError(f"{where / f'rank-{rank}.pt'} does not match its manifest (corrupt or half written)")
    return torch.load(io.BytesIO(blob), weights_only=True)


def prune(root: str, rank: int, keep: int) -> None:
    """Remove this rank's checkpoints but the newest ``keep`` (and steps no rank has files in)."""
    base = Path(root)
    steps = sorted(base.glob("step-*"))
    for where in steps[: max(0, len(steps) - keep)]:
        for suffix in (".json", ".pt"):  # the manifest first: a step without it no longer counts
            (where / f"rank-{rank}{suffix}").unlink(missing_ok=True)
        try:
            where.rmdir()  # the last rank out removes the step (ranks may share one directory)
        except OSError:
            pass


async def newest_everywhere(directory: str, rendezvous, rank: int, world: int, model_digest: str, run) -> int:
    """The newest clock at which every rank has a complete checkpoint of this model in
    ``directory``, agreed through ``rendezvous`` (``await run(fn, *args)`` does the file work).

    Raises:
        CheckpointError: no clock every rank has (the message names each rank's clocks).
    """
    clock, by_rank = await _agreed(rendezvous, "restore/clocks", world, run, directory, rank, world, model_digest)
    if clock is None:
        raise CheckpointError(
            f"rank {rank}: no checkpoint of this model and world size ({world}) in {directory} that every rank has "
            f"(complete clocks per rank: {by_rank})"
        )
    return clock


async def newest_of_rank_0(directory: str, rendezvous, rank: int, world: int, model_digest: str, run) -> tuple:
    """The newest clock at which every rank can read rank 0's complete checkpoint of this model,
    of any world size (restoring at another world size: the replicas were identical, so rank 0's
    model and optimizer are everyone's), and that checkpoint's world size.

    Raises:
        CheckpointError: none every rank can read (a directory not shared: copy rank 0's files).
    """
    clock, by_rank = await _agreed(rendezvous, "restore/rank-0-clocks", world, run, directory, 0, None, model_digest)
    if clock is None:
        raise CheckpointError(
            f"rank {rank}: no checkpoint of this model in {directory} at this world size ({world}), nor one of rank "
            f"0's at another that every rank can read (clocks of rank 0's each rank sees: {by_rank}); to change the "
            "world size, give every rank rank 0's files (step-*/rank-0.*)"
        )
    return clock, _meta(directory, clock, 0)["world"]


async def _agreed(rendezvous, name: str, world: int, run, *where) -> tuple:
    """``(newest clock in every rank's complete_clocks(*where), {rank: its clocks})``."""
    mine = await run(complete_clocks, *where)
    seen = await rendezvous.exchange(name, json.dumps(mine), range(world))
    by_rank = {r: json.loads(text) for r, text in seen.items()}
    return newest_common(by_rank), by_rank


def snapshot(clock: int, model, optimizer, plans: dict, merge_info: dict, compression: dict) -> dict:
    """One rank's state at ``clock``: the model, the optimizer, torch's RNG, the communication
    ``plans`` (``{"schemes": {layer: scheme}, "groups": {scheme: [[layer]]}, "shard": {name:
    array}}``: the scheme plan, the merge plans in force, the hosted shard's server-side state),
    the merge plan's figures and the lossy schemes' error feedback."""
    return {
        "clock": clock,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": torch.get_rng_state(),
        "schemes": plans["schemes"],
        "groups": plans["groups"],
        "merge_info": json.dumps(merge_info),
        "shard": {k: torch.from_numpy(v) for k, v in plans["shard"].items()},
        "compression": compression,
    }


def for_world(state: dict, saved_world: int, world: int, rank: int, clock: int) -> dict:
    """Rank 0's checkpoint of ``saved_world`` ranks, for ``world``: the model, the optimizer and
    the clock carry over; the plans are made again for this many ranks, and what each rank kept
    of its own (error feedback) starts from zero.

    Raises:
        CheckpointError: the shards held optimizer state (``server_sgd``), split by world size.
    """
    if len(state.get("shard") or {}):
        raise CheckpointError(
            f"rank {rank}: the checkpoint at clock {clock} holds the shards' own optimizer state (server_sgd), split "
            f"over {saved_world} ranks: restore it with {saved_world} ranks"
        )
    if (state.get("compression") or {}).get("state"):
        log.warning(
            "rank %d: restoring a checkpoint of %d ranks with %d: the lossy schemes' error feedback starts from zero",
            rank,
            saved_world,
            world,
        )
    log.warning(
        "rank %d: restoring clock %d from a checkpoint of %d ranks with %d: the model, optimizer and clock carry "
        "over; the scheme and merge plans are made again",
        rank,
        clock,
        saved_world,
        world,
    )
    return {**state, "schemes": {}, "groups": {}, "merge_info": "{}", "shard": {}, "compression": None}


def load(state: dict, model, optimizer, rng: bool = True) -> None:
    """Put a :func:`snapshot`'s model, optimizer and (``rng``) RNG state back."""
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if rng:
        torch.set_rng_state(state["rng"])
