"""Benchmarks: ``python -m bench <name>``."""

import socket

# The token the bench's local workers share (handed over in their environment, as a launcher would).
BENCH_TOKEN = "bench-local-job-token-0123456789abcdef"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a job's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
