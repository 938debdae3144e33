"""KVShard on in-memory connections: aggregation order, straggler policy, protocol errors."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poseidon_aio.cluster import InformationBook, Manifest, ParamSpec
from poseidon_aio.errors import ConnectionLost
from poseidon_aio.ps import KVShard, PSConfig, StragglerPolicy, reduce_mean
from poseidon_aio.ps import tally as tally_module
from poseidon_aio.wire import DType, Kind

from .support.memtransport import connected_pair, run_async
from .support.procs import net_config


@pytest.fixture(autouse=True, params=sorted(tally_module.TALLIES))
def tally(request, monkeypatch):
    """Every test here runs on each tally built: the compiled one and its pure-Python twin."""
    monkeypatch.setattr(tally_module, "TALLY", request.param)
    return request.param


async def shard_with_workers(workers: int, book: InformationBook, config: PSConfig, seed: int = 0):
    shard = KVShard(0, book, config)
    clients = []
    for r in range(workers):
        client, server = await connected_pair(net_config(), net_config(), seed=seed + r, client_rank=r, server_rank=99)
        shard.attach(server)
        clients.append(client)
    return shard, clients


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],  # (the tally: constant)
)
@given(
    workers=st.integers(2, 5),
    order=st.randoms(use_true_random=False),
    numel=st.integers(1, 3000),
    seed=st.integers(0, 1000),
)
def test_aggregate_bits_do_not_depend_on_push_order(workers, order, numel, seed):
    async def scenario():
        book = InformationBook(Manifest([ParamSpec("w", (numel,))]), workers=workers, shards=1, chunk_bytes=1 << 30)
        shard, clients = await shard_with_workers(workers, book, PSConfig(), seed)
        grads = [
            np.random.default_rng([seed, r]).standard_normal(numel, dtype=np.float32) * 10**r for r in range(workers)
        ]
        outs = [np.empty(numel, dtype=np.float32) for _ in range(workers)]
        waits = [c.expect(Kind.AGGREGATE, 0, 0, into=o) for c, o in zip(clients, outs)]
        ranks = list(range(workers))
        order.shuffle(ranks)
        for r in ranks:
            await clients[r].send(Kind.PUSH, grads[r], key=0, clock=0, dtype=DType.FLOAT32)
            for _ in range(order.randint(0, 5)):
                await asyncio.sleep(0)
        await asyncio.gather(*waits)
        expected = reduce_mean(np.stack(grads), list(range(workers)))
        for o in outs:
            assert o.tobytes() == expected.tobytes()
        reference = np.mean(np.stack(grads).astype(np.float64), axis=0)
        np.testing.assert_allclose(outs[0], reference, rtol=1e-5, atol=1e-5 * np.abs(np.stack(grads)).max())
        for c in clients:
            await c.close()
        await shard.close()

    run_async(scenario())


async def test_deadline_finalizes_with_a_quorum_and_discards_the_late_push():
    book = InformationBook(Manifest([ParamSpec("w", (64,))]), workers=3, shards=1)
    config = PSConfig(stragglers=StragglerPolicy(deadline=0.1, quorum=2))
    shard, clients = await shard_with_workers(3, book, config)
    grads = [np.full(64, float(r + 1), dtype=np.float32) for r in range(3)]
    outs = [np.empty(64, dtype=np.float32) for _ in range(3)]
    waits = [c.expect(Kind.AGGREGATE, 0, 0, into=o) for c, o in zip(clients, outs)]
    for r in (0, 1):
        await clients[r].send(Kind.PUSH, grads[r], key=0, clock=0, dtype=DType.FLOAT32)
    await asyncio.gather(waits[0], waits[1])
    assert np.all(outs[0] == 1.5) and shard.stats.dropped == {2: 1}
    await clients[2].send(Kind.PUSH, grads[2], key=0, clock=0, dtype=DType.FLOAT32)  # too late
    await waits[2]  # the straggler still gets the aggregate it missed
    assert np.all(outs[2] == 1.5)
    while shard.stats.late_discarded == 0:
        await asyncio.sleep(0.01)
    for c in clients:
        await c.close()
    await shard.close()


async def test_quorum_not_met_keeps_waiting():
    book = InformationBook(Manifest([ParamSpec("w", (8,))]), workers=3, shards=1)
    config = PSConfig(stragglers=StragglerPolicy(deadline=0.05, quorum=3))
    shard, clients = await shard_with_workers(3, book, config)
    wait = clients[0].expect(Kind.AGGREGATE, 0, 0)
    await clients[0].send(Kind.PUSH, np.ones(8, np.float32), key=0, clock=0, dtype=DType.FLOAT32)
    await asyncio.sleep(0.2)
    assert not wait.done() and shard.pending_ranks() == {(0, 0): [1, 2]}
    for c in clients:
        await c.close()
    await shard.close()


@pytest.mark.parametrize(
    "push,match",
    [
        (dict(payload=np.ones(7, np.float32), key=0), "expects 32 bytes of float32"),
        (dict(payload=np.ones(8, np.float64)[:4], key=0, dtype=DType.FLOAT64), "the ranks' parameter shapes differ"),
        (dict(payload=np.ones(8, np.float32), key=5), "does not hold it"),
    ],
)
async def test_malformed_pushes_end_the_connection_with_the_reason(push, match):
    book = InformationBook(Manifest([ParamSpec("w", (8,))]), workers=2, shards=1)
    shard, clients = await shard_with_workers(2, book, PSConfig())
    fields = {"dtype": DType.FLOAT32, "clock": 0, **push}
    payload = fields.pop("payload")
    await clients[0].send(Kind.PUSH, payload, **fields)
    with pytest.raises(ConnectionLost, match=match):
        await clients[0].recv(timeout=5)
    for c in clients:
        await c.close()
    await shard.close()


async def test_a_push_repeated_at_a_clock_ends_that_connection_naming_it(tally):
    book = InformationBook(Manifest([ParamSpec("w", (8,))]), workers=2, shards=1)
    shard, clients = await shard_with_workers(2, book, PSConfig())
    assert type(shard._tally) is tally_module.TALLIES[tally]
    for _ in range(2):
        await clients[0].send(Kind.PUSH, np.ones(8, np.float32), key=0, clock=0, dtype=DType.FLOAT32)
    with pytest.raises(ConnectionLost, match="rank 0 sent PUSH for message 0 twice at clock 0"):
        await clients[0].recv(timeout=5)
    assert shard.pending_ranks() == {(0, 0): [1]}  # the first push still counts
    for c in clients:
        await c.close()
    await shard.close()


async def test_a_gradient_pushed_for_a_layer_the_shard_rebuilds_from_factors_is_refused():
    book = InformationBook(Manifest([ParamSpec("w", (6, 4))]), workers=2, shards=1, factored=[["w"]])
    shard, clients = await shard_with_workers(2, book, PSConfig())
    message = book.messages[0]
    await clients[0].send(Kind.PUSH, np.ones(message.nbytes // 4, np.float32), key=message.id, dtype=DType.FLOAT32)
    with pytest.raises(ConnectionLost, match="rebuilds from sufficient factors: the ranks' scheme plans differ"):
        await clients[0].recv(timeout=5)
    for c in clients:
        await c.close()
    await shard.close()


async def test_clocks_complete_out_of_order_and_finalize_in_order():
    # SSP: every worker's clock 1 is in before clock 0's last push; clock 1 waits for clock 0.
    book = InformationBook(Manifest([ParamSpec("w", (16,))]), workers=2, shards=1)
    shard, clients = await shard_with_workers(2, book, PSConfig(staleness=1))
    outs = {(r, t): np.empty(16, np.float32) for r in range(2) for t in range(2)}
    waits = [c.expect(Kind.AGGREGATE, 0, t, into=outs[(r, t)]) for r, c in enumerate(clients) for t in range(2)]
    await clients[0].send(Kind.PUSH, np.full(16, 1.0, np.float32), key=0, clock=0, dtype=DType.FLOAT32)
    for r, c in enumerate(clients):
        await c.send(Kind.PUSH, np.full(16, 10.0 * (r + 1), np.float32), key=0, clock=1, dtype=DType.FLOAT32)

    async def both_open():
        while len(shard.pending_ranks()) < 2:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(both_open(), timeout=10)
    assert shard.pending_ranks() == {(0, 0): [1], (0, 1): []} and shard.stats.finalized == 0
    await clients[1].send(Kind.PUSH, np.full(16, 3.0, np.float32), key=0, clock=0, dtype=DType.FLOAT32)
    await asyncio.wait_for(asyncio.gather(*waits), timeout=10)
    assert all(np.all(outs[(r, 0)] == 2.0) and np.all(outs[(r, 1)] == 15.0) for r in range(2))
    assert shard.stats.finalized == 2 and not shard.pending_ranks()
    for c in clients:
        await c.close()
    await shard.close()


async def test_adaptive_deadline_learns_from_arrival_spread():
    import time

    book = InformationBook(Manifest([ParamSpec("w", (16,))]), workers=3, shards=1)
    policy = StragglerPolicy(deadline="adaptive", quorum=2, factor=3.0, min_deadline=0.05, max_deadline=5.0)
    shard, clients = await shard_with_workers(3, book, PSConfig(stragglers=policy))
    grads = np.ones(16, dtype=np.float32)
    for clock in range(4):  # everyone prompt: the spread it learns is milliseconds
        waits = [c.expect(Kind.AGGREGATE, 0, clock) for c in clients]
        for c in clients:
            await c.send(Kind.PUSH, grads, key=0, clock=clock, dtype=DType.FLOAT32)
        await asyncio.gather(*waits)
    assert shard.stats.dropped == {}
    started = time.monotonic()
    wait = clients[0].expect(Kind.AGGREGATE, 0, 4)
    for c in clients[:2]:  # rank 2 never comes
        await c.send(Kind.PUSH, grads, key=0, clock=4, dtype=DType.FLOAT32)
    await wait
    assert 0.045 <= time.monotonic() - started < 1.0 and shard.stats.dropped == {2: 1}
    for c in clients:
        await c.close()
    await shard.close()


async def test_a_worker_that_never_connects_is_ejected_and_its_outbox_stays_bounded():
    # Before this bound, a shard under a straggler policy queued every reply for a worker that
    # never came: ~4 KiB a clock here, ~64 KiB a clock for a small CNN, without end.
    numel = 1024
    book = InformationBook(Manifest([ParamSpec("w", (numel,))]), workers=3, shards=1)
    limit = 3 * numel * 4
    config = PSConfig(stragglers=StragglerPolicy(deadline=0.05, quorum=2), outbox_bytes=limit)
    shard = KVShard(0, book, config)
    clients = []
    for r in range(2):  # rank 2 never attaches
        client, server = await connected_pair(net_config(), net_config(), seed=r, client_rank=r, server_rank=99)
        shard.attach(server)
        clients.append(client)
    grad = np.ones(numel, dtype=np.float32)
    for clock in range(8):
        waits = [c.expect(Kind.AGGREGATE, 0, clock) for c in clients]
        for c in clients:
            await c.send(Kind.PUSH, grad, key=0, clock=clock, dtype=DType.FLOAT32)
        await asyncio.gather(*waits)
        assert shard.outbox_bytes(2) <= limit
    assert shard.stats.ejected == [2] and shard.outbox_bytes(2) == 0
    assert shard.stats.finalized == 8
    # It is told why if it comes after all.
    late, server = await connected_pair(net_config(), net_config(), client_rank=2, server_rank=99)
    shard.attach(server)
    with pytest.raises(ConnectionLost, match="ejected rank 2"):
        await late.recv(timeout=10)
    for c in [*clients, late]:
        await c.close()
    await shard.close()


async def test_a_worker_that_stops_reading_fails_the_job_naming_it_under_bsp():
    numel = 64 * 1024  # 256 KiB a reply
    book = InformationBook(Manifest([ParamSpec("w", (numel,))]), workers=2, shards=1, chunk_bytes=1 << 20)
    shard = KVShard(0, book, PSConfig(outbox_bytes=2 * numel * 4))
    small = dict(write_high_water=256 * 1024, write_low_water=64 * 1024)
    clients, servers = [], []
    for r in range(2):
        client, server = await connected_pair(net_config(), net_config(**small), seed=r, client_rank=r, server_rank=99)
        shard.attach(server)
        clients.append(client)
        servers.append(server)
    clients[1]._transport.pause_reading()  # rank 1 hangs: it still pushes, but reads nothing
    grad = np.ones(numel, dtype=np.float32)
    notice = None
    for clock in range(40):
        wait = clients[0].expect(Kind.AGGREGATE, 0, clock)
        for c in clients:
            await c.send(Kind.PUSH, grad, key=0, clock=clock, dtype=DType.FLOAT32)
        await wait
        assert shard.outbox_bytes(1) <= 2 * numel * 4
        # The shard gives up on rank 1 while it replies to both for a clock; the notice to rank 0
        # follows that clock's aggregate on the same link.
        if servers[1].error is not None:
            notice = await clients[0].recv(timeout=10)
            break
    assert notice is not None and notice.kind is Kind.CONTROL, "the shard never gave up on rank 1"
    text = bytes(notice.payload).decode()
    assert '"failed"' in text and "rank 1 fell" in text and "outbox bound" in text
    assert "outbox bound" in str(servers[1].error)
    for c in clients:
        c.abort()
    await shard.close()


async def test_project_adam_goes_through_the_clock_straggler_and_late_path():
    m, n, k = 6, 4, 3
    book = InformationBook(
        Manifest([ParamSpec("w", (m, n)), ParamSpec("b", (m,))]), workers=3, shards=1, factored=[["w", "b"]]
    )
    config = PSConfig(stragglers=StragglerPolicy(deadline=0.05, quorum=2))
    shard, clients = await shard_with_workers(3, book, config)
    key = book.messages[0].id
    rng = np.random.default_rng(0)
    us = [rng.standard_normal((k, m), dtype=np.float32) for _ in range(3)]
    vs = [rng.standard_normal((k, n), dtype=np.float32) for _ in range(3)]
    outs = [[np.empty(msg.nbytes // 4, np.float32) for msg in book.messages] for _ in range(2)]
    waits = [
        c.expect(Kind.AGGREGATE, msg.id, 0, into=o)
        for c, out in zip(clients, outs)
        for msg, o in zip(book.messages, out)
    ]
    for r in (0, 1):  # rank 2 is late: dropped after the deadline, as a push would be
        await clients[r].send(Kind.FACTORS, [us[r], vs[r]], key=key, clock=0, dtype=DType.FLOAT32)
    await asyncio.gather(*waits)
    assert len(book.messages) == 1  # one unit, one shard, one message: weight then bias
    weight = outs[0][0][: m * n].reshape(m, n)
    np.testing.assert_allclose(weight, (us[0].T @ vs[0] + us[1].T @ vs[1]) / 2, rtol=1e-5)
    assert shard.stats.dropped == {2: 1}
    await clients[2].send(Kind.FACTORS, [us[2], vs[2]], key=key, clock=0, dtype=DType.FLOAT32)
    while shard.stats.late_discarded == 0:  # discarded, never rebuilt into clock 0 again
        await asyncio.sleep(0.01)
    # A payload that is not K rows of M + N floats ends that connection, naming the layer.
    await clients[1].send(Kind.FACTORS, np.ones(7, np.float32), key=key, clock=1, dtype=DType.FLOAT32)
    with pytest.raises(ConnectionLost, match="factors for w at clock 1 \\(6x4\\)"):
        while True:  # past the notice that rank 2 was dropped from clock 0
            await clients[1].recv(timeout=5)
    for c in clients:
        await c.close()
    await shard.close()


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    workers=st.integers(1, 5),
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_reduce_mean_is_the_rank_ordered_sum_divided(workers, data, seed):
    # The bits replicas agree on: ((s_a + s_b) + s_c) / n in the contributors' order, however
    # many passes the sum takes.
    contributors = sorted(data.draw(st.sets(st.integers(0, workers - 1), min_size=1)))
    slots = np.random.default_rng(seed).standard_normal((workers, 257)).astype(np.float32)
    expected = slots[contributors[0]].copy()
    for r in contributors[1:]:
        expected = expected + slots[r]
    expected = expected / np.float32(len(contributors))
    out = np.empty(257, dtype=np.float32)
    assert reduce_mean(slots, contributors, out) is out
    assert np.array_equal(out, expected)
    assert np.array_equal(reduce_mean(slots, contributors), expected)


def test_server_state_of_other_sizes_is_refused_naming_the_messages():
    # A trainer checkpoint keeps the shard's own optimizer state by message id; a book that cuts
    # the messages otherwise (another model, plan or release) must not take it silently.
    from poseidon_aio.errors import CheckpointError
    from poseidon_aio.ps.config import ServerSGD
    from poseidon_aio.ps.sgd import ServerOptimizer

    opt = ServerOptimizer(ServerSGD(lr=0.1), 2, {0: np.dtype(np.float32), 1: np.dtype(np.float32)})
    state = {f"{k}{m}": np.zeros(n, np.float32) for m, n in ((0, 4), (1, 3)) for k in "wv"}
    with pytest.raises(CheckpointError, match=r"shard 2: the saved state has other sizes for messages \[1\]"):
        opt.load(state, {0: 4, 1: 5})
    with pytest.raises(CheckpointError, match=r"no parameters for messages \[7\]"):
        opt.load(state, {0: 4, 7: 3})
    opt.load(state, {0: 4, 1: 3})
    assert opt.has(0) and opt.values(1).shape == (3,)
