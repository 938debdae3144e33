"""A same-host peer that speaks the shared-memory link's protocol by hand (``net.shm``), blocking,
to misbehave on it: bytes before the handshake, malformed frames, a ring it may not offer."""

from __future__ import annotations

import mmap
import os
import socket

from poseidon_aio.net import shm


class RawRingPeer:
    """Dials abstract name ``name`` and exchanges rings; ``sealed=False`` offers a ring file the
    listener must refuse (it could shrink it under the listener's reads), ``size`` a ring of
    another size (the listener refuses one outside its bounds)."""

    def __init__(self, name: str, sealed: bool = True, size: int = shm.RING_BYTES) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect("\0" + name)
        if sealed:
            fd = shm._new_ring(size)
        else:
            fd = os.memfd_create("not-sealed", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
        socket.send_fds(self.sock, [shm._OFFER.pack(shm._MAGIC, shm._VERSION, size)], [fd])
        self.out, self.out_size = mmap.mmap(fd, size), size
        os.close(fd)
        self.ring_in = None
        data, fds, _, _ = socket.recv_fds(self.sock, shm._OFFER.size, 1)
        self.offered = len(data) == shm._OFFER.size and len(fds) == 1
        if fds:
            self.in_size = shm._OFFER.unpack(data)[2] if self.offered else shm.RING_BYTES
            self.ring_in = mmap.mmap(fds[0], self.in_size, prot=mmap.PROT_READ)
            os.close(fds[0])
        self._written = self._read = 0
        self._bells = b""

    def send(self, data: bytes) -> None:
        """Put ``data`` in our ring (it must fit the room the listener gave back) and ring."""
        pos = self._written % self.out_size
        first = min(len(data), self.out_size - pos)
        self.out[pos : pos + first] = data[:first]
        self.out[: len(data) - first] = data[first:]
        self._written += len(data)
        self.sock.sendall(shm._BELL.pack(b"W", len(data)))

    def ring(self, what: bytes, n: int) -> None:
        """Send a doorbell as given, true or not."""
        self.sock.sendall(shm._BELL.pack(what, n))

    def recv(self, _n: int = 0) -> bytes:
        """The bytes of the listener's next doorbells (b"" at EOF or reset)."""
        out = b""
        while not out:
            try:
                chunk = self.sock.recv(4096)
            except ConnectionResetError:
                return b""
            if not chunk:
                return b""
            data = self._bells + chunk
            whole = len(data) - len(data) % shm._BELL.size
            self._bells = data[whole:]
            for what, n in shm._BELL.iter_unpack(data[:whole]):
                if what == b"W":
                    pos = self._read % self.in_size
                    first = min(n, self.in_size - pos)
                    out += self.ring_in[pos : pos + first] + self.ring_in[: n - first]
                    self._read += n
        return out

    def read_to_end(self) -> bytes:
        out = b""
        while chunk := self.recv():
            out += chunk
        return out

    def close(self) -> None:
        self.sock.close()
        self.out.close()
        if self.ring_in is not None:
            self.ring_in.close()

    def __enter__(self) -> "RawRingPeer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
