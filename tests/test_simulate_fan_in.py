"""The simulator's links with fan-in (``FlowEfficiency``): what a down-link delivers with n senders
at once, by hand for the PS, the ring, DDP and SFB, and the properties that hold whatever the curve."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poseidon_aio.errors import ConfigError
from poseidon_aio.plan.cost import Link
from poseidon_aio.plan.models import trace
from poseidon_aio.plan.simulator import FlowEfficiency, Simulator, events, network
from poseidon_aio.wire import Kind

from .support.simulation import ALPHA, BETA, RATE, B, K, M, N, T_F, TEN_GBE, _random_trace, fc_trace, run

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
