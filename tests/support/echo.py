"""What the link tests check against an echo peer (one that answers PUSH with AGGREGATE)."""

from __future__ import annotations

import numpy as np

from poseidon_aio.wire import DType, Kind


async def round_trips(conn, sizes, key: int = 9) -> None:
    """Send a float32 payload of each byte size in ``sizes`` and check that its echo lands,
    unchanged, in the buffer registered for it (the frame's payload is a view of that buffer)."""
    rng = np.random.default_rng(0)
    for clock, size in enumerate(sizes):
        grad = rng.standard_normal(size // 4, dtype=np.float32)
        into = np.empty_like(grad)
        fut = conn.expect(Kind.AGGREGATE, key=key, clock=clock, into=into)
        await conn.send(Kind.PUSH, grad, key=key, clock=clock, dtype=DType.FLOAT32)
        frame = await fut
        np.testing.assert_array_equal(into, grad, err_msg=f"{size}-byte payload")
        assert frame.header.dtype is DType.FLOAT32 and frame.header.length == grad.nbytes
        if grad.nbytes:
            assert frame.payload.obj is into or np.shares_memory(np.asarray(frame.payload), into)
