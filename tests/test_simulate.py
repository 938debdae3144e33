"""The discrete-event simulator (``plan/simulator/``) and the model traces it runs on.

Hand-computed cases, agreement with the closed-form cost model where nothing overlaps, the
properties the simulator claims (monotone in bandwidth and compute for a fixed plan,
deterministic, 1 worker = compute only), and the places where it is knowingly not monotone.
"""

from __future__ import annotations

import doctest
import json
import math
import os
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poseidon_aio.cluster.book import InformationBook
from poseidon_aio.errors import ConfigError
from poseidon_aio.plan import models, simulator
from poseidon_aio.plan.cost import PAPER_SCHEMES, LayerShape, Link, Scheme, layer_cost, predicted_time
from poseidon_aio.plan.models import PRESETS, trace, trace_of
from poseidon_aio.plan.simulator import (
    DDP_FIRST_BUCKET_BYTES,
    FlowEfficiency,
    Simulator,
    events,
    iteration,
    network,
    simulate,
)
from poseidon_aio.wire import Kind

K = 32
TEN_GBE = Link.of_bandwidth(10e9 / 8, alpha=45.26e-6)


def fc_trace(m: int, n: int, *, bias: bool = False, rows: int = K):
    shapes = [(m, n), (m,)] if bias else [(m, n)]
    return trace_of("fc", [("fc", shapes, 2 * rows * m * n)], batch=rows)


def run(tr, workers, **kw):
    merge = kw.pop("merge", None)
    return Simulator(tr, workers, **kw).run(merge)


# -- hand cases: one layer, two workers ----------------------------------------------------------

M = N = 1024
RATE = 1e12
ALPHA, BETA = 50e-6, 1e-9
B = 4 * M * N  # the layer's bytes
T_F = 2 * K * M * N / RATE  # its forward


def test_one_layer_two_workers_ps_by_hand():
    # 2 MiB chunks of a 4 MiB weight: one key on each shard. Each worker pushes its peer's half
    # (alpha + B/2 beta), the shard replies with the mean (alpha + B/2 beta): 2 alpha + B beta
    # after the layer's backward (2 T_F) ends, after the forward (T_F).
    it = run(fc_trace(M, N), 2, rate=RATE, link=Link(ALPHA, BETA), mode="wfbp", chunk_bytes=B // 2)
    assert it.schemes == {"fc": "ps"}
    assert it.time == pytest.approx(3 * T_F + 2 * ALPHA + B * BETA, rel=1e-12)
    assert it.link_bytes == B // 2 * 2  # half pushed out, the other half's mean sent back
    assert it.messages == 4
    # At two workers a round of messages is one message: the cost model's time exactly.
    shape = LayerShape("fc", "fc", M, N, rows=K)
    assert it.time - it.compute == pytest.approx(
        predicted_time(shape, Scheme.PS, 2, 2, Link(ALPHA, BETA), chunk_bytes=B // 2), rel=1e-12
    )


def test_one_layer_two_workers_sfb_by_hand():
    # The factors are ready as the layer's backward begins (after the forward); one message of
    # K(M + N) floats each way, then the reconstruction, 2 P K M N FLOPs, on its own thread.
    it = run(fc_trace(M, N), 2, rate=RATE, link=Link(ALPHA, BETA), mode="poseidon", hybcomm=("sfb",), merge="none")
    assert it.schemes == {"fc": "sfb"}
    gemm = 2 * 2 * K * M * N / RATE
    assert it.time == pytest.approx(T_F + ALPHA + 4 * K * (M + N) * BETA + gemm, rel=1e-12)
    assert it.compute == pytest.approx(2 * T_F)  # no weight gradient in the backward
    assert it.link_bytes == 4 * K * (M + N)


def test_one_layer_two_workers_allreduce_by_hand():
    # Reduce-scatter: B/2 to the other owner; all-gather: the reduced B/2 back.
    it = run(
        fc_trace(M, N), 2, rate=RATE, link=Link(ALPHA, BETA), mode="poseidon", hybcomm=("allreduce",), merge="none"
    )
    assert it.schemes == {"fc": "allreduce"}
    assert it.time == pytest.approx(3 * T_F + 2 * ALPHA + B * BETA, rel=1e-12)
    assert it.messages == 4


def test_one_layer_four_workers_allreduce_round_a_ring_and_direct_by_hand():
    # Ring (a 1 MiB slice per rank, over auto's 64 KiB): 2 (P - 1) = 6 steps, each a slice of
    # B/4 from every rank to the next, one after another: 6 (alpha + B/4 beta), DDP's ring time.
    ring = run(
        fc_trace(M, N), 4, rate=RATE, link=Link(ALPHA, BETA), mode="poseidon", hybcomm=("allreduce",), merge="none"
    )
    assert ring.schemes == {"fc": "allreduce"}
    assert ring.time == pytest.approx(3 * T_F + 6 * (ALPHA + B / 4 * BETA), rel=1e-12)
    assert (ring.messages, ring.link_messages, ring.link_bytes) == (24, 6, 6 * B // 4)  # all ranks; the busiest link
    ddp = run(fc_trace(M, N), 4, rate=RATE, link=Link(ALPHA, BETA), mode="ddp")
    assert ring.time == pytest.approx(ddp.time, rel=1e-12)
    # Direct: each rank sends its three peers' slices (3 alpha + 3 B/4 beta on its up-link), then
    # each owner sends its reduced slice to three peers: the same bytes in 2 rounds.
    direct = run(
        fc_trace(M, N),
        4,
        rate=RATE,
        link=Link(ALPHA, BETA),
        mode="poseidon",
        hybcomm=("allreduce",),
        merge="none",
        allreduce="direct",
    )
    assert direct.time == pytest.approx(3 * T_F + 2 * (3 * ALPHA + 3 * B / 4 * BETA), rel=1e-12)
    assert (direct.messages, direct.link_bytes) == (24, ring.link_bytes)


def test_one_layer_two_workers_ddp_by_hand():
    # One bucket (4 MiB > DDP's 1 MiB first bucket), gloo's ring: 2 (P - 1) = 2 steps of B/2.
    it = run(fc_trace(M, N), 2, rate=RATE, link=Link(ALPHA, BETA), mode="ddp")
    assert it.time == pytest.approx(3 * T_F + 2 * (ALPHA + B / 2 * BETA), rel=1e-12)
    assert it.schemes == {"fc": "ddp"}


def test_latency_is_paid_once_by_a_fan_out_and_at_every_step_of_a_ring():
    lat = 1e-3
    ps = run(fc_trace(M, N), 4, rate=RATE, link=Link(ALPHA, BETA), mode="wfbp", chunk_bytes=B // 4)
    ps_lat = run(fc_trace(M, N), 4, rate=RATE, link=Link(ALPHA, BETA), mode="wfbp", chunk_bytes=B // 4, latency=lat)
    assert ps_lat.time - ps.time == pytest.approx(2 * lat)  # push, then reply
    ring = run(fc_trace(M, N), 4, rate=RATE, link=Link(ALPHA, BETA), mode="ddp")
    ring_lat = run(fc_trace(M, N), 4, rate=RATE, link=Link(ALPHA, BETA), mode="ddp", latency=lat)
    assert ring_lat.time - ring.time == pytest.approx(2 * 3 * lat)


# -- fan-in: what a down-link delivers with n senders at once --------------------------------------


def test_a_shard_fed_by_three_workers_at_half_rate_by_hand():
    # 4 nodes, no start-up. A push of n bytes from each of three workers into shard 0: every
    # up-link n beta, the shard's down-link 3 n beta at half the rate (three senders): 6 n beta.
    # Its reply, while the three other shards reply too: 3 n beta on its up-link, one copy after
    # another; n beta / 0.5 on each worker's down-link: the up-link binds.
    n, eff = 1 << 20, FlowEfficiency({1: 1.0, 3: 0.5})
    links = network.Links(4, Link(0.0, BETA), None, efficiency=eff)
    assert links.gather(0.0, 0, n, Kind.PUSH) == pytest.approx(6 * n * BETA, rel=1e-12)
    at = 6 * n * BETA
    replies = links.fan_out(at, 0, n, Kind.AGGREGATE, senders=3)
    assert list(replies) == pytest.approx([at, at + 3 * n * BETA, at + 3 * n * BETA, at + 3 * n * BETA], rel=1e-12)
    assert list(links.down) == pytest.approx([6 * n * BETA] + [at + 2 * n * BETA] * 3, rel=1e-12)
    ideal = network.Links(4, Link(0.0, BETA), None)
    assert ideal.gather(0.0, 0, n, Kind.PUSH) == pytest.approx(3 * n * BETA, rel=1e-12)


def test_the_ps_slows_with_its_fan_in_where_the_link_binds():
    # One key on one shard: all 7 pushes of it converge on that shard's down-link.
    ideal = run(fc_trace(M, N), 8, rate=RATE, link=Link(ALPHA, BETA), mode="naive", chunk_bytes=B)
    lossy = run(
        fc_trace(M, N),
        8,
        rate=RATE,
        link=Link(ALPHA, BETA),
        mode="naive",
        efficiency=FlowEfficiency({1: 1.0, 7: 0.5}),
        chunk_bytes=B,
    )
    assert lossy.link_bytes == ideal.link_bytes  # the same bytes, delivered slower
    assert 1.25 < lossy.exposed / ideal.exposed <= 2.0


def test_a_shard_s_pushes_are_fed_as_by_p_minus_1_over_k_senders_by_hand():
    # A message of a layer spread over k shards: each worker's pushes share its up-link k ways
    # at once, so a shard's down-link takes P - 1 senders at 1/k of the rate each, as (P - 1)/k
    # at full rate would feed it (never fewer than one).
    eff = FlowEfficiency({1: 1.0, 7: 0.5})
    nbytes = 1 << 20
    for senders, fraction in ((None, 0.5), (7 / 2, 1.0 - 0.5 * 2.5 / 6), (7 / 8, 1.0)):
        links = network.Links(8, Link(ALPHA, BETA), None, efficiency=eff)
        links.gather(0.0, 0, nbytes, Kind.PUSH, senders=senders)
        assert links.down[0] == pytest.approx(7 * nbytes * BETA / fraction, rel=1e-12)
        assert list(links.up[1:]) == pytest.approx([ALPHA + nbytes * BETA] * 7, rel=1e-12)


def test_a_ps_message_spread_over_every_shard_is_pushed_as_by_fewer_senders_by_hand():
    eff = FlowEfficiency({1: 1.0, 7: 0.5})
    nbytes = 1 << 18
    for shards, fraction in ((list(range(8)), 1.0), ([0] * 8, 0.5), ([0, 1] * 4, 1.0 - 0.5 * 2.5 / 6)):
        sim = events.Simulation([], 8, RATE, (Link(ALPHA, BETA), None, True, 0.0, eff), B)
        sim.ps(0.0, 0, [(s, nbytes) for s in shards])  # the pushes are on the links at once
        per_shard = {s: shards.count(s) for s in shards}
        for s, count in per_shard.items():
            assert sim.links.down[s] == pytest.approx(count * 7 * nbytes * BETA / fraction, rel=1e-12)


def test_the_naive_ps_takes_its_replies_as_from_every_shard_at_once_by_hand():
    # WFBP's replies of a layer on k shards come as from those k (spread over the backward); the
    # naive PS replies for every layer at the end of one backward, so a worker's down-link takes
    # them as from all P - 1 other shards. Shard 0's reply of a layer that spans 2 of 8 shards:
    eff = FlowEfficiency({1: 1.0, 7: 0.5})
    nbytes = 1 << 18
    for naive, fraction in ((False, 1.0 - 0.5 / 6), (True, 0.5)):
        sim = events.Simulation([None], 8, RATE, (Link(0.0, BETA), None, True, 0.0, eff), B, naive=naive)
        sim._reply(0.0, sim.unit([0]), 0, nbytes, 2)
        assert list(sim.links.down[1:]) == pytest.approx([nbytes * BETA / fraction] * 7, rel=1e-12)
        assert sim.links.up[0] == pytest.approx(7 * nbytes * BETA, rel=1e-12)  # one copy after another


@settings(max_examples=20, deadline=None, derandomize=True)
@given(p=st.sampled_from([3, 5, 8, 16]), pieces=st.sampled_from([1, 2, 4, 16]))
def test_a_layer_spread_over_more_shards_loses_no_more_to_its_pushes_fan_in(p, pieces):
    eff = FlowEfficiency({1: 0.9, 7: 0.6, 15: 0.5})
    one = run(fc_trace(M, N), p, rate=RATE, link=Link(ALPHA, BETA), mode="wfbp", efficiency=eff, chunk_bytes=B)
    spread = run(
        fc_trace(M, N), p, rate=RATE, link=Link(ALPHA, BETA), mode="wfbp", efficiency=eff, chunk_bytes=B // pieces
    )
    ideal = run(fc_trace(M, N), p, rate=RATE, link=Link(ALPHA, BETA), mode="wfbp", chunk_bytes=B // pieces)
    assert ideal.time <= spread.time <= one.time * (1 + 1e-9) + pieces * ALPHA


def test_a_ring_and_ddp_pay_the_one_sender_efficiency_at_every_step_by_hand():
    eff = FlowEfficiency({1: 0.8, 3: 0.1})  # a ring feeds each down-link from one sender only
    ring = run(
        fc_trace(M, N),
        4,
        rate=RATE,
        link=Link(ALPHA, BETA),
        mode="poseidon",
        hybcomm=("allreduce",),
        merge="none",
        efficiency=eff,
    )
    ddp = run(fc_trace(M, N), 4, rate=RATE, link=Link(ALPHA, BETA), mode="ddp", efficiency=eff)
    # Every step: the up-link's alpha + B/4 beta, or the down-link's B/4 beta / 0.8, which binds here.
    assert ring.time == pytest.approx(3 * T_F + 6 * max(ALPHA + B / 4 * BETA, B / 4 * BETA / 0.8), rel=1e-12)
    assert ddp.time == pytest.approx(ring.time, rel=1e-12)


def test_an_sfb_exchange_is_fed_by_every_peer_by_hand():
    eff = FlowEfficiency({1: 1.0, 3: 0.5})
    it = run(
        fc_trace(M, N),
        4,
        rate=RATE,
        link=Link(ALPHA, BETA),
        mode="poseidon",
        hybcomm=("sfb",),
        merge="none",
        efficiency=eff,
    )
    size = 4 * K * (M + N)
    # Each worker's up-link: 3 (alpha + size beta); its down-link: 3 size beta / 0.5, which binds.
    assert it.time == pytest.approx(T_F + 3 * size * BETA / 0.5 + 2 * 4 * K * M * N / RATE, rel=1e-12)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    data=st.data(),
    p=st.sampled_from([2, 3, 5, 8, 33]),
    mode=st.sampled_from(
        [("naive", {}), ("wfbp", {}), ("ddp", {}), ("poseidon", {"merge": "none", "hybcomm": ("allreduce",)})]
    ),
)
def test_an_ideal_efficiency_changes_nothing(data, p, mode):
    tr = _random_trace(data.draw)
    name, extra = mode
    base = run(tr, p, rate=1e12, link=Link(1e-5, 1e-9), mode=name, chunk_bytes=64 << 10, **extra)
    same = run(
        tr,
        p,
        rate=1e12,
        link=Link(1e-5, 1e-9),
        mode=name,
        chunk_bytes=64 << 10,
        efficiency=FlowEfficiency({1: 1.0, 7: 1.0}),
        **extra,
    )
    assert same == base


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    data=st.data(),
    p=st.sampled_from([2, 3, 5, 8, 33]),
    mode=st.sampled_from([("naive", {}), ("ddp", {}), ("poseidon", {"merge": "none", "hybcomm": ("allreduce",)})]),
    one=st.sampled_from([0.5, 0.9, 1.0]),
    many=st.sampled_from([0.3, 0.7, 1.0]),
)
def test_a_lossier_link_is_never_faster(data, p, mode, one, many):
    # As more bandwidth (test_more_bandwidth_...): where FIFO order cannot change, a down-link
    # that delivers less can only delay.
    tr = _random_trace(data.draw)
    name, extra = mode

    def at(eff=None):
        return run(
            tr, p, rate=1e12, link=Link(1e-5, 1e-9), mode=name, chunk_bytes=64 << 10, efficiency=eff, **extra
        ).time

    assert at(FlowEfficiency({1: one, max(2, p - 1): min(one, many)})) >= at() * (1 - 1e-12)


def test_flow_efficiency_interpolates_and_rejects_what_is_not_a_fraction():
    eff = FlowEfficiency.parse("1:0.96, 3:0.9,15:0.66")
    assert eff.points == {1: 0.96, 3: 0.9, 15: 0.66}
    assert (eff(1), eff(2), eff(15), eff(100)) == (0.96, pytest.approx(0.93), 0.66, 0.66)
    assert FlowEfficiency().ideal and not eff.ideal
    for bad in ({0: 0.9}, {1: 0.0}, {1: 1.5}, {1.5: 0.9}, {1: True}):
        with pytest.raises(ConfigError, match="efficiency"):
            FlowEfficiency(bad)
    with pytest.raises(ConfigError, match="senders:fraction"):
        FlowEfficiency.parse("1=0.9")
    with pytest.raises(ConfigError, match="FlowEfficiency"):
        Simulator(trace("resnet50"), 2, rate=1e12, link=TEN_GBE, efficiency={1: 0.9})


# -- agreement with the closed-form cost model (ATC'17 Table 1) ----------------------------------


@settings(max_examples=40, deadline=None, derandomize=True)
@given(p=st.integers(2, 12), m=st.sampled_from([64, 256, 1000]), width=st.integers(1, 4))
def test_naive_bytes_and_times_match_table_1_when_nothing_overlaps(p, m, width):
    # A weight of exactly P chunks: every shard holds one key, the book is balanced, and in
    # naive mode nothing overlaps: bytes on the busiest link are Table 1's per-node floats x 4
    # bytes / 2 directions, and with alpha = 0 the communication time is predicted_time's.
    n = 64 * p * width
    chunk = 4 * m * n // p
    link = Link(0.0, 1e-9)
    tr = fc_trace(m, n)
    shape = LayerShape("fc", "fc", m, n, rows=K)
    cost = layer_cost(shape, p, p)
    for scheme, floats in ((Scheme.PS, cost.ps_combined), (Scheme.SFB, cost.sfb), (Scheme.ALLREDUCE, cost.allreduce)):
        mode = (
            dict(mode="naive") if scheme is Scheme.PS else dict(mode="poseidon", hybcomm=(scheme.value,), merge="none")
        )
        it = run(tr, p, rate=RATE, link=link, chunk_bytes=chunk, **mode)
        assert it.schemes["fc"] == scheme.value
        assert it.link_bytes == pytest.approx(floats * 4 / 2, rel=1e-12)
        comm = predicted_time(shape, scheme, p, p, link, chunk_bytes=chunk)
        if scheme is Scheme.SFB:  # the reconstruction runs after the factors are in
            comm += 2 * p * K * m * n / RATE
            start = 2 * m * n * K / RATE  # the factors are ready when the forward ends
        else:
            start = 3 * 2 * m * n * K / RATE
        assert it.time == pytest.approx(start + comm, rel=1e-9)


def test_every_push_and_reply_of_the_book_is_counted_at_1024_workers_in_seconds():
    tr = trace("vgg19")
    started = time.perf_counter()
    it = run(tr, 1024, rate=6e12, link=TEN_GBE, mode="wfbp")
    assert time.perf_counter() - started < 10  # about 0.2 s here: one vector operation per message
    book = InformationBook(tr.manifest(), workers=1024, shards=1024)
    assert it.messages == 2 * 1023 * len(book.messages)
    per_node = 2 * tr.params * 4 * 1023 / 1024  # Table 1: 2MN (P1 + P2 - 2) / P2 floats, each way
    assert per_node <= it.link_bytes <= 1.06 * per_node  # the book keeps shards within 5 %


def test_all_to_all_schemes_at_1024_workers_count_every_message():
    # All-reduce: every owner of a non-empty slice gets P - 1 reduce-scatter parts and sends P - 1
    # all-gather messages (a batch norm's 128 floats have 128 owners at 1024 workers); SFB: P - 1
    # factor messages per worker. O(P^2) messages, accounted without one event each.
    tr = trace("resnet50")
    it = run(tr, 1024, rate=6e12, link=TEN_GBE, mode="poseidon", hybcomm=("allreduce",), merge="none")
    owners = sum(min(layer.params, 1024) for layer in tr)  # every slice is under a 2 MiB chunk
    assert it.messages == owners * 1023 * 2
    sfb = run(fc_trace(4096, 4096), 1024, rate=6e12, link=TEN_GBE, mode="poseidon", hybcomm=("sfb",), merge="none")
    assert sfb.messages == 1024 * 1023
    assert sfb.link_bytes == 4 * K * (4096 + 4096) * 1023


# -- properties ------------------------------------------------------------------------------------


def test_a_layer_overhead_is_paid_by_every_pass_by_hand():
    # Three layers, overhead o: one worker computes 3 x FLOPs/rate + 2 x 3 x o (a forward and a
    # backward each); two workers on the PS: the last layer (nearest the input) is ready o later
    # than without it for every pass before it, and its sync costs what it cost.
    tr = trace_of("three", [(f"fc{i}", [(M, N)], 2 * K * M * N) for i in range(3)], batch=K)
    o = 1e-3
    one = run(tr, 1, rate=RATE, link=Link(ALPHA, BETA), mode="wfbp", layer_overhead=o)
    assert one.time == one.compute == pytest.approx(3 * 3 * T_F + 6 * o, rel=1e-12)
    base = run(tr, 2, rate=RATE, link=Link(ALPHA, BETA), mode="naive")
    slow = run(tr, 2, rate=RATE, link=Link(ALPHA, BETA), mode="naive", layer_overhead=o)
    assert slow.time == pytest.approx(base.time + 6 * o, rel=1e-12)  # naive: all after the backward
    assert run(tr, 2, rate=RATE, link=Link(ALPHA, BETA), mode="poseidon", layer_overhead=0.0) == run(
        tr, 2, rate=RATE, link=Link(ALPHA, BETA), mode="poseidon"
    )


@pytest.mark.parametrize("mode", ["naive", "wfbp", "mgwfbp", "poseidon", "ddp"])
def test_one_worker_is_compute_only(mode):
    tr = trace("resnet50")
    it = run(tr, 1, rate=2e12, link=TEN_GBE, mode=mode)
    assert it.time == it.compute == pytest.approx(3 * tr.flops / 2e12)
    assert it.messages == 0 and it.link_bytes == 0


def test_a_run_is_deterministic():
    tr = trace("inception_v3")
    a = run(tr, 64, rate=6e12, link=TEN_GBE, mode="poseidon")
    b = run(tr, 64, rate=6e12, link=TEN_GBE, mode="poseidon")
    assert a == b


FIXED_PLANS = [
    ("naive", {}),
    ("wfbp", {}),
    ("ddp", {}),
    ("poseidon", {"merge": "none"}),
    ("poseidon", {"merge": "none", "hybcomm": PAPER_SCHEMES}),
]


@pytest.mark.parametrize("model", ["vgg19", "resnet50"])
@pytest.mark.parametrize("mode,extra", FIXED_PLANS)
def test_papers_models_more_bandwidth_never_slower_more_compute_never_faster(model, mode, extra):
    # Checked on every model at 2..1024 workers (350 cases) while writing this; here a sample.
    tr = trace(model)
    for p in (2, 16, 128):

        def at(bw=10e9 / 8, rate=6e12):
            return run(tr, p, rate=rate, link=Link.of_bandwidth(bw, 45.26e-6), mode=mode, **extra)

        base = at()
        faster = at(bw=20e9 / 8)
        if faster.schemes == base.schemes:  # HybComm may weigh a faster link differently
            assert faster.time <= base.time
        assert at(rate=3e12).time >= base.time


def _random_trace(draw):
    layers = []
    for i in range(draw(st.integers(1, 8))):
        if draw(st.booleans()):
            m, n = draw(st.sampled_from([16, 256, 1024, 4096])), draw(st.sampled_from([16, 256, 1024, 4096]))
            layers.append((f"fc{i}", [(m, n), (m,)], 2 * K * m * n))
        else:
            c, d, hw = (
                draw(st.sampled_from([16, 64, 256])),
                draw(st.sampled_from([16, 64, 256])),
                draw(st.sampled_from([7, 14, 56])),
            )
            layers.append((f"conv{i}", [(d, c, 3, 3), (d,)], 2 * K * c * d * 9 * hw * hw))
    return trace_of("random", layers, batch=K)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    data=st.data(),
    p=st.sampled_from([2, 3, 5, 8, 33]),
    mode=st.sampled_from([("naive", {}), ("ddp", {}), ("poseidon", {"merge": "none", "hybcomm": ("allreduce",)})]),
    alpha=st.sampled_from([0.0, 1e-5, 1e-3]),
    beta=st.sampled_from([1e-10, 1e-9, 1e-8]),
    rate=st.sampled_from([1e11, 1e13]),
    factor=st.sampled_from([0.5, 0.9, 0.99]),
)
def test_more_bandwidth_less_start_up_or_a_faster_device_never_slower(data, p, mode, alpha, beta, rate, factor):
    # Where every send waits only on compute (naive: all at the end of the backward) or every
    # link carries the same traffic (all-reduce, DDP's ring), FIFO order cannot change with the
    # link: time is a max-plus expression of alpha, beta and the compute, monotone in each.
    tr = _random_trace(data.draw)
    name, extra = mode

    def at(a=alpha, b=beta, r=rate):
        return run(tr, p, rate=r, link=Link(a, b), mode=name, chunk_bytes=64 << 10, **extra).time

    base = at()
    assert at(b=beta * factor) <= base * (1 + 1e-12)
    assert at(a=alpha * factor) <= base * (1 + 1e-12)
    assert at(r=rate * factor) >= base * (1 - 1e-12)


def test_fifo_links_can_make_ps_slower_on_a_faster_network():
    # Not a bug, a property of FIFO links (the module doc says so): on a 10 % faster network the
    # shards' reply fan-outs of fc1 are enqueued ahead of conv0's pushes they used to follow, and
    # 32 replies block the push. A random search found 4 such cases in 7 500 (wfbp and PS + SFB,
    # up to 16 %); none on the papers' models at 2-1024 workers.
    tr = trace_of(
        "hol", [("conv0", [(512, 16, 3, 3), (512,)], 924844032), ("fc1", [(16, 256), (16,)], 262144)], batch=K
    )
    slow = run(tr, 33, rate=1e13, link=Link(1e-5, 1e-9), mode="wfbp", chunk_bytes=64 << 10)
    fast = run(tr, 33, rate=1e13, link=Link(1e-5, 0.9e-9), mode="wfbp", chunk_bytes=64 << 10)
    assert fast.time > 1.1 * slow.time


# -- the trainer's plans, unchanged -----------------------------------------------------------------


def test_hybcomm_switches_fc_layers_from_sfb_where_algorithm_1_says():
    # Algorithm 1 on bytes: SFB while P <= 2MN / (K(M + N)); VGG19's fc8 (1000 x 4096): 50.
    tr = trace("vgg19")
    for p, want in ((32, "sfb"), (64, "ps")):
        it = Simulator(tr, p, rate=6e12, link=TEN_GBE, mode="poseidon", hybcomm=PAPER_SCHEMES)
        assert {layer.name: layer.scheme.value for layer in it.layers}["fc8"] == want


def test_merge_groups_are_the_trainers_planners_and_pay_off_at_64_workers():
    # bench simulate's MG-WFBP case: ResNet-50, 2 TFLOP/s, 10 Gbit/s, MG-WFBP's start-up
    # a(64) = 2 x 63 x 45.26 us on every push (what bench mgwfbp emulates).
    sim = Simulator(
        trace("resnet50"),
        64,
        rate=2e12,
        link=Link.of_bandwidth(10e9 / 8, 2 * 63 * 45.26e-6),
        mode="mgwfbp",
        costed=[Kind.PUSH],
    )
    wfbp, alg1, exact, single = (sim.run(k) for k in ("none", "algorithm1", "optimal", "single"))
    assert len(wfbp.groups["ps"]) == 107 and len(single.groups["ps"]) == 1
    assert alg1.plans["ps"]["planner"] == "algorithm1" and exact.plans["ps"]["planner"] == "optimal"
    assert [n for g in alg1.groups["ps"] for n in g] == [layer.name for layer in trace("resnet50")]
    assert wfbp.time / alg1.time >= 1.2 and wfbp.time / exact.time >= 1.2
    # The trainer's default (``best``): what its trials keep, the fastest of the three.
    default = sim.run()
    assert default.time == min(wfbp.time, alg1.time, exact.time, single.time)
    assert default.groups in (wfbp.groups, alg1.groups, exact.groups, single.groups)


@settings(max_examples=12, deadline=None)
@given(
    st.sampled_from(["resnet50", "inception_v3", "vgg19"]),
    st.sampled_from([2, 8, 32]),
    st.sampled_from([10e-6, 300e-6, 1e-3]),
    st.sampled_from([2e12, 20e12]),
)
def test_the_default_planner_is_never_slower_than_either_planner_one_message_or_no_merging(model, workers, alpha, rate):
    sim = Simulator(trace(model), workers, rate=rate, link=Link.of_bandwidth(10e9 / 8, alpha), mode="poseidon")
    default = sim.run().time
    assert all(default <= sim.run(k).time for k in ("none", "algorithm1", "optimal", "single"))


def test_bad_settings_are_config_errors():
    tr = fc_trace(64, 64)
    for kw in (
        dict(workers=0),
        dict(workers=2.5),
        dict(rate=0),
        dict(rate=float("inf")),
        dict(link=Link(-1, 1)),
        dict(mode="ring"),
        dict(hybcomm=("carrier-pigeon",)),
        dict(chunk_bytes=8),
        dict(latency=-1),
        dict(layer_overhead=-1e-6),
        dict(layer_overhead=float("nan")),
    ):
        settings_ = dict(workers=2, rate=1e12, link=Link(0, 1e-9)) | kw
        with pytest.raises(ConfigError):
            Simulator(tr, settings_.pop("workers"), **settings_)
    with pytest.raises(ConfigError, match="Trace"):
        Simulator([("fc", [(4, 4)], 32.0)], 2, rate=1e12, link=Link(0, 1e-9))
    with pytest.raises(ConfigError, match="does not merge"):
        simulate(tr, 2, rate=1e12, link=Link(0, 1e-9), mode="wfbp", merge="optimal")
    with pytest.raises(ConfigError):
        simulate(tr, 2, rate=1e12, link=Link(0, 1e-9), merge="sometimes")


def test_ddp_buckets_start_with_one_mib_then_25_mib():
    # 40 layers of 1 MiB: bucket 1 closes at 1 MiB (the last layer), then 25 layers per bucket.
    tr = trace_of("flat", [(f"l{i}", [(1 << 18,)], 1e9) for i in range(40)], batch=K)
    sim = Simulator(tr, 4, rate=1e12, link=Link(0, 1e-9), mode="ddp")
    buckets = events.ddp_bucket_layers(sim.layers)
    assert [len(b[0]) for b in buckets] == [1, 25, 14]
    assert buckets[0][1] == DDP_FIRST_BUCKET_BYTES


# -- the model traces -------------------------------------------------------------------------------


def test_models_have_the_papers_parameter_counts():
    counts = {name: sum(s.numel for s in build()) for name, build in PRESETS.items()}
    assert counts["vgg19"] == 143_667_240
    assert counts["vgg19_22k"] == 229_052_817  # ATC'17: 229 M
    assert counts["inception_v3"] == 27_161_264  # torchvision's, AuxLogits included; ATC'17: 27 M
    assert counts["resnet152"] == 60_192_808  # torchvision's; ATC'17: 60.2 M
    assert counts["resnet50"] == 25_557_032
    assert 5e6 <= counts["googlenet"] <= 7e6


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_trace_is_its_manifest_layer_by_layer(name):
    tr = trace(name, batch=8)
    assert tr.manifest() == PRESETS[name]()
    assert all(layer.flops > 0 for layer in tr)
    assert trace(name, batch=16).flops == pytest.approx(2 * tr.flops)


def test_resnet50_conv1_flops_by_hand():
    # 64 filters of 3 x 7 x 7 at 112 x 112 outputs, a multiply-add each: 2 x 118 M per sample.
    assert trace("resnet50", batch=1)[0].flops == 2 * 64 * 3 * 7 * 7 * 112 * 112


def test_bench_mgwfbp_replays_the_library_trace():
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench.mgwfbp import ROWS, resnet50_layers

    assert resnet50_layers() == list(trace("resnet50", batch=ROWS))


def test_unknown_model_or_empty_batch_is_a_config_error():
    with pytest.raises(ConfigError, match="known"):
        trace("lenet")
    with pytest.raises(ConfigError):
        trace("vgg19", batch=0)


@pytest.mark.parametrize("module", [simulator, iteration, network, events, models])
def test_docstring_examples_hold(module):
    assert doctest.testmod(module).failed == 0


def test_speedup_is_throughput_over_one_worker():
    tr = trace("resnet50")
    one = run(tr, 1, rate=6e12, link=TEN_GBE)
    it = run(tr, 8, rate=6e12, link=TEN_GBE, mode="wfbp")
    assert it.speedup(one) == pytest.approx(8 * one.time / it.time)
    assert math.isclose(it.exposed, it.time - it.compute)


def test_bench_simulate_prints_its_tables_without_matplotlib(monkeypatch, capsys, tmp_path):
    # matplotlib is an optional extra ('.[bench]'): without it the bench still prints every
    # table and its JSON line, and says where the figures would have come from.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench import simulate as bench_simulate

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = bench_simulate.main(["--models", "vgg19", "--max-workers", "4", "--sweep", "none", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert "| Poseidon |" in printed and "matplotlib is not installed" in printed
    assert printed.strip().splitlines()[-1].startswith('{"bench": "simulate"')
    assert out["figures"] == [] and not list(tmp_path.iterdir())
    assert out["speedup_mgwfbp_vs_wfbp_4_sim"] is not None


def test_bench_paper_scales_a_layer_s_matrix_and_its_factors_by_the_same_factor():
    # bench paper divides every layer's bytes and the link by s: HybComm's PS-vs-SFB comparison
    # (MN against K(M + N)) must come out as at full size, and the replayed FLOPs stay full-size.
    from bench.paper import scaled_layers

    full, scaled = scaled_layers("vgg19_22k", 32, 1), scaled_layers("vgg19_22k", 32, 16)
    assert [layer[0] for layer in full] == [layer[0] for layer in scaled]
    fc = 0
    for (_, kind, shapes, rows, flops), (_, _, shapes2, rows2, flops2) in zip(full, scaled):
        assert flops2 == flops
        if kind == "fc":
            fc += 1
            (m, n), (m2, n2) = shapes[0], shapes2[0]
            assert m * n / (m2 * n2) == pytest.approx(16, rel=0.01)
            assert rows * (m + n) / (rows2 * (m2 + n2)) == pytest.approx(16, rel=0.01)
        elif math.prod(shapes[0]) > 1 << 16:
            assert math.prod(shapes[0]) / math.prod(shapes2[0]) == pytest.approx(16, rel=0.01)
    assert fc == 3


def test_bench_paper_reports_saved_results_on_ideal_links_with_the_saved_fan_in_and_the_layer_overhead(
    monkeypatch, capsys, tmp_path
):
    # The report alone (no namespaces): the simulator beside each emulated point, on ideal links,
    # with the saved fan-in, and with the per-layer overhead one worker measured too; the JSON's
    # max error is the last column's over the points with 2 and more workers.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench import paper

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    emulated = {"inception_v3|1|wfbp": {"step_s": 0.273}, "inception_v3|4|naive": {"step_s": 0.433}}
    (tmp_path / "paper-emulated.json").write_text(json.dumps(emulated))
    (tmp_path / "paper-efficiency.json").write_text(json.dumps({"1": 0.95, "3": 0.8}))
    args = [
        "--from-json",
        str(tmp_path / "paper-emulated.json"),
        "--models",
        "inception_v3",
        "--workers",
        "1,4",
        "--out",
        str(tmp_path),
    ]
    out = paper.main(args)
    printed = capsys.readouterr().out
    assert (
        "| simulated, ideal links | error | simulated, measured fan-in | error "
        "| simulated, measured fan-in and layer overhead | error |" in printed
    )
    assert out["fan_in_efficiency"] == {1: 0.95, 3: 0.8}
    tr = trace("inception_v3", 32)
    link = Link.of_bandwidth(10e9 / 8, 50e-6)
    nominal = run(tr, 1, rate=4.2e12, link=link, mode="wfbp").time
    overhead = (0.273 - nominal) / (2 * len(tr))
    assert f"'inception_v3': {overhead * 1e6:.1f}" in printed
    # one worker with the overhead it was measured from is the emulated iteration itself
    assert run(tr, 1, rate=4.2e12, link=link, mode="wfbp", layer_overhead=overhead).time == pytest.approx(
        0.273, rel=1e-9
    )
    four = run(
        tr,
        4,
        rate=4.2e12,
        link=link,
        mode="naive",
        efficiency=FlowEfficiency({1: 0.95, 3: 0.8}),
        layer_overhead=overhead,
    ).time
    assert out["sim_vs_emulated_max_error"] == round(abs(four - 0.433) / 0.433, 3)
    ideal = paper.main([*args, "--efficiency", "ideal"])
    assert (
        ideal["fan_in_efficiency"] is None
        and ideal["sim_vs_emulated_max_error_ideal_links"] == out["sim_vs_emulated_max_error_ideal_links"]
    )
    assert "| simulated, ideal links | error | simulated, layer overhead | error |" in capsys.readouterr().out


def test_bench_paper_runs_and_simulates_a_narrowed_hybcomm_beside_the_others(monkeypatch, capsys, tmp_path):
    # "poseidon:hybcomm=ps+allreduce": the trainer's mode with HybComm's schemes narrowed; the
    # simulator beside it gets the same schemes; a setting we do not have is refused up front.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench import paper

    assert paper.impl_variant("poseidon:hybcomm=ps+allreduce") == ("poseidon", {"hybcomm": ("ps", "allreduce")})
    assert paper.impl_variant("ddp") == ("ddp", {})
    for bad in ("wfbp:hybcomm=ps", "poseidon:chunk=4", "poseidon:hybcomm", "gloo"):
        with pytest.raises(SystemExit, match="--impls"):
            paper.impl_variant(bad)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    narrowed = "poseidon:hybcomm=ps+allreduce"
    emulated = {
        "vgg19|1|wfbp": {"step_s": 0.9},
        "vgg19|8|poseidon": {"step_s": 0.91},
        f"vgg19|8|{narrowed}": {"step_s": 1.2},
    }
    (tmp_path / "paper-emulated.json").write_text(json.dumps(emulated))
    out = paper.main(
        [
            "--from-json",
            str(tmp_path / "paper-emulated.json"),
            "--models",
            "vgg19",
            "--workers",
            "1,8",
            "--impls",
            f"poseidon,{narrowed}",
            "--efficiency",
            "ideal",
            "--out",
            str(tmp_path),
        ]
    )
    printed = capsys.readouterr().out
    tr, link = trace("vgg19", 32), Link.of_bandwidth(10e9 / 8, 50e-6)
    for impl, extra, step in (("poseidon", {}, 0.91), (narrowed, {"hybcomm": ("ps", "allreduce")}, 1.2)):
        sim = run(tr, 8, rate=4.2e12, link=link, mode="poseidon", **extra).time
        assert (
            f"| vgg19 | 8 | {impl} | {step * 1e3:.0f} | {sim * 1e3:.0f} | {abs(sim - step) / step * 100:.1f} % |"
            in printed
        )
    assert (
        run(tr, 8, rate=4.2e12, link=link, mode="poseidon").time
        < run(tr, 8, rate=4.2e12, link=link, mode="poseidon", hybcomm=("ps", "allreduce")).time
    )
    assert out[f"speedup_vgg19_{narrowed}_8w"] == round(8 * 0.9 / 1.2, 2)


_SAVED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "data", "paper")


@pytest.mark.parametrize(
    "model, workers, impls",
    [
        ("vgg19", "1,2,4,8,16", "naive,wfbp,poseidon,ddp"),
        ("vgg19_22k", "1,2,4,8,16", "naive,wfbp,poseidon,ddp"),
        ("inception_v3", "1,2,4,8,16", "naive,wfbp,poseidon,ddp"),
        ("resnet152", "1,2,4,8,16", "naive,wfbp,poseidon,ddp"),
    ],
)
def test_the_simulator_stays_within_10_percent_of_the_saved_emulations(model, workers, impls, tmp_path):
    # Issue 12's validation, kept: the emulated runs of `bench paper` (bench/data/paper, 2026-11-26)
    # reported again against the simulator as it is now, with the links' fan-in and the per-layer
    # overhead those runs measured. A change of the simulator that moves any point past 10 % fails
    # here. Each point is its latest emulation. The worst is ResNet-152's WFBP at 8 (9.6 %); and
    # ResNet-152's naive PS at 16 collapsed to 2325 ms in one run of four (bench/RESULTS.md).
    from bench import paper

    out = paper.main(
        [
            "--models",
            model,
            "--workers",
            workers,
            "--impls",
            impls,
            "--out",
            str(tmp_path),
            "--from-json",
            os.path.join(_SAVED, model, "paper-emulated.json"),
        ]
    )
    assert out["fan_in_efficiency"], "the saved fan-in curve was not found beside the saved runs"
    assert out["sim_vs_emulated_max_error"] <= 0.10, out["sim_vs_emulated_max_error"]
