"""The simulator runs the trainer's plans: HybComm's scheme choice, MG-WFBP's merge groups and
the default planner, DDP's buckets."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from poseidon_aio.plan.cost import PAPER_SCHEMES, Link
from poseidon_aio.plan.models import trace, trace_of
from poseidon_aio.plan.simulator import DDP_FIRST_BUCKET_BYTES, Simulator, events
from poseidon_aio.wire import Kind

from .support.simulation import K, TEN_GBE

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


def test_ddp_buckets_start_with_one_mib_then_25_mib():
    # 40 layers of 1 MiB: bucket 1 closes at 1 MiB (the last layer), then 25 layers per bucket.
    tr = trace_of("flat", [(f"l{i}", [(1 << 18,)], 1e9) for i in range(40)], batch=K)
    sim = Simulator(tr, 4, rate=1e12, link=Link(0, 1e-9), mode="ddp")
    buckets = events.ddp_bucket_layers(sim.layers)
    assert [len(b[0]) for b in buckets] == [1, 25, 14]
    assert buckets[0][1] == DDP_FIRST_BUCKET_BYTES
