"""The parameter server across real worker processes on loopback (2-4 workers, 1-4 shards)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poseidon_aio.ps import PSConfig, ServerSGD, StragglerPolicy

from .support.cluster import collect, run_workers, start_workers
from .support.psworkers import (
    aggregate_worker,
    grad,
    leaving_worker,
    mismatch_worker,
    sgd_worker,
    ssp_worker,
    stalled_worker,
    straggler_worker,
)

pytestmark = pytest.mark.slow

SHAPES = [(300, 200), (17,), (500, 130), (5,)]


def _reference(world: int, clock: int, i: int, shapes=SHAPES) -> np.ndarray:
    return np.mean([grad(r, clock, i, shapes[i]).astype(np.float64) for r in range(world)], axis=0)


@pytest.mark.parametrize("workers,shards", [(2, 1), (3, 2), (4, 4)])
def test_aggregates_match_float64_and_are_bitwise_identical_on_every_worker(workers, shards):
    config = PSConfig(shards=shards, chunk_bytes=64 * 1024)
    res = run_workers(workers, aggregate_worker, SHAPES, 2, config, 1)
    for (clock, i), agg in res[0][0].items():
        ref = _reference(workers, clock, i)
        # float32 rounding of a mean of `workers` terms, relative to their magnitude.
        np.testing.assert_allclose(agg, ref, rtol=0, atol=4 * workers * np.finfo(np.float32).eps * 4)
        for r in range(1, workers):
            assert agg.tobytes() == res[r][0][(clock, i)].tobytes(), f"rank {r} differs at clock {clock} param {i}"
    assert res[0][1] < 1.5


def test_arrival_order_does_not_change_a_bit():
    config = PSConfig(shards=2, chunk_bytes=32 * 1024)
    first = run_workers(3, aggregate_worker, SHAPES, 1, config, 11)[0][0]
    second = run_workers(3, aggregate_worker, SHAPES, 1, config, 12)[0][0]
    assert all(first[k].tobytes() == second[k].tobytes() for k in first)


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    staleness=st.integers(0, 2),
    schedules=st.lists(
        st.lists(
            st.lists(st.sampled_from([0.0, 0.0, 0.005, 0.02, 0.06]), min_size=4, max_size=4), min_size=3, max_size=3
        ),
        min_size=2,
        max_size=3,
    ),
)
def test_ssp_bound_holds_under_generated_delay_schedules(staleness, schedules):
    shapes = [(40, 30), (7,)]
    config = PSConfig(staleness=staleness, shards=2, chunk_bytes=2048)
    res = run_workers(3, ssp_worker, shapes, config, schedules, timeout=120)
    for rank, (seen, results) in res.items():
        for clock, complete in seen:
            # A worker at clock t proceeds only when every aggregate up to t - s - 1 is in.
            assert complete >= clock - staleness - 1, (rank, clock, complete)
        assert results == res[0][1], f"rank {rank}'s aggregates differ"
    for (clock, i), agg in res[0][1].items():
        got = np.frombuffer(agg, dtype=np.float32).reshape(shapes[i])
        np.testing.assert_allclose(got, _reference(3, clock, i, shapes), atol=1e-5)


def test_a_straggler_is_dropped_reported_and_its_late_push_discarded():
    shapes = [(64, 32)]
    # 2 s: far more than a loaded machine puts between prompt ranks, so only the held-back push
    # of clock 1 is ever dropped.
    config = PSConfig(shards=1, stragglers=StragglerPolicy(deadline=2.0, quorum=2))
    clocks = 6
    res = run_workers(3, straggler_worker, shapes, config, 2, 1, clocks, timeout=120)
    out0, dropped0, late0 = res[0]
    # Clock 1 finalized without rank 2: the mean over ranks 0 and 1, reported to everyone.
    expected = np.mean([grad(r, 1, 0, shapes[0]).astype(np.float64) for r in (0, 1)], axis=0)
    np.testing.assert_allclose(np.frombuffer(out0[(1, 0)], np.float32).reshape(shapes[0]), expected, atol=1e-6)
    assert all(res[r][1].get(1) == {2} for r in range(3))
    # Before it stalled, and once it has caught up (it skips no work), everyone contributes again.
    assert all(not res[r][1].get(c) for r in range(3) for c in (0, clocks - 1))
    assert late0 >= 1  # shard 0 (on rank 0) counted the late push
    assert res[2][0] == out0  # the straggler ends with the same aggregates


def test_checkpoint_kill_restart_is_bitwise_equal_to_an_uninterrupted_run(tmp_path):
    shapes = [(50, 40), (40,), (10, 3)]
    sgd = ServerSGD(lr=0.05, momentum=0.9, weight_decay=1e-4)

    def config(path):
        return PSConfig(shards=2, chunk_bytes=2048, server_sgd=sgd, checkpoint_dir=str(path), checkpoint_every=2)

    clean = run_workers(2, sgd_worker, shapes, config(tmp_path / "clean"), 7, None)
    procs, out = start_workers(2, sgd_worker, shapes, config(tmp_path / "crash"), 7, 4)
    for p in procs:
        p.join(90)
    assert [p.exitcode for p in procs] == [137, 137]
    resumed = run_workers(2, sgd_worker, shapes, config(tmp_path / "crash"), 7, None)
    for r in range(2):
        start, was_resumed, final = resumed[r]
        assert was_resumed and start in (2, 4)
        assert final == clean[r][2]
    assert clean[0][2] == clean[1][2]


def test_manifest_mismatch_fails_every_rank_naming_the_parameter():
    shapes = {0: [(4, 3), (3,)], 1: [(4, 3), (4,)]}
    procs, out = start_workers(2, mismatch_worker, shapes)
    errors = collect(procs, out, timeout=60, expect_errors=True)
    assert set(errors) == {0, 1}
    for kind, message, _ in errors.values():
        assert kind == "ManifestMismatch"
        assert "rank 1" in message and "p1 [3] float32 vs p1 [4] float32" in message


def test_a_worker_that_dies_fails_the_others_quickly_naming_it():
    procs, out = start_workers(3, leaving_worker, [(20, 10)], PSConfig(shards=1, sync_timeout=60), 2)
    errors = collect(procs, out, timeout=45, expect_errors=True)
    assert errors[0][0] == "WorkerLeft" and "rank 2 left the job" in errors[0][1]
    # Rank 1 hears it from the shard too, or loses the shard when rank 0 (its host) gives up.
    assert errors[1][0] in ("WorkerLeft", "ConnectionLost")


def test_a_stalled_sync_times_out_with_the_shards_report():
    procs, out = start_workers(2, stalled_worker, [(20, 10)], PSConfig(shards=1, sync_timeout=2.0), 6.0)
    errors = collect(procs, out, timeout=60, expect_errors=True)
    kind, message, _ = errors[0]
    assert kind == "SyncTimeout" and "p0" in message and "waiting for ranks [1]" in message


def test_standalone_shard_processes_serve_the_workers():
    from .support.cluster import free_port
    from .support.psworkers import shard_process

    port = free_port()
    config = PSConfig(shards=2, standalone_shards=True, chunk_bytes=64 * 1024)
    workers, wout = start_workers(3, aggregate_worker, SHAPES, 2, config, 3, port=port)
    shards, sout = start_workers(2, shard_process, 0, 3, port=port, env={"RANK": "0", "WORLD_SIZE": "3"})
    res = collect(workers, wout, timeout=90)
    stats = collect(shards, sout, timeout=30)
    for (clock, i), agg in res[0][0].items():
        np.testing.assert_allclose(agg, _reference(3, clock, i), atol=1e-5)
        assert all(agg.tobytes() == res[r][0][(clock, i)].tobytes() for r in (1, 2))
    from poseidon_aio.cluster import InformationBook

    from .support.psworkers import manifest_of

    book = InformationBook(manifest_of(SHAPES), workers=3, shards=2, chunk_bytes=64 * 1024)
    assert sum(s["finalized"] for s in stats.values()) == 2 * len(book.messages)  # 2 clocks, every message
