"""The simulator with hosts of several workers (``Simulator(hosts=Hosts(H, L, inside))``): every
scheme crosses a host's link once, as the syncers by host do, with its terms inside the host
on either side. By hand on one layer, and as properties against the flat simulator of H workers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poseidon_aio.errors import ConfigError
from poseidon_aio.plan.cost import Hosts, Link
from poseidon_aio.wire import factors

from .support.simulation import ALPHA, BETA, RATE, B, K, M, N, T_F, _random_trace, fc_trace, run

INSIDE = Link(5e-6, 0.2e-9)  # a host's own link: a tenth of the start-up, five times the rate


def test_an_allreduce_by_host_is_the_hosts_ring_between_a_reduce_and_a_gather_inside():
    # 2 hosts x 3: the hosts exchange the layer's halves as two workers would (2 alpha + B beta),
    # after a reduce-scatter inside the host and before an all-gather there, each
    # alpha' + B (L - 1) / L beta'.
    it = run(
        fc_trace(M, N),
        6,
        rate=RATE,
        link=Link(ALPHA, BETA),
        mode="poseidon",
        hybcomm=("allreduce",),
        merge="none",
        allreduce="direct",
        hosts=Hosts(2, 3, INSIDE),
    )
    inside = INSIDE.alpha + B * 2 / 3 * INSIDE.beta
    assert it.schemes == {"fc": "allreduce"}
    assert it.time == pytest.approx(3 * T_F + inside + 2 * ALPHA + B * BETA + inside, rel=1e-12)
    assert it.link_bytes == B  # half out in the reduce-scatter, half in the all-gather


def test_sfb_by_host_sends_a_host_s_stacked_factors_once_and_rebuilds_from_every_worker():
    # 2 hosts x 2: K L rows cross once each way; the rebuild is the P K rows' GEMM.
    it = run(
        fc_trace(M, N),
        4,
        rate=RATE,
        link=Link(ALPHA, BETA),
        mode="poseidon",
        hybcomm=("sfb",),
        merge="none",
        hosts=Hosts(2, 2, INSIDE),
    )
    rows = factors.nbytes(K, M, N)
    before = INSIDE.alpha + rows * INSIDE.beta
    after = INSIDE.alpha + rows * INSIDE.beta  # (L - 1)(H - 1) = 1 other host's stack
    gemm = 2 * 4 * K * M * N / RATE
    assert it.schemes == {"fc": "sfb"}
    assert it.time == pytest.approx(T_F + before + ALPHA + 2 * rows * BETA + gemm + after, rel=1e-12)
    assert it.link_bytes == 2 * rows


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    data=st.data(),
    hosts=st.integers(2, 4),
    local=st.integers(1, 4),
    scheme=st.sampled_from([("poseidon", ("allreduce",)), ("wfbp", ("ps",))]),
)
def test_with_free_links_inside_hosts_of_l_cross_the_network_as_h_workers_do(data, hosts, local, scheme):
    # With nothing to pay inside a host, H hosts of L workers each are H workers to the network:
    # the same time and the same bytes on the busiest link, for the PS and the all-reduce alike.
    tr = _random_trace(data.draw)
    mode, hybcomm = scheme
    common = dict(rate=RATE, link=Link(ALPHA, BETA), mode=mode, hybcomm=hybcomm, merge="none", allreduce="direct")
    by_host = run(tr, hosts * local, hosts=Hosts(hosts, local), **common)
    flat = run(tr, hosts, **common)
    assert by_host.time == pytest.approx(flat.time, rel=1e-12)
    assert by_host.link_bytes == pytest.approx(flat.link_bytes, rel=1e-12)


@pytest.mark.parametrize("mode", ["wfbp", "poseidon", "ddp"])
def test_one_worker_a_host_is_the_flat_simulation(mode):
    tr = fc_trace(M, N, bias=True)
    flat = run(tr, 3, rate=RATE, link=Link(ALPHA, BETA), mode=mode)
    same = run(tr, 3, rate=RATE, link=Link(ALPHA, BETA), mode=mode, hosts=Hosts(3, 1, INSIDE))
    assert (same.time, same.link_bytes, same.schemes) == (flat.time, flat.link_bytes, flat.schemes)


def test_one_host_sends_nothing_on_the_network():
    tr = fc_trace(M, N, bias=True)
    ours = run(tr, 4, rate=RATE, link=Link(ALPHA, BETA), mode="poseidon", hosts=Hosts(1, 4, INSIDE))
    ddp = run(tr, 4, rate=RATE, link=Link(ALPHA, BETA), mode="ddp", hosts=Hosts(1, 4, INSIDE))
    assert ours.link_bytes == 0 and ours.time > ours.compute
    # DDP's ring stays on the host's own link: faster than the same ring over the network.
    assert ddp.time < run(tr, 4, rate=RATE, link=Link(ALPHA, BETA), mode="ddp").time


def test_hosts_that_do_not_add_up_to_the_workers_are_a_config_error():
    with pytest.raises(ConfigError, match="Hosts of 4 workers"):
        run(fc_trace(M, N), 4, rate=RATE, link=Link(ALPHA, BETA), hosts=Hosts(2, 3))
