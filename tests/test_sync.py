"""The sync layer without sockets: the factor codec, HybComm's plan, Merging, host staging, kernels."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from poseidon_aio import kernels
from poseidon_aio.errors import ConfigError, RemoteProtocolError
from poseidon_aio.plan import PAPER_SCHEMES, LayerShape, Mode, PlanLayer, Scheme, choose_schemes
from poseidon_aio.sync import Bucket, Merging, SyncResult
from poseidon_aio.wire import factors
from poseidon_aio.train.staging import Staging
from poseidon_aio.wire import DType, Frame, Header, Kind


def _frame(payload: bytes, dtype=DType.FLOAT32, rank=3) -> Frame:
    return Frame(Header(Kind.FACTORS, rank, 0, 0, len(payload), dtype), memoryview(bytearray(payload)))


@settings(max_examples=50, deadline=None)
@given(k=st.integers(0, 6), m=st.integers(1, 9), n=st.integers(1, 9), seed=st.integers(0, 99))
def test_factor_payload_round_trips_for_any_rows_including_none(k, m, n, seed):
    rng = np.random.default_rng(seed)
    u, v = rng.standard_normal((k, m), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)
    payload = b"".join(bytes(memoryview(p).cast("B")) if p.size else b"" for p in factors.encode(u, v))
    assert len(payload) == factors.nbytes(k, m, n)
    du, dv = factors.decode(_frame(payload), m, n, what="layer fc at clock 0")
    assert du.shape == (k, m) and dv.shape == (k, n)
    assert du.tobytes() == u.tobytes() and dv.tobytes() == v.tobytes()


@pytest.mark.parametrize("payload,dtype", [(b"\0" * 12, DType.FLOAT32), (b"\0" * 28, DType.FLOAT64)])
def test_a_malformed_factor_payload_names_the_layer_and_the_rank(payload, dtype):
    with pytest.raises(RemoteProtocolError, match="rank 3 sent .* factors for layer fc at clock 0 \\(2x3\\)"):
        factors.decode(_frame(payload, dtype), 2, 3, what="layer fc at clock 0")


def _fc(name, m, n):
    return PlanLayer(LayerShape(name, "fc", m, n, bias=True), factorable=True)


def test_the_plan_follows_algorithm_1_and_respects_overrides():
    layers = [PlanLayer(LayerShape("conv", "conv", 1000, 1), False), _fc("fc6", 4096, 4096), _fc("head", 2, 4096)]
    paper = choose_schemes(
        layers, {"fc6": 32, "head": 32}, mode=Mode.POSEIDON, workers=8, shards=8, candidates=PAPER_SCHEMES
    )
    assert paper == {"conv": Scheme.PS, "fc6": Scheme.SFB, "head": Scheme.PS}
    # With all-reduce a candidate, the layers whose keys would sit on one shard go by it.
    plan = choose_schemes(layers, {"fc6": 32, "head": 32}, mode=Mode.POSEIDON, workers=8, shards=8)
    assert plan == {"conv": Scheme.ALLREDUCE, "fc6": Scheme.SFB, "head": Scheme.ALLREDUCE}
    assert choose_schemes(layers, {"fc6": 32}, mode=Mode.WFBP, workers=8, shards=8)["fc6"] is Scheme.PS
    forced = choose_schemes(layers, {}, mode=Mode.POSEIDON, workers=8, shards=8, overrides={"head": "adam"})
    assert forced["head"] is Scheme.ADAM and forced["fc6"] is Scheme.PS  # no K measured: PS
    with pytest.raises(ConfigError, match="conv .* cannot go by sfb"):
        choose_schemes(layers, {}, mode=Mode.POSEIDON, workers=8, shards=8, overrides={"conv": "sfb"})
    with pytest.raises(ConfigError, match="does not have: \\['nope'\\]"):
        choose_schemes(layers, {}, mode=Mode.POSEIDON, workers=8, shards=8, overrides={"nope": "ps"})
    with pytest.raises(ConfigError, match="mode 'wfbp' syncs every layer by PS"):
        choose_schemes(layers, {}, mode=Mode.WFBP, workers=8, shards=8, overrides={"fc6": "sfb"})


class _Recorder:
    scheme = Scheme.PS

    def __init__(self):
        self.started = []

    def start(self, bucket, clock):
        self.started.append((bucket, clock))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(SyncResult(bytes_sent=len(bucket.params), dropped=(2,)))
        return fut


def _bucket(layer: int) -> Bucket:
    return Bucket(
        f"l{layer}",
        [layer],
        [2 * layer, 2 * layer + 1],
        [f"o{layer}a", f"o{layer}b"],
        grads=[f"g{layer}a", f"g{layer}b"],
        priority=layer,
    )


async def test_merging_sends_a_group_once_its_last_layer_is_ready_and_the_rest_alone():
    inner = _Recorder()
    merging = Merging(inner, [[0], [1, 2, 3], [4]])
    alone = merging.start(_bucket(4), 7)
    waits = [merging.start(_bucket(layer), 7) for layer in (3, 2)]  # backward order
    assert [b.label for b, _ in inner.started] == ["l4"]
    waits.append(merging.start(_bucket(1), 7))
    (_, first), (merged, clock) = inner.started
    assert clock == 7 and merged.label == "l3..l1" and merged.layers == (1, 2, 3)
    assert merged.params == (2, 3, 4, 5, 6, 7) and merged.grads == ["g1a", "g1b", "g2a", "g2b", "g3a", "g3b"]
    assert merged.outs == ["o1a", "o1b", "o2a", "o2b", "o3a", "o3b"] and merged.priority == 1
    results = await asyncio.gather(alone, *waits)
    # The group's bytes count once; every member hears of dropped ranks.
    assert sum(r.bytes_sent for r in results[1:]) == 6 and all(r.dropped == (2,) for r in results)


async def test_merging_takes_a_whole_group_at_once_in_model_order_and_refuses_part_of_one():
    inner = _Recorder()
    merging = Merging(inner, [[0], [1, 2, 3], [4]])
    result = await merging.start_group([_bucket(layer) for layer in (3, 1, 2)], 5)  # any order
    ((merged, clock),) = inner.started
    assert clock == 5 and merged.label == "l3..l1" and merged.params == (2, 3, 4, 5, 6, 7) and result.bytes_sent == 6
    for layers in ([1, 2], [1, 2, 3, 4], [1, 1, 2, 3], [0]):
        with pytest.raises(ConfigError, match="one whole merge group"):
            merging.start_group([_bucket(layer) for layer in layers], 5)


def test_cpu_tensors_are_their_own_host_buffers():
    staging = Staging()
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    host = staging.host(("grad", 0), t)
    assert np.shares_memory(host, t.numpy()) and staging.copies_to_host == 0
    assert np.shares_memory(staging.landing(("agg", 0), t), t.numpy())


def test_staged_tensors_go_through_reused_host_buffers():
    # The GPU path's logic, run on CPU tensors (force=True): separate host buffers, explicit copies.
    staging = Staging(force=True)
    grad = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    host = staging.host(("grad", 0), grad)
    assert not np.shares_memory(host, grad.numpy()) and host.tolist() == grad.tolist()
    assert staging.host(("grad", 0), grad * 2) is not None and staging.copies_to_host == 2
    assert staging.buffer(("grad", 0), grad) is staging.buffer(("grad", 0), grad)  # made once, reused
    agg = torch.zeros(2, 3)
    landing = staging.landing(("agg", 0), agg)
    landing[:] = 5.0  # the wire writes the aggregate here...
    assert agg.sum() == 0
    staging.to_device(("agg", 0), agg)  # ...and it reaches the tensor only when copied
    staging.wait()
    assert agg.sum() == 30 and staging.copies_to_device == 1


def test_the_kernel_follows_the_result_s_device(monkeypatch):
    assert kernels.kernel_for(torch.empty(2, 2)) == "torch"
    # A CUDA tensor without CuPy still runs torch's kernel (on its device); with CuPy, CuPy's.
    cuda_like = type("T", (), {"device": torch.device("cuda", 0)})()
    monkeypatch.setattr(kernels, "cuda_available", lambda: False)
    assert kernels.kernel_for(cuda_like) == "torch"
    monkeypatch.setattr(kernels, "cuda_available", lambda: True)
    assert kernels.kernel_for(cuda_like) == "cupy"


def test_the_torch_kernel_takes_received_host_arrays():
    rng = np.random.default_rng(0)
    us = [rng.standard_normal((3, 4), dtype=np.float32) for _ in range(2)]
    vs = [rng.standard_normal((3, 5), dtype=np.float32) for _ in range(2)]
    w, b = torch.empty(4, 5), torch.empty(4)
    kernels.reconstruct(us, vs, 0.5, w, b)
    expected = sum(u.T @ v for u, v in zip(us, vs)) * 0.5
    np.testing.assert_allclose(w.numpy(), expected, rtol=1e-5)
    np.testing.assert_allclose(b.numpy(), sum(u.sum(0) for u in us) * 0.5, rtol=1e-5)


def test_hybcomm_weighs_time_on_the_measured_link_and_ties_go_to_the_paper():
    from poseidon_aio.plan import Link, hybcomm_choice

    fc = LayerShape("fc7", "fc", 4096, 4096, rows=32, bias=True)
    conv = LayerShape("conv", "conv", 3 * 3 * 64 * 64, 1)  # 147 KiB: one shard holds it all
    big_conv = LayerShape("conv5", "conv", 9 * 512 * 512, 1)  # 9 MiB: spread over every shard
    # Bytes only (the paper's accounting): SFB for the big FC layer, all-reduce for a conv layer
    # whose keys sit on one shard, and a tie (the PS spread over all shards) goes to the paper: PS.
    assert hybcomm_choice(fc, 8, 8) is Scheme.SFB
    assert hybcomm_choice(conv, 8, 8) is Scheme.ALLREDUCE
    assert hybcomm_choice(big_conv, 4, 4) is Scheme.PS
    # A slow start-up per message favours the scheme with fewer rounds: SFB's one over two.
    head = LayerShape("head", "fc", 10, 96, rows=32, bias=True)
    assert hybcomm_choice(head, 4, 4, link=Link(alpha=0.0, beta=1.0)) in (Scheme.PS, Scheme.ALLREDUCE)
    assert hybcomm_choice(head, 4, 4, link=Link(alpha=1e-3, beta=1e-9)) is Scheme.SFB


def test_every_syncer_takes_what_the_planners_know_of_its_scheme():
    # captures_factors, mergeable and rounds are the plan's vocabulary (plan.cost); each syncer
    # class reads them off its Scheme, so the planners and the runtime cannot disagree.
    from poseidon_aio.sync import syncer_class

    for scheme in Scheme:
        cls = syncer_class(scheme)
        planned = (scheme.captures_factors, scheme.mergeable, scheme.rounds)
        assert (cls.captures_factors, cls.mergeable, cls.rounds) == planned, scheme
    assert {s for s in Scheme if s.captures_factors} == {Scheme.SFB, Scheme.ADAM}
    assert {s for s in Scheme if s.mergeable} == {Scheme.PS, Scheme.ALLREDUCE, Scheme.POWERSGD, Scheme.TOPK}
    assert {s: s.rounds for s in Scheme if s.rounds != 1} == {Scheme.POWERSGD: 2}


def test_hybcomm_charges_a_merged_layer_its_bytes_and_its_group_the_start_ups():
    from poseidon_aio.plan import Link, hybcomm_choice

    link = Link.of_bandwidth(125e6, alpha=300e-6)  # 1 Gbit, a message 0.3 ms
    # A ResNet-20's head (64 -> 10, K = 32): as a message of its own SFB's one start-up beats the
    # PS's two; merged into the PS message before it, the head costs that message its bytes only.
    head = LayerShape("head", "fc", 10, 64, rows=32, bias=True)
    assert hybcomm_choice(head, 2, 2, link=link) is Scheme.SFB
    assert hybcomm_choice(head, 2, 2, link=link, merged=True) in (Scheme.PS, Scheme.ALLREDUCE)
    # Where bytes decide, merging changes nothing: a large FC layer stays SFB.
    fc = LayerShape("fc7", "fc", 4096, 4096, rows=32, bias=True)
    assert hybcomm_choice(fc, 2, 2, link=link, merged=True) is Scheme.SFB


@settings(max_examples=200, deadline=None)
@given(
    m=st.integers(1, 4096),
    n=st.integers(1, 4096),
    k=st.integers(1, 512),
    workers=st.integers(2, 16),
    alpha=st.sampled_from([0.0, 50e-6, 300e-6, 2e-3]),
)
def test_merging_only_ever_moves_a_layer_to_a_mergeable_scheme(m, n, k, workers, alpha):
    from poseidon_aio.plan import Link, hybcomm_choice

    layer = LayerShape("fc", "fc", m, n, rows=k, bias=True)
    link = Link.of_bandwidth(125e6, alpha=alpha)
    alone = hybcomm_choice(layer, workers, workers, link=link)
    merged = hybcomm_choice(layer, workers, workers, link=link, merged=True)
    if alpha == 0.0 or alone.mergeable:  # (the mergeable schemes all lose the same start-ups)
        assert merged is alone
    else:
        assert merged is alone or merged.mergeable, (alone, merged)
