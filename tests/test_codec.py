"""Both codecs: round trips, incremental feeding, zero-copy destinations, payload checksums and
bad input."""

from __future__ import annotations

import random
import tracemalloc
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poseidon_aio.errors import FrameError, LocalProtocolError, RemoteProtocolError, VersionMismatch
from poseidon_aio.wire import CODECS, HEADER_SIZE, INITIAL_PAYLOAD_BUFFER, ITEMSIZE, DType, Kind, payload_crc
from poseidon_aio.wire.spans import spanning

kinds = st.sampled_from(list(Kind))
dtypes = st.sampled_from(list(DType))


@st.composite
def frame_specs(draw, max_items=64):
    dtype = draw(dtypes)
    items = draw(st.integers(0, max_items))
    return dict(
        kind=draw(kinds),
        payload=draw(st.binary(min_size=items * ITEMSIZE[dtype], max_size=items * ITEMSIZE[dtype])),
        rank=draw(st.integers(0, 2**32 - 1)),
        key=draw(st.integers(0, 2**32 - 1)),
        clock=draw(st.integers(0, 2**64 - 1)),
        dtype=dtype,
        flags=draw(st.integers(0, 2**15 - 1)),
        checksum=draw(st.booleans()),
    )


def _encode(codec, spec):
    spec = dict(spec)
    return codec.encode_frame(spec.pop("kind"), spec.pop("payload"), **spec)


def _decode_all(codec, data, chunks=None, **kwargs):
    dec = codec.FrameDecoder(**kwargs)
    out = []
    pieces = chunks if chunks is not None else [data]
    for piece in pieces:
        dec.feed(piece)
        while (frame := dec.next_frame()) is not None:
            out.append(frame)
    return out, dec


def _check(frame, spec):
    h = frame.header
    assert (h.kind, h.rank, h.key, h.clock, h.dtype, h.flags) == (
        spec["kind"],
        spec["rank"],
        spec["key"],
        spec["clock"],
        spec["dtype"],
        spec["flags"],
    )
    assert h.length == len(spec["payload"])
    assert h.payload_crc == (payload_crc([spec["payload"]]) if spec["checksum"] else None)
    assert bytes(frame.payload) == spec["payload"]
    assert frame.payload.nbytes == h.length and not frame.payload.readonly and frame.payload.c_contiguous


@given(spec=frame_specs())
def test_header_round_trip_and_twins_agree(spec):
    encoded = {name: _encode(mod, spec) for name, mod in CODECS.items()}
    assert len(set(encoded.values())) == 1, "the codecs encode the same frame differently"
    data = next(iter(encoded.values()))
    assert len(data) == HEADER_SIZE + len(spec["payload"])
    headers = {name: mod.decode_header(data) for name, mod in CODECS.items()}
    assert len(set(headers.values())) == 1


# A payload the decoder buffers itself starts at this many bytes and doubles: 1 and 5 make the
# small payloads of these tests cross several growths at every possible cut.
initial_buffers = st.sampled_from([1, 5, 64, INITIAL_PAYLOAD_BUFFER])


@settings(max_examples=60)
@given(specs=st.lists(frame_specs(), min_size=1, max_size=8), seed=st.integers(0, 2**32), initial=initial_buffers)
def test_stream_whole_bytewise_and_random_chunks(codec, specs, seed, initial):
    data = b"".join(_encode(codec, s) for s in specs)
    rng = random.Random(seed)
    cuts, i = [], 0
    while i < len(data):
        n = rng.randint(1, 97)
        cuts.append(data[i : i + n])
        i += n
    for chunks in ([data], [data[i : i + 1] for i in range(len(data))], cuts):
        frames, dec = _decode_all(codec, data, chunks, initial_payload_buffer=initial)
        assert len(frames) == len(specs)
        for frame, spec in zip(frames, specs):
            _check(frame, spec)
        assert dec.buffered == 0 and dec.partial is None


@settings(max_examples=40)
@given(
    specs=st.lists(frame_specs(max_items=300), min_size=1, max_size=6),
    seed=st.integers(0, 2**32),
    initial=initial_buffers,
)
def test_buffered_protocol_path_with_destinations(codec, specs, seed, initial):
    """get_buffer/buffer_updated, as asyncio.BufferedProtocol drives it, with zero-copy targets."""
    data = b"".join(_encode(codec, s) for s in specs)
    rng = random.Random(seed)
    dests = []

    def allocate(header):
        if rng.random() < 0.5:
            return None
        buf = bytearray(header.length)
        dests.append(buf)
        return buf

    dec = codec.FrameDecoder(allocate=allocate, scratch_size=64, initial_payload_buffer=initial)
    frames, pos = [], 0
    while pos < len(data):
        buf = dec.get_buffer(rng.choice([-1, 1, 4096]))
        n = min(len(buf), rng.randint(1, 200), len(data) - pos)
        buf[:n] = data[pos : pos + n]
        pos += n
        dec.buffer_updated(n)
        while (frame := dec.next_frame()) is not None:
            frames.append(frame)
    assert len(frames) == len(specs)
    for frame, spec in zip(frames, specs):
        _check(frame, spec)
    # A registered destination receives the payload in place.
    landed = [bytes(d) for d in dests]
    assert all(any(bytes(f.payload) == d for f in frames) for d in landed)


def test_kernel_writes_straight_into_destination(codec):
    payload = bytes(range(256)) * 4096  # 1 MiB
    data = codec.encode_frame(Kind.PUSH, payload, rank=1, key=2, clock=3, dtype=DType.FLOAT32)
    dest = bytearray(len(payload))
    dec = codec.FrameDecoder(allocate=lambda h: dest)
    buf = dec.get_buffer(-1)
    buf[:HEADER_SIZE] = data[:HEADER_SIZE]
    dec.buffer_updated(HEADER_SIZE)
    assert dec.next_frame() is None
    target = dec.get_buffer(-1)
    assert len(target) == len(payload)
    target[:] = data[HEADER_SIZE:]  # the "kernel" writes once, into dest itself
    dec.buffer_updated(len(payload))
    frame = dec.next_frame()
    assert frame.payload.obj is dest and dest == payload


def test_wrong_destination_size_is_our_error(codec):
    data = codec.encode_frame(Kind.DATA, b"abcd", rank=0)
    dec = codec.FrameDecoder(allocate=lambda h: bytearray(3))
    dec.feed(data)
    with pytest.raises(LocalProtocolError, match="writable buffer of 4 bytes"):
        dec.next_frame()
    with pytest.raises(LocalProtocolError, match="writable buffer of 4 bytes"):  # the decoder stays failed
        dec.get_buffer(-1)


def test_an_allocate_hook_that_raises_leaves_the_decoder_failed(codec):
    def refuse(header):
        raise RemoteProtocolError(f"no slot for key {header.key}")

    data = codec.encode_frame(Kind.PUSH, b"abcd", rank=0, key=7) + codec.encode_frame(Kind.DATA, b"x", rank=0)
    dec = codec.FrameDecoder(allocate=refuse)
    dec.feed(data)
    with pytest.raises(RemoteProtocolError, match="no slot for key 7"):
        dec.next_frame()
    for later in (dec.next_frame, lambda: dec.feed(b"more"), lambda: dec.get_buffer(-1)):
        with pytest.raises(RemoteProtocolError, match="no slot for key 7"):
            later()


def _announce(codec, length: int) -> bytes:
    return codec.encode_header(Kind.PUSH, rank=3, key=1, clock=2, length=length, dtype=DType.FLOAT32)


@pytest.mark.parametrize("path", ["feed", "get_buffer"])
def test_a_payload_nobody_registered_grows_with_the_bytes_received(codec, path):
    """A peer announcing 1 GiB and sending 3 MiB costs the decoder a few MiB, not 1 GiB."""
    announced, sent, chunk = 1 << 30, 3 << 20, 64 * 1024
    dec = codec.FrameDecoder(max_payload=announced)
    tracemalloc.start()
    try:
        dec.feed(_announce(codec, announced))
        assert dec.next_frame() is None
        assert dec.own_payload_bytes == INITIAL_PAYLOAD_BUFFER
        block = bytes(range(256)) * (chunk // 256)
        for received in range(chunk, sent + 1, chunk):
            if path == "feed":
                dec.feed(block)
            else:
                buf = dec.get_buffer(chunk)
                n = min(len(buf), chunk)
                buf[:n] = block[:n]
                dec.buffer_updated(n)
                if n < chunk:
                    dec.feed(block[n:])
            assert dec.next_frame() is None
            # Doubling: never more than twice what arrived (or the first buffer).
            assert dec.own_payload_bytes <= max(INITIAL_PAYLOAD_BUFFER, 2 * received)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert dec.partial[1] == sent and dec.buffered == sent
    assert peak < 16 << 20, f"decoding 3 MiB of a 1 GiB announcement allocated {peak} bytes at peak"


def test_a_grown_payload_is_one_contiguous_buffer_of_its_length(codec):
    payload = bytes(random.Random(1).randbytes(5 * 1024 * 1024 + 3))
    data = codec.encode_frame(Kind.DATA, payload, rank=1, key=2, clock=3)
    frames, dec = _decode_all(codec, data, [data[i : i + 100_000] for i in range(0, len(data), 100_000)])
    (frame,) = frames
    assert frame.payload.nbytes == len(payload) and frame.payload.c_contiguous and not frame.payload.readonly
    assert bytes(frame.payload) == payload and dec.own_payload_bytes == 0


def _mutate_header(data: bytes, offset: int, value: bytes, fix_crc: bool = True) -> bytes:
    h = bytearray(data[:HEADER_SIZE])
    h[offset : offset + len(value)] = value
    if fix_crc:
        h[40:44] = (zlib.crc32(bytes(h[:40])) & 0xFFFFFFFF).to_bytes(4, "little")
    return bytes(h) + data[HEADER_SIZE:]


@pytest.mark.parametrize(
    "offset,value,fix_crc,match",
    [
        (0, b"HTTP", True, "bad magic"),
        (4, b"\x01", True, "the peer speaks wire version 1, this build speaks 2"),
        (5, b"\x63", True, "unknown frame kind 99"),
        (32, b"\x40", True, "unknown payload dtype 64"),
        (12, b"\x01", False, "header checksum mismatch"),
        (24, (10**12).to_bytes(8, "little"), True, "exceeds the maximum"),
        (32, bytes([DType.FLOAT64]), True, "not a whole number of 8-byte items"),
    ],
)
def test_bad_frames_raise_frame_error_with_the_reason(codec, offset, value, fix_crc, match):
    data = codec.encode_frame(Kind.PUSH, b"\x00" * 12, rank=2, key=5, clock=9, dtype=DType.FLOAT32)
    bad = _mutate_header(data, offset, value, fix_crc)
    with pytest.raises(FrameError, match=match):
        codec.decode_header(bad)
    dec = codec.FrameDecoder()
    dec.feed(bad)
    with pytest.raises(FrameError, match=match):
        dec.next_frame()
    with pytest.raises(FrameError, match=match):  # the decoder stays failed
        dec.feed(b"more")


def test_max_payload_is_enforced_before_allocation(codec):
    allocated = []
    data = codec.encode_frame(Kind.DATA, b"x" * 100, rank=0)
    dec = codec.FrameDecoder(max_payload=64, allocate=lambda h: allocated.append(h))
    dec.feed(data[:HEADER_SIZE])
    with pytest.raises(FrameError, match="100 bytes exceeds the maximum of 64"):
        dec.next_frame()
    assert allocated == []


@pytest.mark.parametrize(
    "fields,match",
    [
        (dict(rank=2**32), "rank"),
        (dict(key=-1), "key"),
        (dict(clock=2**64), "clock"),
        (dict(flags=2**15), "flags"),  # bit 15 is the wire's
        (dict(dtype=77), "unknown payload dtype"),
        (dict(dtype=DType.FLOAT32, payload=b"abc"), "whole number"),
    ],
)
def test_encoding_invalid_fields_is_a_local_error(codec, fields, match):
    fields = dict(fields)
    payload = fields.pop("payload", b"")
    with pytest.raises(LocalProtocolError, match=match):
        codec.encode_frame(Kind.DATA, payload, **fields)
    with pytest.raises(LocalProtocolError, match="unknown frame kind"):
        codec.encode_header(200)


# -- payload checksums ---------------------------------------------------------------------------


def _feed_paths(codec, data: bytes, seed: int):
    """Frames and error from ``data`` fed whole, byte by byte, and through get_buffer with
    destinations (the BufferedProtocol path): ``[(frames, error), ...]``."""
    rng = random.Random(seed)
    out = []
    for chunks in ([data], [data[i : i + 1] for i in range(len(data))]):
        dec, frames, error = codec.FrameDecoder(initial_payload_buffer=5), [], None
        try:
            for piece in chunks:
                dec.feed(piece)
                while (frame := dec.next_frame()) is not None:
                    frames.append(bytes(frame.payload))
        except FrameError as exc:
            error = str(exc)
        out.append((frames, error))
    dec = codec.FrameDecoder(allocate=lambda h: bytearray(h.length) if rng.random() < 0.5 else None, scratch_size=64)
    frames, error, pos = [], None, 0
    try:
        while pos < len(data):
            buf = dec.get_buffer(-1)
            n = min(len(buf), rng.randint(1, 300), len(data) - pos)
            buf[:n] = data[pos : pos + n]
            pos += n
            dec.buffer_updated(n)
            while (frame := dec.next_frame()) is not None:
                frames.append(bytes(frame.payload))
    except FrameError as exc:
        error = str(exc)
    out.append((frames, error))
    return out


@settings(max_examples=150)
@given(
    payloads=st.lists(st.binary(min_size=1, max_size=700), min_size=1, max_size=4),
    target=st.integers(0, 2**32),
    bit=st.integers(0, 2**32),
    seed=st.integers(0, 2**32),
)
def test_a_flipped_payload_bit_is_caught_and_its_frame_never_handed_out(codec, payloads, target, bit, seed):
    """Every frame before the flipped one comes out intact; the flipped one and those after never do."""
    frames = [
        codec.encode_frame(Kind.PUSH, p, rank=3, key=k, clock=7, dtype=DType.BYTES, checksum=True)
        for k, p in enumerate(payloads)
    ]
    hit = target % len(frames)
    offset = bit % (8 * len(payloads[hit]))
    data = bytearray(b"".join(frames))
    data[sum(map(len, frames[:hit])) + HEADER_SIZE + offset // 8] ^= 1 << (offset % 8)
    for got, error in _feed_paths(codec, bytes(data), seed):
        assert got == payloads[:hit]
        assert error is not None and error.startswith(
            f"payload checksum mismatch in PUSH key {hit} clock 7 from rank 3"
        )


def test_a_checksum_names_the_frame_and_the_two_crcs(codec):
    data = bytearray(codec.encode_frame(Kind.AGGREGATE, b"\x00" * 16, rank=2, key=5, clock=9, checksum=True))
    data[-1] ^= 0x80
    dec = codec.FrameDecoder()
    dec.feed(bytes(data))
    with pytest.raises(
        FrameError, match=r"AGGREGATE key 5 clock 9 from rank 2 \(16 bytes; CRC32C sent 0x[0-9a-f]{8}, "
    ):
        dec.next_frame()
    with pytest.raises(FrameError, match="payload checksum mismatch"):  # the decoder stays failed
        dec.feed(b"more")


def test_a_frame_without_a_checksum_is_refused_where_one_is_required(codec):
    plain = codec.encode_frame(Kind.PUSH, b"abcd", rank=1, key=2, clock=3)
    signed = codec.encode_frame(Kind.PUSH, b"abcd", rank=1, key=2, clock=3, checksum=True)
    dec = codec.FrameDecoder(require_checksum=True)
    dec.feed(signed + plain)
    assert bytes(dec.next_frame().payload) == b"abcd"
    with pytest.raises(FrameError, match="PUSH key 2 clock 3 from rank 1 carries no payload checksum"):
        dec.next_frame()
    # Without the requirement an unsigned frame passes and a signed one is still checked.
    dec = codec.FrameDecoder()
    dec.feed(plain + signed)
    assert [bytes(dec.next_frame().payload) for _ in range(2)] == [b"abcd", b"abcd"]


def test_a_wire_v1_header_is_a_version_error(codec):
    """What an older release sends first: its 40-byte v1 HELLO header (CRC-32 over bytes 0-35)."""
    import struct

    body = struct.pack("<4sBBHIIQQB3x", b"PSDN", 1, Kind.HELLO, 0, 0, 0, 0, 60, DType.JSON)
    v1 = body + zlib.crc32(body).to_bytes(4, "little") + b"{}" * 30
    dec = codec.FrameDecoder()
    dec.feed(v1)
    with pytest.raises(VersionMismatch, match="the peer speaks wire version 1, this build speaks 2") as caught:
        dec.next_frame()
    assert isinstance(caught.value, FrameError)


def test_an_empty_payload_has_checksum_zero_and_round_trips(codec):
    data = codec.encode_frame(Kind.HEARTBEAT, rank=4, checksum=True)
    assert codec.decode_header(data).payload_crc == 0
    frames, _ = _decode_all(codec, data, require_checksum=True)
    assert frames[0].header.length == 0


@settings(max_examples=50, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=3), min_size=0, max_size=4), as_list=st.booleans()
)
def test_payload_views_are_flat_bytes_of_each_part_and_their_size_twins_alike(shapes, as_list):
    parts = [np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) for shape in shapes]
    payload = parts if as_list or len(parts) != 1 else parts[0]
    results = {name: codec.payload_views(payload) for name, codec in CODECS.items()}
    for views, nbytes in results.values():
        assert [v.tobytes() for v in views] == [p.tobytes() for p in (parts if payload is parts else [payload])]
        assert all(v.ndim == 1 and v.format == "B" for v in views)
        assert nbytes == sum(p.nbytes for p in parts)
    for codec in CODECS.values():
        with pytest.raises(LocalProtocolError, match="C-contiguous"):
            codec.payload_views([np.ones(4, np.float32), np.ones((4, 4), np.float32)[:, 1]])


def _mutations(rng: random.Random, data: bytes) -> bytes:
    data = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(4)
        if op == 0 and data:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif op == 1 and data:
            del data[rng.randrange(len(data)) :]
        elif op == 2:
            data[rng.randrange(len(data) + 1) : 0] = rng.randbytes(rng.randint(1, 50))
        else:
            data += rng.randbytes(rng.randint(0, 60))
    return bytes(data)


@settings(max_examples=300)
@given(
    raw=st.binary(max_size=400),
    specs=st.lists(frame_specs(), max_size=3),
    seed=st.integers(0, 2**32),
    chunk=st.integers(1, 64),
    initial=initial_buffers,
)
def test_fuzz_frames_or_frame_error_nothing_else(raw, specs, seed, chunk, initial):
    """h11's invariant: any input parses or raises the protocol error, nothing else; twins agree."""
    rng = random.Random(seed)
    valid = b"".join(_encode(CODECS["python"], s) for s in specs)
    inputs = [raw, _mutations(rng, valid), valid + raw, _mutations(rng, valid + raw)]
    for data in inputs:
        results = {}
        for name, mod in CODECS.items():
            dec = mod.FrameDecoder(max_payload=1 << 16, initial_payload_buffer=initial)
            frames, error = [], None
            try:
                for i in range(0, len(data), chunk):
                    dec.feed(data[i : i + chunk])
                    while (frame := dec.next_frame()) is not None:
                        frames.append((frame.header, bytes(frame.payload)))
            except FrameError as exc:
                error = str(exc)
            results[name] = (frames, error, (dec.buffered, dec.own_payload_bytes) if error is None else None)
        assert len({repr(r) for r in results.values()}) == 1, results


# -- arrays back to back, received as one ---------------------------------------------------------


@given(
    cuts=st.lists(st.integers(0, 64), min_size=1, max_size=6), dtype=st.sampled_from([np.float32, np.float64, np.int16])
)
def test_spanning_views_write_every_array_they_span(cuts, dtype):
    bounds = [0, *sorted(cuts), 80]
    buf = np.zeros(80, dtype=dtype)
    parts = [buf[a:b] for a, b in zip(bounds, bounds[1:])]
    view = spanning(parts)
    assert view is not None and view.size == 80 and view.dtype == buf.dtype
    view[:] = np.arange(80, dtype=dtype)
    assert np.array_equal(np.concatenate(parts), np.arange(80, dtype=dtype))


def test_spanning_refuses_gaps_order_dtypes_and_read_only_arrays():
    buf = np.zeros(16, dtype=np.float32)
    assert spanning([buf[0:4], buf[5:8]]) is None  # a gap
    assert spanning([buf[4:8], buf[0:4]]) is None  # out of order
    assert spanning([buf[0:4], buf[4:8].view(np.int32)]) is None  # another dtype
    assert spanning([buf[0:8:2], buf[8:12]]) is None  # not contiguous
    frozen = buf.copy()
    frozen.flags.writeable = False
    assert spanning([frozen[0:4], frozen[4:8]]) is None
