"""The compressed payloads' codecs (wire/half.py, wire/lowrank.py, wire/sparse.py) and the rows scheme's
(wire/rows.py): round trips under hypothesis, and malformed payloads — fuzzed and hand-made — raise
RemoteProtocolError naming the layer and the rank, nothing else."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from poseidon_aio.errors import LocalProtocolError, RemoteProtocolError
from poseidon_aio.wire import DType, Frame, Header, Kind, half, lowrank, rows, sparse

WHAT = "layer blocks.0.fc1 at clock 7"
RANK = 5


def _frame(parts, dtype) -> Frame:
    payload = b"".join(np.ascontiguousarray(p).tobytes() for p in parts) if isinstance(parts, list) else bytes(parts)
    return Frame(Header(Kind.PUSH, RANK, 0, 7, len(payload), dtype), memoryview(bytearray(payload)))


float32s = hnp.arrays(np.float32, st.integers(0, 64), elements=st.floats(width=32, allow_nan=True, allow_infinity=True))
finite32s = hnp.arrays(
    np.float32, st.integers(1, 64), elements=st.floats(width=32, allow_nan=False, allow_infinity=False)
)


# -- half ---------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(x=float32s)
def test_half_round_trips_what_the_owner_keeps_and_non_finite_values_travel(x):
    parts = half.encode(x)
    assert sum(p.nbytes for p in parts) == half.nbytes(x.size)
    got = half.decode(_frame(parts, half.DTYPE), x.size, what=WHAT)
    kept = half.expand(parts)
    assert got.dtype == np.float32 and got.tobytes() == kept.tobytes()  # what peers read is what the owner keeps
    assert np.array_equal(np.isnan(got), np.isnan(x))
    assert np.array_equal(got[np.isinf(x)], x[np.isinf(x)])


@settings(max_examples=300, deadline=None)
@given(x=finite32s, exponent=st.integers(-140, 120))
def test_half_error_is_half_an_ulp_of_float16_relative_at_any_scale(x, exponent):
    # Gradients of any magnitude, from float32's subnormals to 2^120: the scale keeps them in
    # float16's normal range, so the error is at most 2^-11 relative (half an ulp, 10 fraction
    # bits), plus half of float16's smallest subnormal step times the scale for values 2^-29 and
    # more below the chunk's largest.
    with np.errstate(over="ignore"):
        x = (x.astype(np.float64) * 2.0**exponent).astype(np.float32)
    x = x[np.isfinite(x)]
    parts = half.encode(x)
    scale = float(parts[0][0])
    got = half.expand(parts).astype(np.float64)
    err = np.abs(got - x.astype(np.float64))
    assert np.all(err <= 2.0**-11 * np.abs(x.astype(np.float64)) + 2.0**-25 * scale)
    assert np.all(np.isfinite(got))


@pytest.mark.parametrize(
    "scale,match",
    [
        (np.inf, "scale inf"),
        (np.nan, "scale nan"),
        (0.0, "scale 0.0"),
        (-2.0, "scale -2.0"),
        (3.0, "scale 3.0"),
        (2.0**113, "scale 1.03"),
        (2.0**-127, "scale 5.87"),
    ],
)
def test_half_refuses_a_scale_that_is_not_a_power_of_two_in_range(scale, match):
    frame = _frame([np.float32([scale]), np.ones(3, np.float16)], half.DTYPE)
    with pytest.raises(RemoteProtocolError, match=f"rank {RANK} sent the {match}.*{WHAT}"):
        half.decode(frame, 3, what=WHAT)


@pytest.mark.parametrize(
    "length,dtype", [(4 + 2 * 2, DType.BYTES), (4 + 2 * 4, DType.BYTES), (4 + 2 * 3, DType.FLOAT16), (0, DType.BYTES)]
)
def test_half_refuses_a_chunk_of_another_length_or_dtype(length, dtype):
    with pytest.raises(RemoteProtocolError, match=f"rank {RANK} sent {length} bytes of {dtype.name} for {WHAT}"):
        half.decode(_frame(b"\0" * length, dtype), 3, what=WHAT)


def test_encoding_the_wrong_values_is_our_error():
    with pytest.raises(LocalProtocolError):
        half.encode(np.zeros(3))  # float64
    with pytest.raises(LocalProtocolError):
        lowrank.encode(np.zeros((2, 2), np.float32))
    with pytest.raises(LocalProtocolError):
        sparse.encode(np.zeros(1, np.float32), np.zeros(2, np.int64), np.zeros(2, np.float32))


# -- lowrank ------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(x=float32s)
def test_lowrank_round_trips_bit_for_bit(x):
    got = lowrank.decode(_frame(lowrank.encode(x), lowrank.DTYPE), x.size, what=WHAT)
    assert got.tobytes() == x.tobytes() and lowrank.expand(lowrank.encode(x)).tobytes() == x.tobytes()


@pytest.mark.parametrize(
    "length,dtype", [(8, DType.FLOAT32), (16, DType.FLOAT32), (12, DType.FLOAT16), (12, DType.BYTES)]
)
def test_lowrank_refuses_another_length_or_dtype(length, dtype):
    with pytest.raises(RemoteProtocolError, match=f"rank {RANK} sent {length} bytes of {dtype.name} for {WHAT}"):
        lowrank.decode(_frame(b"\0" * length, dtype), 3, what=WHAT)


# -- sparse -------------------------------------------------------------------------------------


@st.composite
def sparse_parts(draw):
    size = draw(st.integers(1, 200))
    k = draw(st.integers(0, size))
    dense = draw(hnp.arrays(np.float32, st.integers(0, 8), elements=st.floats(width=32)))
    idx = np.array(sorted(draw(st.sets(st.integers(0, size - 1), min_size=k, max_size=k))), dtype=np.uint32)
    values = draw(hnp.arrays(np.float32, k, elements=st.floats(width=32)))
    return size, dense, idx, values


@settings(max_examples=200, deadline=None)
@given(parts=sparse_parts())
def test_sparse_round_trips_bit_for_bit(parts):
    size, dense, idx, values = parts
    payload = sparse.encode(dense, idx, values)
    assert sum(p.nbytes for p in payload) == sparse.nbytes(dense.size, idx.size)
    d, i, v = sparse.decode(_frame(payload, sparse.DTYPE), dense.size, idx.size, size, what=WHAT)
    assert d.tobytes() == dense.tobytes() and i.tobytes() == idx.tobytes() and v.tobytes() == values.tobytes()


@settings(max_examples=100, deadline=None)
@given(layers=st.lists(sparse_parts(), min_size=1, max_size=4))
def test_sparse_layers_back_to_back_round_trip_bit_for_bit(layers):
    """A merged group's payload: each layer's section, back to back, decoded each on its own."""
    payload = [p for _, dense, idx, values in layers for p in sparse.encode(dense, idx, values)]
    layouts = [(dense.size, idx.size, size) for size, dense, idx, _ in layers]
    decoded = sparse.decode_layers(_frame(payload, sparse.DTYPE), layouts, what=WHAT)
    for (_, dense, idx, values), (d, i, v) in zip(layers, decoded):
        assert d.tobytes() == dense.tobytes() and i.tobytes() == idx.tobytes() and v.tobytes() == values.tobytes()


def test_sparse_layers_refuse_a_wrong_total_length_and_name_the_layer_of_a_bad_section():
    good = [np.float32([1.0]), np.uint32([1, 2]), np.float32([1.0, 2.0])]
    bad = [np.float32([1.0]), np.uint32([2, 1]), np.float32([1.0, 2.0])]
    layouts = [(1, 2, 10), (1, 2, 10)]
    with pytest.raises(
        RemoteProtocolError,
        match=f"rank {RANK} sent 20 bytes of BYTES for {WHAT}: expected 1 exact values and 2 .* and 1 exact",
    ):
        sparse.decode_layers(_frame(good, sparse.DTYPE), layouts, what=WHAT)
    with pytest.raises(RemoteProtocolError, match=f"do not strictly increase for {WHAT} \\(its layer fc2\\)"):
        sparse.decode_layers(_frame(good + bad, sparse.DTYPE), layouts, what=WHAT, names=["fc1", "fc2"])


@pytest.mark.parametrize(
    "indices,match",
    [
        ([1, 10], "the index 10 for .*10 values"),
        ([3, 3], "indices that do not strictly increase .*position 1: 3 then 3"),
        ([4, 2], "indices that do not strictly increase .*position 1: 4 then 2"),
        ([0, 2**32 - 1], "the index 4294967295"),
    ],
)
def test_sparse_refuses_indices_out_of_range_repeated_or_unordered(indices, match):
    frame = _frame([np.float32([1.0]), np.array(indices, np.uint32), np.float32([1.0, 2.0])], sparse.DTYPE)
    with pytest.raises(RemoteProtocolError, match=f"rank {RANK} sent {match}"):
        sparse.decode(frame, 1, 2, 10, what=WHAT)


@pytest.mark.parametrize("length", [0, 4 + 8 * 2 - 1, 4 + 8 * 3, 4 + 8 * 2 + 4])
def test_sparse_refuses_another_length(length):
    with pytest.raises(
        RemoteProtocolError, match=f"rank {RANK} sent {length} bytes of BYTES for {WHAT}: expected 1 exact values and 2"
    ):
        sparse.decode(_frame(b"\0" * length, DType.BYTES), 1, 2, 10, what=WHAT)


# -- rows ---------------------------------------------------------------------------------------


@st.composite
def row_sparse_grads(draw):
    vocab, width = draw(st.integers(1, 40)), draw(st.integers(1, 6))
    grad = np.zeros((vocab, width), np.float32)
    for i in draw(st.sets(st.integers(0, vocab - 1), max_size=vocab)):
        grad[i] = draw(hnp.arrays(np.float32, width, elements=st.floats(width=32, allow_nan=True, allow_infinity=True)))
    return grad


@settings(max_examples=200, deadline=None)
@given(grad=row_sparse_grads())
def test_rows_round_trip_rebuilds_the_gradient_bit_for_bit(grad):
    idx, values = rows.touched(grad)
    assert idx.size == int(np.count_nonzero(grad.any(axis=1)))
    payload = rows.encode(idx, values)
    assert sum(p.nbytes for p in payload) == rows.nbytes(idx.size, grad.shape[1])
    i, v = rows.decode(_frame(payload, rows.DTYPE), *grad.shape, what=WHAT)
    rebuilt = np.zeros_like(grad)
    rebuilt[i] = v
    assert rebuilt.tobytes() == np.where(grad.any(axis=1, keepdims=True), grad, np.float32(0)).tobytes()
    assert np.array_equal(rebuilt, grad, equal_nan=True)


@pytest.mark.parametrize(
    "indices,match",
    [
        ([3, 10], "the row 10 for .*vocabulary is 10 rows"),
        ([4, 4], "rows that do not strictly increase .*position 1: 4 then 4"),
        ([5, 2], "rows that do not .*position 1: 5 then 2"),
    ],
)
def test_rows_refuse_a_row_out_of_range_repeated_or_unordered(indices, match):
    frame = _frame([np.array(indices, np.uint32), np.ones((2, 3), np.float32)], rows.DTYPE)
    with pytest.raises(RemoteProtocolError, match=f"rank {RANK} sent {match}"):
        rows.decode(frame, 10, 3, what=WHAT)


@pytest.mark.parametrize(
    "length,dtype", [(15, DType.BYTES), (17, DType.BYTES), (16 * 11, DType.BYTES), (16, DType.FLOAT32)]
)
def test_rows_refuse_a_part_row_more_rows_than_the_vocabulary_or_another_dtype(length, dtype):
    with pytest.raises(
        RemoteProtocolError,
        match=f"rank {RANK} sent {length} bytes of {dtype.name} for {WHAT}: "
        "expected a whole number of rows of 16 bytes",
    ):
        rows.decode(_frame(b"\0" * length, dtype), 10, 3, what=WHAT)


def test_rows_encoding_the_wrong_arrays_is_our_error():
    with pytest.raises(LocalProtocolError, match="uint32 indices and as many float32 rows"):
        rows.encode(np.zeros(2, np.int64), np.zeros((2, 3), np.float32))
    with pytest.raises(LocalProtocolError):
        rows.encode(np.zeros(3, np.uint32), np.zeros((2, 3), np.float32))


# -- fuzz ---------------------------------------------------------------------------------------


@settings(max_examples=400, deadline=None)
@given(
    raw=st.binary(max_size=96),
    dtype=st.sampled_from(list(DType)),
    n=st.integers(0, 24),
    dense=st.integers(0, 4),
    k=st.integers(0, 8),
    size=st.integers(0, 40),
)
def test_fuzz_every_decoder_returns_or_raises_remote_protocol_error_naming_layer_and_rank(
    raw, dtype, n, dense, k, size
):
    """h11's invariant for the compressed payloads: any bytes decode or raise the peer's protocol
    error (naming the layer and the sending rank), never anything else."""
    frame = _frame(raw, dtype)
    for decode in (
        lambda: half.decode(frame, n, what=WHAT),
        lambda: lowrank.decode(frame, n, what=WHAT),
        lambda: sparse.decode(frame, dense, k, size, what=WHAT),
        lambda: sparse.decode_layers(frame, [(dense, k, size), (k, dense, size)], what=WHAT, names=["a", "b"]),
        lambda: rows.decode(frame, size, max(1, dense), what=WHAT),
    ):
        try:
            decode()
        except RemoteProtocolError as exc:
            assert f"rank {RANK}" in str(exc) and WHAT in str(exc)


@settings(max_examples=200, deadline=None)
@given(x=finite32s, flip=st.integers(0, 10_000), byte=st.integers(0, 255))
def test_fuzz_a_corrupted_valid_payload_decodes_or_raises_remote_protocol_error(x, flip, byte):
    for codec, parts, args in (
        (half, half.encode(x), (x.size,)),
        (
            sparse,
            sparse.encode(x[:2], np.arange(min(3, x.size), dtype=np.uint32), x[: min(3, x.size)]),
            (min(2, x.size), min(3, x.size), x.size),
        ),
    ):
        payload = bytearray(b"".join(p.tobytes() for p in parts))
        payload[flip % len(payload)] = byte
        try:
            codec.decode(_frame(payload, codec.DTYPE), *args, what=WHAT)
        except RemoteProtocolError as exc:
            assert f"rank {RANK}" in str(exc) and WHAT in str(exc)
