"""A merge group as one buffer each way (train.groups) and the PS push that takes it
(PSClient.push_flat's layout): no sockets here; test_trainer runs them end to end, bitwise
against one message per layer."""

from __future__ import annotations

import asyncio

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from poseidon_aio.cluster import InformationBook, Manifest, ParamSpec
from poseidon_aio.ps import PSClient, PSConfig
from poseidon_aio.train.groups import FlatGroups
from poseidon_aio.train.layers import discover
from poseidon_aio.train.staging import Staging
from poseidon_aio.train.step import Aggregates, StepState


def layers_of(model: nn.Module) -> tuple:
    """The model's layers with manifest indices in model order, and its parameters in that order."""
    layers, at = discover(model), 0
    for layer in layers:
        layer.param_ids = list(range(at, at + len(layer.params)))
        at += len(layer.params)
    return layers, [p for layer in layers for _, p in layer.params]


def backward(model: nn.Module, width: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model.zero_grad(set_to_none=True)
    model(torch.randn(3, width, generator=g)).pow(2).sum().backward()


@settings(max_examples=40, deadline=None)
@given(
    widths=st.lists(st.integers(1, 7), min_size=3, max_size=6),
    staleness=st.integers(0, 2),
    clock=st.integers(0, 6),
    seed=st.integers(0, 1000),
)
def test_a_group_s_bucket_is_its_gradients_back_to_back_and_lands_in_the_step_s_aggregates(
    widths, staleness, clock, seed
):
    model = nn.Sequential(*[nn.Linear(a, b) for a, b in zip(widths, widths[1:])])
    layers, params = layers_of(model)
    aggregates = Aggregates(params, staleness, Staging())
    groups = FlatGroups(aggregates)
    backward(model, widths[0], seed)
    state = StepState(clock, 0.0, aggregates.of(clock))
    assert groups.made(state, layers) is None  # a backward's hook makes no buffer: the loop does
    bucket = groups.bucket(state, layers)

    grads, outs = bucket.flat
    assert grads.tobytes() == torch.cat([p.grad.reshape(-1) for p in params]).numpy().tobytes()
    assert bucket.layers == tuple(layer.index for layer in layers) and bucket.params == tuple(range(len(params)))
    assert bucket.members == tuple((layer.name, len(layer.params)) for layer in layers)
    assert bucket.priority == layers[0].index
    for g, o, p in zip(bucket.grads, bucket.outs, params):  # the arrays one by one are views of the two
        assert g.shape == o.shape == tuple(p.shape)
        assert np.shares_memory(g, grads) and np.shares_memory(o, outs)
    outs[:] = np.arange(outs.size)  # a reply received into the flat landing is the step's aggregates
    assert torch.cat([state.agg[i].reshape(-1) for i in range(len(params))]).tolist() == list(range(outs.size))

    # Copied, not aliased: the next backward leaves this step's bucket as it was; the same clock
    # a ring later gets the same buffer with the new gradients.
    sent = grads.copy()
    backward(model, widths[0], seed + 1)
    assert grads.tobytes() == sent.tobytes()
    later = clock + aggregates.slots
    again = groups.made(StepState(later, 0.0, aggregates.of(later)), layers)  # as the hook fills it
    assert again.flat[0] is grads or np.shares_memory(again.flat[0], grads)
    assert grads.tobytes() == torch.cat([p.grad.reshape(-1) for p in params]).numpy().tobytes()
    if aggregates.slots > 1:  # the next clock, still sending under SSP, has a buffer of its own
        other = groups.bucket(StepState(clock + 1, 0.0, aggregates.of(clock + 1)), layers)
        assert not np.shares_memory(other.flat[0], grads) and not np.shares_memory(other.flat[1], outs)


def test_a_parameter_with_no_gradient_sends_zeros_and_is_marked_unused():
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    layers, params = layers_of(model)
    aggregates = Aggregates(params, 0, Staging())
    backward(model, 4, 0)
    params[1].grad = None  # the first layer's bias: an unused branch
    state = StepState(0, 0.0, aggregates.of(0))
    bucket = FlatGroups(aggregates).bucket(state, layers)
    assert state.unused == {1}
    assert not bucket.grads[1].any()
    assert bucket.grads[0].tobytes() == params[0].grad.numpy().tobytes()
    assert bucket.grads[3].tobytes() == params[3].grad.numpy().tobytes()


def test_groups_that_cannot_be_one_buffer_go_layer_by_layer():
    mixed = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2).double())  # two dtypes: two buffers of aggregates
    layers, params = layers_of(mixed)
    aggregates = Aggregates(params, 0, Staging())
    for p in params:
        p.grad = torch.ones_like(p)
    assert FlatGroups(aggregates).bucket(StepState(0, 0.0, aggregates.of(0)), layers) is None

    sparse = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    layers, params = layers_of(sparse)
    aggregates = Aggregates(params, 0, Staging())
    sparse[1](sparse[0](torch.tensor([1, 2]))).sum().backward()
    assert params[0].grad.layout is torch.sparse_coo
    assert FlatGroups(aggregates).bucket(StepState(0, 0.0, aggregates.of(0)), layers) is None


shapes = st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=2).map(tuple), min_size=2, max_size=8)


@settings(max_examples=60, deadline=None)
@given(
    shape_list=shapes,
    shards=st.integers(1, 4),
    chunk=st.sampled_from([64, 256, 4096]),
    spread=st.sampled_from([0, 64, 1024]),
    data=st.data(),
)
def test_a_flat_push_s_messages_are_the_slices_the_push_of_each_array_sends(shape_list, shards, chunk, spread, data):
    manifest = Manifest(ParamSpec(f"p{i}", s) for i, s in enumerate(shape_list))
    first = data.draw(st.integers(0, len(shape_list) - 2))
    last = data.draw(st.integers(first + 1, len(shape_list) - 1))
    group = [f"p{i}" for i in range(first, last + 1)]
    book = InformationBook(manifest, workers=2, shards=shards, chunk_bytes=chunk, groups=[group], spread_bytes=spread)
    params = tuple(range(first, last + 1))

    async def layout():
        return PSClient(0, book, PSConfig(), {})._runs(params), PSClient(0, book, PSConfig(), {})._runs(params[::-1])

    found, backwards = asyncio.run(layout())
    runs, size, dtype = found
    assert size == sum(manifest[i].numel for i in params) and dtype == np.float32
    flat = np.arange(size, dtype=np.float32)
    arrays, at = {}, 0
    for i in params:
        arrays[i] = flat[at : at + manifest[i].numel]
        at += manifest[i].numel
    assert [m for m, _, _ in runs] == list(book.messages_of_params(params))
    covered = np.zeros(size, dtype=int)
    for m, lo, hi in runs:  # each message's run holds exactly the bytes its slices do, in order
        assert np.concatenate(book.slices(m, arrays)).tobytes() == flat[lo:hi].tobytes()
        covered[lo:hi] += 1
    assert (covered == 1).all()
    if any(len({book.pairs[k].param for k in m.keys}) > 1 for m, _, _ in runs):
        assert backwards is None  # given in another order, a message of several parameters is no run
