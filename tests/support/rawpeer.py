"""A client that drives the handshake by hand over a blocking link, so a test can misbehave after it."""

from __future__ import annotations

from typing import Callable

from poseidon_aio.net.handshake import Handshake
from poseidon_aio.wire import DType, FrameDecoder, encode_frame


def raw_handshake(send: Callable[[bytes], object], recv: Callable[[int], bytes], hs: Handshake) -> None:
    """Run ``hs`` (a client's) to the end over ``send(data)`` and ``recv(n)``: a socket's
    ``sendall``/``recv``, or a raw shared-memory peer's ``send``/``recv``."""
    dec = FrameDecoder()
    for kind, payload in hs.start():
        send(encode_frame(kind, payload, rank=hs.rank, dtype=DType.JSON))
    while not hs.ready:
        data = recv(4096)
        assert data, "listener closed during the handshake"
        dec.feed(data)
        while (frame := dec.next_frame()) is not None:
            for kind, payload in hs.receive(frame):
                send(encode_frame(kind, payload, rank=hs.rank, dtype=DType.JSON))
