"""The rows scheme (sync/rows.py): an embedding's touched rows, all-gathered; its cost, its choice
by HybComm and which layers may take it. The codec's own tests are in test_lossy_codecs.py, the
trainer's (replicas, one process) in test_trainer.py."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from poseidon_aio.errors import ConfigError, RemoteProtocolError, SyncTimeout
from poseidon_aio.net import LocalLink
from poseidon_aio.plan import LayerShape, Link, Mode, PlanLayer, Scheme, choose_schemes, hybcomm_choice
from poseidon_aio.plan.cost import PAPER_SCHEMES, layer_cost, predicted_time
from poseidon_aio.sync import Bucket, SyncContext, syncer_class
from poseidon_aio.sync.compress import rank_order_mean
from poseidon_aio.sync.exchange import frame_key
from poseidon_aio.train.layers import discover
from poseidon_aio.wire import DType, Kind


def _syncers(world: int, timeout: float = 10.0) -> tuple:
    links = {r: {} for r in range(world)}
    for a in range(world):
        for b in range(a + 1, world):
            links[a][b], links[b][a] = LocalLink.pair(a, b)
    return [
        syncer_class(Scheme.ROWS).build(SyncContext(r, world, links[r], timeout, chunk_bytes=64)) for r in range(world)
    ], links


def _grad(rng, vocab: int, width: int, tokens: int) -> np.ndarray:
    g = np.zeros((vocab, width), np.float32)
    rows = rng.integers(0, vocab, tokens)
    g[rows] = rng.standard_normal((tokens, width)).astype(np.float32)
    return g


@settings(max_examples=30, deadline=None)
@given(
    world=st.integers(2, 4),
    vocab=st.integers(1, 30),
    width=st.integers(1, 5),
    tokens=st.integers(0, 12),
    seed=st.integers(0, 10_000),
)
def test_every_rank_gets_the_same_bits_equal_to_the_dense_rank_order_mean(world, vocab, width, tokens, seed):
    from .support.memtransport import run_async

    rng = np.random.default_rng(seed)
    grads = [_grad(rng, vocab, width, tokens if r else tokens // 2) for r in range(world)]  # rank 0 may touch none

    async def scenario():
        syncers, _ = _syncers(world)
        outs = [np.full((vocab, width), np.nan, np.float32) for _ in range(world)]  # every element is written
        results = await asyncio.gather(
            *(syncers[r].start(Bucket("embed", [0], [0], [outs[r]], grads=[grads[r]]), 3) for r in range(world))
        )
        return outs, results

    outs, results = run_async(scenario())
    for r in range(1, world):
        assert outs[r].tobytes() == outs[0].tobytes(), f"rank {r}'s result differs from rank 0's"
    # The dense all-reduce's sum, in the same order: equal (a zero's sign aside, which == ignores).
    assert np.array_equal(outs[0], rank_order_mean(grads))
    touched = [int(np.count_nonzero(g.any(axis=1))) for g in grads]
    for r, res in enumerate(results):  # each rank's rows to every peer, and every peer's to it
        assert res.bytes_sent == 4 * touched[r] * (width + 1) * (world - 1)
        assert res.bytes_received == sum(4 * touched[q] * (width + 1) for q in range(world) if q != r)


async def test_a_malformed_payload_from_a_peer_fails_the_sync_naming_layer_clock_and_rank():
    syncers, links = _syncers(2)
    grad = _grad(np.random.default_rng(0), 10, 3, 4)
    async with asyncio.timeout(30):
        task = syncers[0].start(Bucket("embed", [4], [0], [np.empty((10, 3), np.float32)], grads=[grad]), 9)
        # Rank 1 claims row 12 of a 10-row vocabulary.
        await links[1][0].send(
            Kind.PUSH,
            [np.uint32([2, 12]), np.ones((2, 3), np.float32)],
            key=frame_key(4, 0, 0),
            clock=9,
            dtype=DType.BYTES,
        )
        with pytest.raises(
            RemoteProtocolError,
            match="rank 1 sent the row 12 for the rows of layer embed at clock 9, whose vocabulary is 10 rows",
        ):
            await task


async def test_a_silent_peer_is_a_sync_timeout_naming_it():
    syncers, _ = _syncers(3, timeout=0.2)
    grad = _grad(np.random.default_rng(0), 10, 3, 4)
    with pytest.raises(SyncTimeout, match="rank 0: the rows of layer embed at clock 0: nothing from ranks \\[1, 2\\]"):
        async with asyncio.timeout(30):
            await syncers[0].start(Bucket("embed", [0], [0], [np.empty((10, 3), np.float32)], grads=[grad]), 0)


async def test_a_gradient_that_is_not_one_float32_matrix_is_refused_before_anything_is_sent():
    syncers, _ = _syncers(2)
    with pytest.raises(ConfigError, match="layer embed: the rows scheme takes one float32 vocabulary x width matrix"):
        await syncers[0].start(
            Bucket("embed", [0], [0], [np.empty(10, np.float32)], grads=[np.zeros(10, np.float32)]), 0
        )


def test_the_cost_is_k_rows_and_their_indices_to_every_peer_and_hybcomm_takes_it_where_k_is_small():
    link = Link.of_bandwidth(125e6, alpha=1e-4)
    embed = LayerShape("embed", "embedding", 1000, 128, rows=226)  # bench's transformer: 256 tokens, 226 distinct
    assert predicted_time(embed, Scheme.ROWS, 2, 2, link) == pytest.approx(1e-4 + 4 * 226 * 129 / 125e6)
    assert layer_cost(embed, 4, 4).rows == 2 * 226 * 129 * 3  # floats in and out, as Table 1 counts
    assert hybcomm_choice(embed, 2, 2, link=link) is Scheme.ROWS
    assert hybcomm_choice(embed, 4, 4, link=link) is Scheme.ROWS
    # Every row touched: the dense schemes move no more, and with fewer rounds of indices.
    assert hybcomm_choice(embed.with_rows(1000), 4, 4, link=link) is not Scheme.ROWS
    # At many workers each rank's rows go to every peer, P - 1 times: the dense all-reduce wins.
    assert hybcomm_choice(embed, 64, 64, link=link) is not Scheme.ROWS
    # Not an embedding, or no K measured: never rows. The paper's HybComm has no rows.
    assert predicted_time(LayerShape("fc", "fc", 1000, 128, rows=4), Scheme.ROWS, 2, 2, link) == float("inf")
    assert predicted_time(embed.with_rows(0), Scheme.ROWS, 2, 2, link) == float("inf")
    assert hybcomm_choice(embed, 2, 2, link=link, candidates=PAPER_SCHEMES) is Scheme.PS


def test_only_an_unshared_dense_float32_embedding_or_bag_is_row_sparse():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = nn.Embedding(50, 8), nn.Linear(8, 50, bias=False)
            self.head.weight = self.embed.weight

    by_name = lambda model: {layer.name: layer for layer in discover(model)}  # noqa: E731
    plain = by_name(nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 3)))
    assert (
        plain["0"].row_sparse
        and plain["0"].kind.value == "embedding"
        and plain["0"].shape(7) == LayerShape("0", "embedding", 50, 8, rows=7)
    )
    assert not plain["1"].row_sparse
    assert not by_name(Tied())["embed"].row_sparse  # the head's dense gradient lands in its rows too
    assert not by_name(nn.Sequential(nn.Embedding(50, 8, sparse=True)))["0"].row_sparse  # torch's own sparse gradient
    assert not by_name(nn.Sequential(nn.Embedding(50, 8).to(torch.float64)))["0"].row_sparse
    assert by_name(nn.Sequential(nn.EmbeddingBag(50, 8)))["0"].row_sparse  # a recommender's bags of rows
    assert not by_name(nn.Sequential(nn.EmbeddingBag(50, 8, sparse=True)))["0"].row_sparse


def test_a_rows_override_on_a_layer_that_is_not_an_embedding_is_refused():
    fc = PlanLayer(LayerShape("fc", "fc", 10, 8, rows=4), True)
    with pytest.raises(ConfigError, match="layer fc \\(fc\\) cannot go by rows: only an unshared float32 nn.Embedding"):
        choose_schemes([fc], {"fc": 4}, mode=Mode.POSEIDON, workers=2, shards=2, overrides={"fc": "rows"})
    embed = PlanLayer(LayerShape("embed", "embedding", 50, 8), False)
    assert choose_schemes(
        [embed], {"embed": 5}, mode=Mode.POSEIDON, workers=2, shards=2, overrides={"embed": "rows"}
    ) == {"embed": Scheme.ROWS}
