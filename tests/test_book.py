"""Information book, manifest and checkpoints: pure functions, no sockets."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from poseidon_aio.cluster import InformationBook, Manifest, ManifestMismatch, ParamSpec
from poseidon_aio.cluster.book import GROUP_RUNS, PIPELINE_MIN_BYTES, PIPELINE_RUN_S, pipeline_bytes_for
from poseidon_aio.cluster.manifest import first_difference
from poseidon_aio.plan.models import PRESETS, resnet50, vgg19
from poseidon_aio.errors import ConfigError
from poseidon_aio.ps import PSConfig, checkpoint

shapes = st.lists(st.lists(st.integers(1, 60), min_size=1, max_size=3).map(tuple), min_size=1, max_size=12)


def manifest(shape_list, dtype="float32") -> Manifest:
    return Manifest(ParamSpec(f"layer{i}.weight", s, dtype) for i, s in enumerate(shape_list))


@settings(max_examples=80, deadline=None)
@given(
    shape_list=shapes,
    workers=st.integers(1, 8),
    shards=st.integers(1, 8),
    chunk=st.sampled_from([256, 1000, 4096, 1 << 20]),
)
def test_every_element_in_exactly_one_pair_no_pair_over_the_chunk(shape_list, workers, shards, chunk):
    m = manifest(shape_list)
    book = InformationBook(m, workers=workers, shards=shards, chunk_bytes=chunk)
    for index, spec in enumerate(m):
        pairs = [p for p in book.pairs if p.param == index]
        assert [p.offset for p in pairs] == list(np.cumsum([0] + [p.numel for p in pairs])[:-1])
        assert sum(p.numel for p in pairs) == spec.numel
    assert all(p.nbytes <= max(chunk, 4) for p in book.pairs)
    assert all(0 <= p.shard < shards for p in book.pairs)
    # Messages: each key in exactly one, all keys of a message on its shard, none over the chunk.
    keys = sorted(k for msg in book.messages for k in msg.keys)
    assert keys == list(range(len(book.pairs)))
    assert all(book.pairs[k].shard == msg.shard for msg in book.messages for k in msg.keys)
    assert all(msg.nbytes <= chunk or len(msg.keys) == 1 for msg in book.messages)
    # Deterministic: recomputing (as every rank does) gives the same digest.
    again = InformationBook(manifest(shape_list), workers=workers, shards=shards, chunk_bytes=chunk)
    assert again.digest() == book.digest()


@settings(max_examples=40, deadline=None)
@given(shape_list=shapes, shards=st.integers(1, 8))
def test_balanced_placement_is_within_one_pair_of_the_mean(shape_list, shards):
    book = InformationBook(manifest(shape_list), workers=4, shards=shards, chunk_bytes=4096)
    load = book.shard_bytes()
    largest_pair = max(p.nbytes for p in book.pairs)
    assert max(load) <= sum(load) / shards + largest_pair


@settings(max_examples=150, deadline=None)
@given(
    shape_list=st.lists(st.lists(st.integers(1, 300), min_size=1, max_size=2).map(tuple), min_size=1, max_size=20),
    dtypes=st.lists(st.sampled_from(["float32", "float16", "float64"]), min_size=20, max_size=20),
    shards=st.integers(1, 8),
    chunk=st.sampled_from([4096, 65536, 2 << 20]),
)
def test_every_model_is_balanced_within_5_percent_for_at_most_p2_minus_1_more_pairs(shape_list, dtypes, shards, chunk):
    m = Manifest(ParamSpec(f"t{i}", s, dtypes[i]) for i, s in enumerate(shape_list))
    assume(m.total_bytes >= shards * 8 * 20)  # at least 20 of the widest items per shard: splittable
    book = InformationBook(m, workers=8, shards=shards, chunk_bytes=chunk)
    assert book.max_over_mean() <= 1.05 + 8 * shards / m.total_bytes  # one item of rounding
    chunked = sum(-(-s.nbytes // chunk) for s in m)  # pairs the chunking alone makes
    assert len(book.pairs) <= chunked + shards - 1
    for index, spec in enumerate(m):  # every element in exactly one pair, in offset order
        pairs = [p for p in book.pairs if p.param == index]
        assert [p.offset for p in pairs] == list(np.cumsum([0] + [p.numel for p in pairs])[:-1])
        assert sum(p.numel for p in pairs) == spec.numel


def test_a_small_cnn_gets_each_shard_its_share():
    # The digits CNN: 71 754 parameters in 8 tensors, all far under a 2 MiB chunk.
    specs = [((16, 1, 3, 3),), ((16,),), ((32, 16, 3, 3),), ((32,),), ((128, 512),), ((128,),), ((10, 128),), ((10,),)]
    m = Manifest(ParamSpec(f"p{i}", s[0]) for i, s in enumerate(specs))
    whole = max(s.nbytes for s in m) / (m.total_bytes / 4)  # the largest tensor alone: 3.65 x a share
    book = InformationBook(m, workers=4, shards=4)
    assert whole > 3 and book.max_over_mean() <= 1.05 and len(book.pairs) <= len(m) + 3


def test_vgg19_over_8_shards_is_balanced_where_one_tensor_per_shard_is_not():
    balanced = InformationBook(vgg19(), workers=8, shards=8)
    tensor = InformationBook(vgg19(), workers=8, shards=8, placement="tensor")
    assert balanced.max_over_mean() <= 1.05
    assert tensor.max_over_mean() > 3  # fc6's 411 MB weight lands on one shard
    assert sum(s.numel for s in vgg19()) == 143_667_240


def test_resnet50_has_its_real_layer_count_and_size():
    m = resnet50()
    assert len(m) == 161 and sum(s.numel for s in m) == 25_557_032


def test_queries():
    book = InformationBook(manifest([(1000, 1000), (10,)]), workers=2, shards=3, chunk_bytes=1 << 20)
    pairs = book.keys_of("layer0.weight")
    # Four 1 MiB chunks over 3 shards would leave one shard twice the others: two are split.
    assert 4 <= len(pairs) <= 6 and {p.shard for p in pairs} == {0, 1, 2} and book.max_over_mean() <= 1.05
    assert book.shard_of(pairs[0].key) == pairs[0].shard
    assert book.message_of(pairs[0].key).keys == (pairs[0].key,)
    assert [m.id for m in book.messages_of_params([1])] == [book.message_of(book.keys_of("layer1.weight")[0].key).id]


@settings(max_examples=60, deadline=None)
@given(shape_list=shapes, shards=st.integers(1, 6), chunk=st.sampled_from([256, 1000, 4096]), asks=st.integers(1, 3))
def test_a_layers_messages_and_slices_cover_it_exactly_however_often_asked(shape_list, shards, chunk, asks):
    # The trainer asks the book about every layer on every step (answers kept after the first).
    book = InformationBook(manifest(shape_list), workers=2, shards=shards, chunk_bytes=chunk)
    flat = {i: np.arange(s.numel, dtype=np.float32) for i, s in enumerate(book.manifest)}
    for _ in range(asks):
        for i in range(len(shape_list)):
            messages = book.messages_of_params([i])
            assert messages == tuple(m for m in book.messages if any(book.pairs[k].param == i for k in m.keys))
            pieces = sorted((int(v[0]), v.size) for m in messages for v in book.slices(m, flat) if v.size)
            covered = np.concatenate([np.arange(start, start + n) for start, n in pieces])
            assert np.array_equal(covered, flat[i].astype(np.int64))  # every element once, in order


@settings(max_examples=150, deadline=None)
@given(
    shape_list=st.lists(st.lists(st.integers(1, 300), min_size=1, max_size=2).map(tuple), min_size=2, max_size=20),
    cuts=st.lists(st.booleans(), min_size=20, max_size=20),
    shards=st.integers(1, 6),
    chunk=st.sampled_from([4096, 65536, 2 << 20]),
)
def test_a_small_layer_is_one_message_and_the_shards_stay_balanced(shape_list, cuts, shards, chunk):
    m = manifest(shape_list)
    assume(m.total_bytes >= shards * 4 * 20)  # splittable, as the 5 % test assumes
    layers, current = [], [m[0].name]
    for spec, cut in zip(list(m)[1:], cuts):  # consecutive parameters, cut into layers at random
        if cut:
            layers.append(current)
            current = []
        current.append(spec.name)
    layers.append(current)
    plain = InformationBook(m, workers=2, shards=shards, chunk_bytes=chunk)
    book = InformationBook(m, workers=2, shards=shards, chunk_bytes=chunk, layers=layers)
    small = [names for names in layers if len(names) > 1 and sum(m[m.index(n)].nbytes for n in names) <= chunk]
    assert book.layers == tuple(tuple(names) for names in small)
    assert book.max_over_mean() <= 1.05 + 4 * shards / m.total_bytes  # as balanced as without layers
    # Every element in exactly one pair; messages on their keys' shard, none over the chunk.
    for index, spec in enumerate(m):
        pairs = [p for p in book.pairs if p.param == index]
        assert [p.offset for p in pairs] == list(np.cumsum([0] + [p.numel for p in pairs])[:-1])
        assert sum(p.numel for p in pairs) == spec.numel
    assert sorted(k for msg in book.messages for k in msg.keys) == list(range(len(book.pairs)))
    assert all(book.pairs[k].shard == msg.shard for msg in book.messages for k in msg.keys)
    assert all(msg.nbytes <= chunk or len(msg.keys) == 1 for msg in book.messages)
    # A small layer travels in one message, two where a split evened the shards out (at most
    # P2 - 1 splits in all); every other parameter as without layers.
    per_layer = [len(book.messages_of_params([m.index(n) for n in names])) for names in small]
    assert all(n >= 1 for n in per_layer) and sum(per_layer) <= len(small) + shards - 1
    assert len(book.messages) <= len(plain.messages) - sum(len(names) - 1 for names in small) + shards - 1


def test_a_layer_over_a_chunk_or_in_a_group_is_placed_as_without_layers():
    m = manifest([(600, 1000), (600,), (10, 10), (10,), (4, 4), (4,)])
    layers = [
        ["layer0.weight", "layer1.weight"],
        ["layer2.weight", "layer3.weight"],
        ["layer4.weight", "layer5.weight"],
    ]
    groups = [["layer2.weight", "layer3.weight"]]
    book = InformationBook(m, workers=2, shards=2, groups=groups, layers=layers)
    assert book.layers == (("layer4.weight", "layer5.weight"),)  # 2.4 MB over the chunk; a merge group
    assert len(book.messages_of_params([4, 5])) == 1
    assert len(book.messages_of_params([0])) == len(book.keys_of("layer0.weight"))


def test_merge_groups_pack_small_layers_per_shard():
    m = manifest([(8,)] * 6)
    solo = InformationBook(m, workers=2, shards=2)
    merged = InformationBook(m, workers=2, shards=2, groups=[[s.name for s in m]])
    assert len(solo.messages) == 6 and len(merged.messages) == 1  # one shard, one frame
    assert len({p.shard for p in solo.pairs}) == 2 and len({p.shard for p in merged.pairs}) == 1
    assert [(p.param, p.offset, p.numel) for p in solo.pairs] == [(p.param, p.offset, p.numel) for p in merged.pairs]
    with pytest.raises(ConfigError, match="not consecutive"):
        InformationBook(m, workers=2, shards=2, groups=[["layer0.weight", "layer2.weight"]])


@settings(max_examples=120, deadline=None)
@given(
    shape_list=st.lists(st.lists(st.integers(1, 400), min_size=1, max_size=2).map(tuple), min_size=2, max_size=14),
    cuts=st.lists(st.integers(0, 13), max_size=4),
    shards=st.integers(1, 8),
    chunk=st.sampled_from([4096, 65536, 2 << 20]),
    spread=st.sampled_from([0, 1024, 16384]),
    pipeline=st.sampled_from([None, 2048, 65536]),
)
def test_merge_groups_spread_one_run_per_shard_and_stay_balanced(shape_list, cuts, shards, chunk, spread, pipeline):
    m = manifest(shape_list)
    bounds = sorted({0, len(m), *(c for c in cuts if c < len(m))})
    groups = [[m[i].name for i in range(a, b)] for a, b in zip(bounds, bounds[1:]) if b - a > 1]
    book = InformationBook(
        m, workers=shards, shards=shards, chunk_bytes=chunk, groups=groups, spread_bytes=spread, pipeline_bytes=pipeline
    )
    for index, spec in enumerate(m):  # every element in exactly one pair, in offset order
        pairs = [p for p in book.pairs if p.param == index]
        assert [p.offset for p in pairs] == list(np.cumsum([0] + [p.numel for p in pairs])[:-1])
        assert sum(p.numel for p in pairs) == spec.numel
    assert all(p.nbytes <= chunk for p in book.pairs)
    spread_everywhere = True
    for names in groups:
        params = {m.index(n) for n in names}
        total = sum(m[i].nbytes for i in params)
        fit = total // spread if spread else 1
        if fit > shards:  # a whole number of runs a shard, up to GROUP_RUNS of pipeline bytes (workers = shards)
            deep = total // max(spread, pipeline or 0) // shards * shards
            fit = min(shards * -(-GROUP_RUNS // shards) if shards > 1 else 1, max(shards, deep))
        runs = max(-(-total // chunk), fit)
        per_shard: dict = {}
        for p in book.pairs:
            if p.param in params:
                per_shard[p.shard] = per_shard.get(p.shard, 0) + p.nbytes
        # A run a shard (more runs than shards take them in turn), of equal bytes within an item.
        assert len(per_shard) == min(runs, shards)
        if runs <= shards:
            assert max(per_shard.values()) - min(per_shard.values()) <= 2 * 4
        # One message a run (two runs on a shard stay two) while it fits a chunk: merging
        # saves frames.
        messages = [msg for msg in book.messages if book.pairs[msg.keys[0]].param in params]
        assert len(messages) >= runs
        if max(per_shard.values()) <= chunk:
            assert len(messages) == runs
        spread_everywhere = spread_everywhere and runs == shards
    # Groups over every shard leave the rest to balance as a model without groups does.
    if spread_everywhere and m.total_bytes >= shards * 4 * 20:
        assert book.max_over_mean() <= 1.05 + 8 * shards * (len(groups) + 1) / m.total_bytes


def test_a_merged_group_of_two_workers_goes_in_group_runs_messages_two_a_shard():
    # Each shard's sums follow the pushes, a quarter of the group at a time; one worker (its
    # shard in process) has nothing to pipeline and keeps one message a chunk.
    specs = [ParamSpec(f"fc{i}", (512, 128)) for i in range(5)]  # 5 x 256 KiB
    m, names = Manifest(specs), [[s.name for s in specs]]
    two = InformationBook(m, workers=2, shards=2, groups=names, spread_bytes=64 << 10)
    assert len(two.messages) == GROUP_RUNS and [msg.shard for msg in two.messages] == [0, 0, 1, 1]
    assert {msg.nbytes for msg in two.messages} == {m.total_bytes // GROUP_RUNS}
    # A run starts a message of its own even where two would fit a chunk together.
    assert all(msg.nbytes < two.chunk_bytes // 2 for msg in two.messages)
    one = InformationBook(m, workers=1, shards=1, groups=names, spread_bytes=64 << 10)
    assert len(one.messages) == 1
    # Runs are never cut under spread_bytes: a group of 2 runs' worth goes in 2.
    assert len(InformationBook(m, workers=2, shards=2, groups=names, spread_bytes=m.total_bytes // 2).messages) == 2


def test_runs_past_one_a_shard_only_where_each_takes_the_pipeline_time_on_the_link():
    # 1 Gbit: a run past one a shard must hold 2 ms of the link (250 kB), the message's CPU on
    # every rank being the step there; 100 Mbit: any run of PIPELINE_MIN_BYTES is worth it.
    assert pipeline_bytes_for(8e-9, 64 << 10) == round(PIPELINE_RUN_S / 8e-9)
    assert pipeline_bytes_for(80e-9, 64 << 10) == PIPELINE_MIN_BYTES and pipeline_bytes_for(0.0, 4096) == 4096
    assert pipeline_bytes_for(80e-9, 1 << 20) == 1 << 20  # never under the spread bytes
    specs = [ParamSpec(f"conv{i}", (64, 64, 3, 3)) for i in range(5)]  # 5 x 144 KiB: 4 runs of 180 KiB
    m, names = Manifest(specs), [[s.name for s in specs]]
    at = {
        beta: InformationBook(m, workers=2, shards=2, groups=names, pipeline_bytes=pipeline_bytes_for(beta, 64 << 10))
        for beta in (8e-9, 80e-9)
    }
    assert [msg.shard for msg in at[8e-9].messages] == [0, 1]
    assert [msg.shard for msg in at[80e-9].messages] == [0, 0, 1, 1]
    assert at[8e-9].shard_bytes() == at[80e-9].shard_bytes() == [m.total_bytes // 2] * 2
    big = Manifest([ParamSpec(f"conv{i}", (128, 64, 3, 3)) for i in range(5)])  # 4 runs of 360 KiB
    book = InformationBook(
        big,
        workers=2,
        shards=2,
        groups=[[f"conv{i}" for i in range(5)]],
        pipeline_bytes=pipeline_bytes_for(8e-9, 64 << 10),
    )
    assert len(book.messages) == GROUP_RUNS
    with pytest.raises(ConfigError, match="pipeline_bytes"):
        InformationBook(m, workers=2, shards=2, groups=names, pipeline_bytes=0)
    with pytest.raises(ConfigError, match="group_pipeline_bytes"):
        PSConfig(group_pipeline_bytes=0)


def test_a_merged_resnet20_over_2_shards_is_half_on_each():
    # 2 workers: one shard would take every push on one link and then every reply on the other,
    # one after the other (bench train, 100 Mbit, one message: 81 ms a step against 59 spread);
    # spread, both links carry half the pushes and half the replies at once.
    specs = [ParamSpec(f"conv{i}", (64, 64, 3, 3)) for i in range(7)]
    m = Manifest(specs)
    one = InformationBook(m, workers=2, shards=2, groups=[[s.name for s in specs]], spread_bytes=0)
    spread = InformationBook(m, workers=2, shards=2, groups=[[s.name for s in specs]])
    assert one.shard_bytes() in ([m.total_bytes, 0], [0, m.total_bytes]) and len(one.messages) == 1
    assert spread.shard_bytes() == [m.total_bytes // 2] * 2 and len(spread.messages) == GROUP_RUNS
    assert one.digest() != spread.digest()
    with pytest.raises(ConfigError, match="spread_bytes"):
        InformationBook(m, workers=2, shards=2, spread_bytes=-1)


def test_manifest_differences_name_the_parameter():
    a = manifest([(3, 4), (5,)])
    b = manifest([(3, 4), (6,)])
    assert "layer1.weight [5] float32 vs layer1.weight [6] float32" in first_difference(a, b)
    assert first_difference(a, a) is None
    assert "more parameter" in first_difference(a, manifest([(3, 4)]))
    with pytest.raises(ManifestMismatch):
        Manifest.from_json("not json")
    with pytest.raises(ConfigError, match="bfloat16"):
        ParamSpec("x", (2,), "bfloat16")


def test_presets_build():
    for name, build in PRESETS.items():
        assert InformationBook(build(), workers=4, shards=4).max_over_mean() < 1.1, name


def test_checkpoint_round_trip_and_corruption(tmp_path):
    root = str(tmp_path)
    arrays = {"w0": np.arange(10, dtype=np.float32), "v0": np.zeros(10, dtype=np.float32)}
    checkpoint.write(root, 1, 4, "book-a", arrays)
    checkpoint.write(root, 1, 6, "book-a", arrays)
    assert checkpoint.complete_clocks(root, 1, "book-a") == [4, 6]
    assert checkpoint.complete_clocks(root, 1, "book-b") == []
    got = checkpoint.read(root, 1, 6, "book-a")
    assert all(np.array_equal(got[k], arrays[k]) for k in arrays)
    npz = checkpoint.shard_dir(root, 1) / "clock-0000000006.npz"
    npz.write_bytes(npz.read_bytes()[:-3])  # a torn write
    assert checkpoint.complete_clocks(root, 1, "book-a") == [4]
    with pytest.raises(checkpoint.CheckpointError, match="corrupt"):
        checkpoint.read(root, 1, 6, "book-a")
    with pytest.raises(checkpoint.CheckpointError, match="another model"):
        checkpoint.read(root, 1, 4, "book-b")
    assert checkpoint.newest_common({0: [2, 4, 6], 1: [2, 4]}) == 4
    assert checkpoint.newest_common({0: [2], 1: []}) is None


def test_the_client_refuses_an_array_unlike_its_manifest_entry_naming_it():
    """The PS client checks every array it is handed against the manifest (shape, dtype, layout)
    before a byte moves; the check compares NumPy dtypes, not their names."""
    import asyncio

    from poseidon_aio.errors import LocalProtocolError
    from poseidon_aio.ps import PSConfig
    from poseidon_aio.ps.client import PSClient

    book = InformationBook(manifest([(4, 3), (5,)]), workers=2, shards=1, chunk_bytes=4096)

    async def check():
        client = PSClient(0, book, PSConfig(), {})
        good = np.zeros((4, 3), np.float32)
        assert client._checked(0, good).shape == (12,)
        for bad, why in (
            (np.zeros((4, 3), np.float64), "float64"),
            (np.zeros((3, 4), np.float32), "[3, 4]"),
            (np.zeros((3, 4), np.float32).T, "C-contiguous"),
        ):
            with pytest.raises(LocalProtocolError, match=r"layer0\.weight") as err:
                client._checked(0, bad)
            assert why in str(err.value)

    asyncio.run(check())
