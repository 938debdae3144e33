"""Hosts for the bench: one network namespace per process on a bridge, each link capped by tc tbf.

Needs root (and iproute2). Each namespace ``psdn<tag>_<i>`` has ``eth0`` = 10.77.0.<i+1>/24 on
a veth whose host end is on bridge ``pb<tag>``; tbf caps both directions (egress inside the
namespace = the process's upload, egress of the host end = its download), with the 256 KB burst
a 1 Gbit tbf needs. ``tag`` is this process's id, so two benches on one machine never touch each
other's hosts (their subnets are the same, on separate bridges). Everything made here is removed
by ``teardown`` (also on error).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from contextlib import contextmanager

SUBNET = "10.77.0"
TAG = os.getpid() % 100_000


def _names(i: int) -> tuple:
    """(namespace, host end of its veth); interface names stay under Linux's 15 characters."""
    return f"psdn{TAG}_{i}", f"pv{TAG}_{i}"


BRIDGE = f"pb{TAG}"


def available() -> tuple:
    """``(True, "")`` where namespaces can be made, else ``(False, why)``."""
    if os.geteuid() != 0:
        return False, "not root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return False, "iproute2 (ip, tc) missing"
    probe = f"psdnprobe{TAG}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return False, f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True, ""


def _sh(*cmd: str) -> None:
    done = subprocess.run(list(cmd), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")


def address(i: int) -> str:
    return f"{SUBNET}.{i + 1}"


def teardown(n: int = 64) -> None:
    """Remove this process's namespaces, their veths and its bridge. A veth goes with its
    namespace only once the kernel frees it, which a worker still exiting delays: deleting its
    host end here frees the name for the next run's at once."""
    for i in range(n):
        ns, host_end = _names(i)
        subprocess.run(["ip", "link", "del", host_end], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)


@contextmanager
def hosts(n: int, rate: str):
    """``n`` namespaces whose links are capped at ``rate`` (tc syntax, e.g. "1gbit")."""
    teardown()
    try:
        _sh("ip", "link", "add", BRIDGE, "type", "bridge")
        _sh("ip", "link", "set", BRIDGE, "up")
        for i in range(n):
            ns, host_end = _names(i)
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _sh("ip", "link", "set", host_end, "master", BRIDGE)
            _sh("ip", "link", "set", host_end, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{address(i)}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            for where in (["tc"], ["ip", "netns", "exec", ns, "tc"]):
                dev = host_end if len(where) == 1 else "eth0"
                _sh(
                    *where,
                    "qdisc",
                    "add",
                    "dev",
                    dev,
                    "root",
                    "tbf",
                    "rate",
                    rate,
                    "burst",
                    "256kb",
                    "latency",
                    "100ms",
                )
        yield [_names(i)[0] for i in range(n)]
    finally:
        teardown(n)


def tcp_counters() -> dict:
    """This process's network namespace's TCP counters that say a link lost bytes:
    ``{"retrans_segs", "timeouts", "loss_probes"}`` (RetransSegs of /proc/net/snmp; TCPTimeouts,
    TCPLossProbes of /proc/net/netstat). A worker in its own namespace reads its own link's: no
    watcher process, nothing on the cores while it runs. Zeros where the files are absent."""
    wanted = {
        ("Tcp", "RetransSegs"): "retrans_segs",
        ("TcpExt", "TCPTimeouts"): "timeouts",
        ("TcpExt", "TCPLossProbes"): "loss_probes",
    }
    out = dict.fromkeys(wanted.values(), 0)
    for path in ("/proc/net/snmp", "/proc/net/netstat"):
        try:
            with open(path) as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for names, values in zip(lines[::2], lines[1::2]):  # a header line, then its values
            proto, _, keys = names.partition(":")
            for key, value in zip(keys.split(), values.partition(":")[2].split()):
                if (proto, key) in wanted:
                    out[wanted[(proto, key)]] = int(value)
    return out
