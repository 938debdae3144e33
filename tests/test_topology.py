"""Hosts from the launcher, checked at the rendezvous (issue 44, part 1).

torchrun's and SLURM's variables become a placement; every rank's placements become one topology,
the same on every rank, or one error naming the host that differs. The rendezvous tests run the
real check: one ``Rendezvous`` per rank over a real ``TCPStore`` on loopback, in one process.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket

import pytest
import torch.distributed  # noqa: F401 - as in a trainer; the rendezvous deadline starts after it
from hypothesis import given, settings
from hypothesis import strategies as st

from poseidon_aio.cluster import ClusterEnv, InformationBook, Manifest, ParamSpec, Rendezvous
from poseidon_aio.cluster.topology import Placement, Topology, tasks_per_node
from poseidon_aio.errors import ConfigError, TopologyMismatch
from poseidon_aio.net.unix import PREFIX

from .support.cluster import free_port

TORCHRUN = {"MASTER_ADDR": "node-a", "MASTER_PORT": "29500"}


def torchrun_env(rank: int, hosts: int, local: int) -> dict:
    return {
        **TORCHRUN,
        "RANK": str(rank),
        "WORLD_SIZE": str(hosts * local),
        "LOCAL_RANK": str(rank % local),
        "LOCAL_WORLD_SIZE": str(local),
        "GROUP_RANK": str(rank // local),
        "GROUP_WORLD_SIZE": str(hosts),
    }


def test_torchrun_variables_name_the_host_and_the_local_rank():
    env = ClusterEnv.from_env(torchrun_env(5, 2, 3))
    assert (env.rank, env.world_size, env.node, env.local_rank, env.local_world_size, env.nnodes) == (5, 6, 1, 2, 3, 2)
    p = env.placement()
    assert (p.node, p.local_rank, p.local_world_size, p.nnodes, p.launcher) == (1, 2, 3, 2, "torchrun")


def test_without_a_group_rank_a_process_is_a_host_of_its_own():
    env = ClusterEnv.from_env({**TORCHRUN, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    assert env.node is None and env.local_rank == 1  # LOCAL_RANK is still there to pick a device
    p = env.placement()
    assert (p.node, p.local_rank, p.local_world_size) == (None, 0, 1)


def test_slurm_variables_where_no_rank_is_set():
    env = ClusterEnv.from_env(
        {
            **TORCHRUN,
            "SLURM_PROCID": "4",
            "SLURM_NTASKS": "6",
            "SLURM_LOCALID": "1",
            "SLURM_NODEID": "1",
            "SLURM_NNODES": "2",
            "SLURM_TASKS_PER_NODE": "3(x2)",
        }
    )
    assert (env.rank, env.world_size, env.node, env.local_rank, env.local_world_size, env.launcher) == (
        4,
        6,
        1,
        1,
        3,
        "slurm",
    )
    # srun + torchrun: torchrun's variables win over SLURM's.
    both = ClusterEnv.from_env({**torchrun_env(0, 1, 2), "SLURM_PROCID": "7", "SLURM_NTASKS": "8"})
    assert (both.rank, both.world_size, both.launcher) == (0, 2, "torchrun")


@pytest.mark.parametrize(
    "env, words",
    [
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "MASTER_ADDR, MASTER_PORT not set: under SLURM, export"),
        ({**TORCHRUN, "RANK": "0", "WORLD_SIZE": "2", "GROUP_RANK": "0"}, "LOCAL_RANK, LOCAL_WORLD_SIZE is not"),
        ({**torchrun_env(0, 1, 2), "LOCAL_RANK": "2"}, "local rank 2 is outside 0..1"),
        ({**TORCHRUN, "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "2(x"}, "malformed"),
        (
            {**TORCHRUN, "RANK": "0", "WORLD_SIZE": "2", "GROUP_RANK": "x", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"},
            "malformed",
        ),
    ],
)
def test_a_launcher_environment_that_does_not_add_up_is_a_config_error(env, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(".", r"\.")):
        ClusterEnv.from_env(env)


def test_slurm_tasks_per_node_spelled_out():
    assert tasks_per_node("4") == [4]
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    for bad in ("", "2(x0)", "a", "2(x99999999)"):
        with pytest.raises(ValueError):
            tasks_per_node(bad)


def placements(hosts: int, local: int, order: list, **over) -> dict:
    """``order``: the node of each rank (any assignment with ``local`` ranks a node)."""
    seen: dict = {}
    out = {}
    for rank, node in enumerate(order):
        lr = seen.get(node, 0)
        seen[node] = lr + 1
        out[rank] = Placement(node, lr, local, hosts, hostname=f"node-{node}", launcher="torchrun")
    for rank, fields in over.items():
        out[int(rank[1:])] = Placement(**{**out[int(rank[1:])].__dict__, **fields})
    return out


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.randoms(use_true_random=False))
def test_any_launcher_order_gives_every_rank_the_same_hosts(hosts, local, rnd):
    order = [n for n in range(hosts) for _ in range(local)]
    rnd.shuffle(order)
    topo = Topology.from_placements(placements(hosts, local, order))
    assert len(topo.hosts) == hosts and topo.local_size == local and topo.world == hosts * local
    for rank, node in enumerate(order):
        assert topo.host_of(rank) == node and topo.names[node] == f"node-{node}"
        assert rank in topo.local_peers(rank) and topo.hosts[node][topo.local_rank_of(rank)] == rank
    assert [topo.local_rank_of(topo.leader(h)) for h in range(hosts)] == [0] * hosts
    assert topo.by_host == (local > 1)
    for a in range(topo.world):
        assert sorted(b for b in range(topo.world) if topo.same_host(a, b)) == sorted(set(topo.local_peers(a)) - {a})
    shuffled = dict(random.Random(0).sample(sorted(placements(hosts, local, order).items()), hosts * local))
    assert Topology.from_placements(shuffled) == topo  # the same whatever order the store answered in


def test_no_launcher_host_is_the_flat_job():
    flat = {r: Placement(None, 0, 1) for r in range(3)}
    assert Topology.from_placements(flat) == Topology.flat(3) == Topology(((0,), (1,), (2,)))


@pytest.mark.parametrize(
    "hosts, order, over, words",
    [
        # 2 + 1: host 1 runs fewer workers than host 0 (each says so truthfully).
        (
            2,
            [0, 0, 1],
            {"r2": {"local_world_size": 1, "local_rank": 0}},
            "host 1 ('node-1') runs 1 workers where host 0 ('node-0') runs 2",
        ),
        (2, [0, 0, 1, 1], {"r3": {"node": None}}, "rank 3 was given no host"),
        (
            2,
            [0, 0, 1, 1],
            {"r3": {"local_rank": 0}},
            "ranks 2 and 3 both say they are local rank 0 on host 1 ('node-1')",
        ),
        (
            2,
            [0, 0, 0, 1],
            {"r3": {"local_world_size": 3}},
            "host 0 ('node-0') says it runs 2 workers but ranks [0, 1, 2]",
        ),
        (
            2,
            [0, 0, 1, 1],
            {"r0": {"local_world_size": 3}},
            "the ranks on host 0 ('node-0') disagree on its local world size",
        ),
        (
            2,
            [0, 0, 1, 1],
            {"r1": {"nnodes": 3}, "r0": {"nnodes": 3}, "r2": {"nnodes": 3}, "r3": {"nnodes": 3}},
            "says the job has [3] hosts but its 4 ranks are on 2",
        ),
    ],
)
def test_a_job_of_unequal_hosts_is_refused_naming_the_host(hosts, order, over, words):
    with pytest.raises(TopologyMismatch) as err:
        Topology.from_placements(placements(hosts, 2, order, **over))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_placement_off_the_store_is_type_checked():
    good = Placement(1, 0, 2, 2, "h", "torchrun")
    assert Placement.from_json(good.to_json(), 3) == good
    for bad in ("[]", '{"node": "1"}', good.to_json().replace('"local_rank": 0', '"local_rank": -1'), "{"):
        with pytest.raises(ConfigError, match="rank 3 published a placement"):
            Placement.from_json(bad, 3)


def test_the_information_book_records_the_hosts():
    m = Manifest([ParamSpec("w", (64, 64)), ParamSpec("b", (64,))])
    flat = InformationBook(m, workers=4, shards=4)
    assert flat.topology == Topology.flat(4)
    # A flat job's digest is what it was before the book recorded hosts: its shard checkpoints resume.
    # (The digest this book had on 9a82134, before the book took a topology.)
    assert flat.digest() == "20e83b48cde34130cb981df3b96867e3288f5cb571fa4bb0fa2806a3386cb6d9"
    two = InformationBook(m, workers=4, shards=4, topology=Topology(((0, 1), (2, 3))))
    assert two.topology.hosts == ((0, 1), (2, 3)) and two.digest() != flat.digest()
    assert two.digest() != InformationBook(m, workers=4, shards=4, topology=Topology(((0, 2), (1, 3)))).digest()
    with pytest.raises(ConfigError, match="hold 2 workers, the book 4"):
        InformationBook(m, workers=4, shards=4, topology=Topology(((0, 1),)))


async def _check_all(envs: list) -> list:
    """Every rank's ``check_topology`` over one real store, each its own Rendezvous."""
    rdzvs = [Rendezvous(env, timeout=20.0) for env in envs]
    async with asyncio.timeout(60):
        for r in rdzvs:
            await r.start()
        got = await asyncio.gather(*(r.check_topology() for r in rdzvs), return_exceptions=True)
        await asyncio.gather(*(r.leave(5.0) for r in reversed(rdzvs)))
    return got


async def test_every_rank_sees_the_same_hosts_through_the_store():
    port = free_port()
    envs = [
        ClusterEnv.from_env({**torchrun_env(r, 2, 2), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        for r in range(4)
    ]
    got = await _check_all(envs)
    assert all(t == got[0] for t in got) and got[0].hosts == ((0, 1), (2, 3))


async def test_a_host_with_another_local_world_size_is_refused_on_every_rank():
    port = free_port()
    base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "3"}
    # torchrun with --nproc-per-node 2 on host 0 and 1 on host 1.
    layout = [(0, 0, 2), (0, 1, 2), (1, 0, 1)]
    envs = [
        ClusterEnv.from_env(
            {**base, "RANK": str(r), "GROUP_RANK": str(n), "LOCAL_RANK": str(lr), "LOCAL_WORLD_SIZE": str(size)}
        )
        for r, (n, lr, size) in enumerate(layout)
    ]
    got = await _check_all(envs)
    for exc in got:
        assert isinstance(exc, TopologyMismatch), exc
        assert "host 1 (" in str(exc) and "runs 1 workers where host 0" in str(exc)


def test_a_trainer_under_torchrun_multi_node_knows_its_hosts_and_stays_exact():
    # 2 hosts x 2 workers as torchrun multi-node places them (GROUP_RANK, LOCAL_RANK,
    # LOCAL_WORLD_SIZE), all on loopback: the trainer and its parameter server's book hold the
    # hosts; SFB, all-reduce (summed inside the host first) and PS side by side, every layer by
    # all-reduce, and the same flat, all stay equal to one process.
    from .support.cluster import run_workers
    from .support.trainworkers import run_failures, single_process, train_worker

    def launcher(rank: int) -> dict:
        return {k: v for k, v in torchrun_env(rank, 2, 2).items() if k not in TORCHRUN}

    spec = {"kind": "mlp", "inputs": 20, "hidden": [48, 32], "classes": 4}
    workers, seed, steps, size = 4, 3, 3, 4
    runs = [
        ("mixed", "poseidon", "mixed"),
        ("hosts", "poseidon", "every-allreduce", "none"),
        ("flat", "poseidon", "every-allreduce", "none", {"hosts": "flat"}),
        ("fp16", "poseidon", {"0": "fp16", "2": "fp16", "4": "fp16"}, "none", {"compression": "fp16"}),
        ("ps", "wfbp", None, "none"),
        ("ps-flat", "wfbp", None, "none", {"hosts": "flat"}),
    ]
    res = run_workers(workers, train_worker, spec, seed, runs, steps, size, {}, timeout=120, env=launcher)
    for r in range(workers):
        assert res[r]["mixed"]["hosts"] == ((0, 1), (2, 3)) == res[r]["mixed"]["book_hosts"]
    assert_links_follow_the_hosts(res, "mixed", 2)
    assert_links_follow_the_hosts(res, "ps", 2)
    assert {"sfb", "allreduce", "ps"} <= set(res[0]["mixed"]["schemes"].values())
    reference = single_process(spec, seed, workers, steps, size)
    for label, *_ in runs:
        failures = run_failures(res, label, spec, reference, workers)
        if label == "fp16":  # lossy: every replica the same bits, not one process's
            failures = [f for f in failures if "single-process" not in f]
            assert set(res[0][label]["schemes"].values()) == {label}
        assert failures == []
    lm = {"kind": "lm", "vocab": 60, "width": 6, "sequence": 4, "hidden": [8], "classes": 3}
    lm_runs = [("rows", "poseidon", "rows-mixed"), ("rows-flat", "poseidon", "rows-mixed", None, {"hosts": "flat"})]
    res_lm = run_workers(workers, train_worker, lm, seed, lm_runs, steps, size, {}, timeout=120, env=launcher)
    lm_reference = single_process(lm, seed, workers, steps, size)
    for label, *_ in lm_runs:
        assert run_failures(res_lm, label, lm, lm_reference, workers) == []
    assert res_lm[0]["rows"]["schemes"]["embed"] == "rows"
    hosts = sum(res_lm[r]["rows"]["bytes"]["rows"] for r in range(workers))
    flat = sum(res_lm[r]["rows-flat"]["bytes"]["rows"] for r in range(workers))
    assert hosts < 0.55 * flat, (hosts, flat)  # a host's rows cross once (with a table of lengths)
    # A host sends its all-reduce bytes once: the sockets carry (H - 1) / (P - 1) = 1/3 of the
    # flat run's bytes (SFB's stacks the same: tests/test_hierarchical.py).
    hosts = sum(res[r]["hosts"]["bytes"]["allreduce"] for r in range(workers))
    flat = sum(res[r]["flat"]["bytes"]["allreduce"] for r in range(workers))
    assert abs(hosts / flat - 1 / 3) < 0.01, (hosts, flat)
    # The PS: one push and reply per host and message instead of one per worker, about half the
    # socket bytes (a shard on a worker's own host takes some flat pushes off the sockets too).
    hosts = sum(res[r]["ps"]["bytes"]["ps"] for r in range(workers))
    flat = sum(res[r]["ps-flat"]["bytes"]["ps"] for r in range(workers))
    assert 0.4 < hosts / flat < 0.6, (hosts, flat)


def assert_links_follow_the_hosts(res: dict, label: str, local: int) -> None:
    """Every link between two workers of one host, to a peer or to its shard, is the
    shared-memory one (where hosts run one worker each, none is); every other link is TCP."""
    for r, out in res.items():
        for peer, via in out[label]["links"].items():
            assert via == ("shm" if local > 1 and int(peer) // local == r // local else "tcp"), (r, peer, via)
        for shard, via in out[label]["shard_links"].items():
            want = "local" if int(shard) == r else "shm" if local > 1 and int(shard) // local == r // local else "tcp"
            assert via == want, (r, shard, via)


def _layout_env(hosts: int, local: int):
    def launcher(rank: int) -> dict:
        return {k: v for k, v in torchrun_env(rank, hosts, local).items() if k not in TORCHRUN}

    return launcher


@pytest.mark.parametrize("hosts, local", [(1, 2), (2, 3), (3, 1)])
def test_every_scheme_by_host_equals_one_process_on_other_layouts(hosts, local):
    # Real processes on loopback given host identities as torchrun multi-node would (2 x 2 is the
    # test above): SFB, all-reduce and PS side by side equal one process, fp16's replicas are
    # the same bits, on one host of two, two of three, and three of one (flat: every host one).
    from .support.cluster import run_workers
    from .support.trainworkers import run_failures, single_process, train_worker

    spec = {"kind": "mlp", "inputs": 20, "hidden": [48, 32], "classes": 4}
    workers, seed, steps, size = hosts * local, 5, 3, 4
    runs = [
        ("mixed", "poseidon", "mixed"),
        ("fp16", "poseidon", {"0": "fp16", "2": "fp16", "4": "fp16"}, "none", {"compression": "fp16"}),
    ]
    res = run_workers(
        workers, train_worker, spec, seed, runs, steps, size, {}, timeout=180, env=_layout_env(hosts, local)
    )
    expected = tuple(tuple(range(h * local, (h + 1) * local)) for h in range(hosts))
    assert all(res[r]["mixed"]["hosts"] == expected for r in range(workers))
    assert_links_follow_the_hosts(res, "mixed", local)
    assert run_failures(res, "mixed", spec, single_process(spec, seed, workers, steps, size), workers) == []
    assert [
        f
        for f in run_failures(res, "fp16", spec, single_process(spec, seed, workers, steps, size), workers)
        if "single-process" not in f
    ] == []


@settings(max_examples=80, deadline=None)
@given(
    hosts=st.integers(2, 8),
    local=st.integers(2, 8),
    m=st.integers(1, 4096),
    n=st.integers(1, 4096),
    k=st.integers(1, 256),
    gbit=st.sampled_from([0.1, 1.0, 10.0]),
)
def test_the_cost_model_charges_the_network_by_hosts(hosts, local, m, n, k, gbit):
    # Bytes only on the host's link (the link inside a host free): the hierarchical all-reduce
    # is a ring's over P_h hosts, SFB's stacks K L (M + N) (P_h - 1), the PS one push a host.
    from poseidon_aio.plan.cost import Hosts, LayerShape, Link, Scheme, hybcomm_choice, predicted_time

    layer = LayerShape("fc", "fc", m, n, rows=k)
    link = Link.of_bandwidth(gbit * 1.25e8)
    on = Hosts(hosts, local)
    P, b = on.workers, 4 * m * n
    t = {s: predicted_time(layer, s, P, P, link, hosts=on) for s in (Scheme.ALLREDUCE, Scheme.SFB, Scheme.PS)}
    assert t[Scheme.ALLREDUCE] == pytest.approx(link.beta * 2 * b * (hosts - 1) / hosts)
    assert t[Scheme.SFB] == pytest.approx(link.beta * 4 * k * local * (m + n) * (hosts - 1))
    # The PS by host: the flat formula with P_h workers and the shards as P_h hosts.
    assert t[Scheme.PS] == pytest.approx(predicted_time(layer, Scheme.PS, hosts, hosts, link))
    # SFB against the all-reduce breaks even at the same K as flat (both scale by 1/L on a
    # host's link).
    flat = hybcomm_choice(layer, P, P, link=link, candidates=(Scheme.SFB, Scheme.ALLREDUCE))
    assert hybcomm_choice(layer, P, P, link=link, candidates=(Scheme.SFB, Scheme.ALLREDUCE), hosts=on) is flat


def test_explain_shows_the_choices_by_host_beside_flat():
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "poseidon_aio.cli", "explain", "--model", "vgg19", "--hosts", "2", "--local", "4"]
        + ["--batch", "32", "--bandwidth", "1gbit", "--alpha", "100", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    got = json.loads(out.stdout)
    assert (got["workers"], got["hosts"], got["local"]) == (8, 2, 4)
    rows = {r["name"]: r for r in got["layers"]}
    # The PS-or-all-reduce switch moves: by host a convolution's keys spread over every host's
    # shards, and the PS ties the all-reduce's bytes (a tie is Algorithm 1's: the PS); flat, over
    # 8 shards it holds too few chunks to spread, and the all-reduce wins.
    convs = [r for r in rows.values() if r["kind"] == "conv"]
    assert {r["hybcomm"] for r in convs} == {"ps"} and {r["hybcomm_flat"] for r in convs} == {"allreduce"}
    # SFB against either breaks even at the same K by host as flat: every scheme's bytes on a
    # host's link shrink alike, K* = 2MN / (P (M + N)).
    for name in ("fc6", "fc7", "fc8"):
        assert rows[name]["hybcomm"] == "sfb" and rows[name]["sfb_up_to_k"] == rows[name]["sfb_up_to_k_flat"]


@pytest.mark.parametrize("scheme", ["allreduce", "sfb", "ps"])
def test_a_local_worker_killed_ends_the_job_naming_its_host_and_local_rank(scheme, tmp_path):
    # 2 hosts x 2 workers; rank 3 (host 1, local rank 1) dies by SIGKILL before its third step.
    # Every survivor's step fails within the sync timeout with ConnectionLost, and the message
    # names the dead rank's host and local rank: seen on its own link (the shared-memory one to
    # its host's other worker), or as the reason a peer that saw it gave before closing its links.
    # Nothing of the job's is left on the host: no rank ever opened or mapped a file under
    # /dev/shm or /tmp, its Unix sockets have abstract names only (no file), and every one of
    # those names is gone once the ranks are.
    from .support.cluster import collect_all, start_workers
    from .support.trainworkers import killed_worker

    def launcher(rank: int) -> dict:
        return {k: v for k, v in torchrun_env(rank, 2, 2).items() if k not in TORCHRUN}

    procs, out = start_workers(4, killed_worker, 3, scheme, 6, str(tmp_path), env=launcher)
    results, errors = collect_all(procs, out, timeout=120)
    assert set(errors) == {3} and errors[3][0] == "died", errors
    for rank in (0, 1, 2):
        kind, message, took = results[rank]
        # A PS worker may hear it from a shard first: WorkerLeft, the PS's word for a lost worker.
        assert kind in ("ConnectionLost", "WorkerLeft" if scheme == "ps" else "ConnectionLost"), (rank, kind, message)
        assert "rank 3 (host 1 'vm', local rank 1)" in message.replace(socket.gethostname(), "vm"), (rank, message)
        assert took < 30.0 and "\n" not in message, (rank, took)
    names = []
    for rank in range(4):
        seen = json.loads((tmp_path / f"{rank}.json").read_text())
        assert seen["files"] == [] and seen["mapped"] == [], (rank, seen)
        assert all(p.startswith("@") for p in seen["unix_paths"]), (rank, seen)
        mine = [p for p in seen["unix_paths"] if p.startswith(f"@{PREFIX}{seen['pid']}-")]
        assert mine, (rank, seen)  # it listened for its host's other worker
        names += mine
    with open("/proc/net/unix") as f:
        left = f.read()
    assert [n for n in names if n in left] == []
    assert [e for e in os.listdir("/dev/shm") if "poseidon" in e] == []


def test_the_cost_model_sends_an_embedding_s_rows_once_a_host_pair():
    from poseidon_aio.plan.cost import Hosts, LayerShape, Link, Scheme, predicted_time

    emb = LayerShape("embed", "embedding", 30000, 64, rows=512)
    link = Link.of_bandwidth(1.25e8)
    flat = predicted_time(emb, Scheme.ROWS, 8, 8, link)  # one worker's rows to 7 peers
    by_host = predicted_time(emb, Scheme.ROWS, 8, 8, link, hosts=Hosts(2, 4))  # a host's 4, to 1 host
    assert flat == pytest.approx(link.beta * 4 * 512 * 65 * 7)
    assert by_host == pytest.approx(link.beta * 4 * 512 * 65 * 4)


def test_a_launchers_free_port_is_drawn_below_the_ephemeral_range_and_can_be_bound():
    # A port from the ephemeral range can be taken as a source port by any connection opened on
    # this host before the store binds it; the launcher's is drawn below that range.
    from poseidon_aio.cluster.launcher import _ephemeral_low, free_port

    ports = {free_port() for _ in range(20)}
    assert all(10000 <= p < _ephemeral_low() for p in ports), ports
    assert len(ports) > 1  # drawn, not a fixed port two jobs would share
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))
