"""``poseidon-aio``: the command line.

poseidon-aio info [--require-extension]   versions, codec, event loop, network interfaces
poseidon-aio shard --index S              host one parameter-server shard (standalone layout)
poseidon-aio explain --fc 4096x4096 ...   per-layer cost model and scheme choice
poseidon-aio run -n 4 script.py [args]    N local workers of a script, through torchrun
poseidon-aio run --nnodes 2 --node-rank 0 --master-addr A --master-port P -n 4 script.py
                                          this host's 4 workers of a 2-host job
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional


def _info(args: argparse.Namespace) -> int:
    import platform

    from . import __version__
    from .net import LOOP
    from .net.core import RECEIVE_CORE, RECEIVE_CORES
    from .ps.tally import TALLIES, TALLY
    from .wire import CODEC, CODECS, CRC32C_HARDWARE

    print(f"poseidon_aio {__version__}: codec {CODEC} (built: {', '.join(sorted(CODECS))}), loop {LOOP}")
    print(f"receive core: {RECEIVE_CORE} (built: {', '.join(sorted(RECEIVE_CORES))})")
    print(f"shard tally: {TALLY} (built: {', '.join(sorted(TALLIES))})")
    print(f"payload CRC32C: {'CPU instructions' if CRC32C_HARDWARE else 'software (no SSE4.2 or ARMv8 CRC: slow)'}")
    versions = {"python": platform.python_version()}
    for name in ("torch", "numpy", "uvloop", "crc32c", "cupy"):
        versions[name] = _version_of(name)
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    print("interfaces: " + (", ".join(f"{name} {addr}" for name, addr in _interfaces()) or "none found"))
    if args.require_extension:
        missing = [
            what
            for what, built in (("codec", CODECS), ("receive core", RECEIVE_CORES), ("shard tally", TALLIES))
            if "cython" not in built
        ]
        if missing:
            verb = "is" if len(missing) == 1 else "are"
            print(f"the compiled {' and '.join(missing)} {verb} not built: is a C compiler installed?", file=sys.stderr)
            return 1
    return 0


def _version_of(package: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _interfaces() -> list:
    """``[(name, IPv4 address or "-")]`` of this host's network interfaces (Linux: an ioctl per
    interface; elsewhere the names only)."""
    import socket
    import struct

    out = []
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return out
    for name in names:
        addr = "-"
        try:
            import fcntl

            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
                addr = socket.inet_ntoa(packed[20:24])
        except (ImportError, OSError):
            pass
        out.append((name, addr))
    return out


def _shard(args: argparse.Namespace) -> int:
    import os

    from .net import run
    from .ps.server import serve_shard

    stats = run(
        serve_shard(
            args.index,
            master_addr=args.master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=args.master_port or int(os.environ["MASTER_PORT"]),
            workers=args.workers or int(os.environ["WORLD_SIZE"]),
            timeout=args.timeout,
        )
    )
    print(f"shard {args.index} done: {stats}")
    return 0


def _explain(args: argparse.Namespace) -> int:
    import json

    from .plan.cost import (
        Hosts,
        Link,
        LayerShape,
        Scheme,
        best_scheme,
        hybcomm_choice,
        layer_cost,
        layers_of_manifest,
        predicted_time,
    )
    from .units import parse_rate_bytes

    layers = []
    if args.model:
        from .plan.models import PRESETS

        layers += layers_of_manifest(PRESETS[args.model](), rows=args.batch)
    for i, text in enumerate(args.fc or []):
        try:
            m, n = (int(x) for x in text.lower().split("x"))
        except ValueError:
            print(f"--fc takes MxN (outputs x inputs), got {text!r}", file=sys.stderr)
            return 2
        layers.append(LayerShape(f"fc{i}", "fc", m, n, rows=args.batch))
    if not layers:
        print("give --model or one or more --fc MxN", file=sys.stderr)
        return 2
    if args.compression and not args.bandwidth:
        args.bandwidth = "1gbit"  # compute seconds cannot be weighed against a bytes-only link
    try:
        candidates = tuple(Scheme(s) for s in args.schemes.split(","))
        link = (
            Link.of_bandwidth(parse_rate_bytes(args.bandwidth), args.alpha * 1e-6)
            if args.bandwidth
            else Link(args.alpha * 1e-6, 1.0)
        )
    except ValueError as exc:
        print(f"explain: {exc}", file=sys.stderr)
        return 2
    hosts = None
    if args.hosts is not None or args.local is not None:
        try:
            inside = Link.of_bandwidth(parse_rate_bytes(args.inside)) if args.inside else Link(0.0, 0.0)
            hosts = Hosts(args.hosts or 1, args.local or 1, inside)
        except ValueError as exc:
            print(f"explain: {exc}", file=sys.stderr)
            return 2
        args.workers = hosts.workers
    if args.compression:
        return _explain_compression(args, candidates, link)
    servers = args.servers or args.workers

    def sfb_up_to(layer, on_hosts) -> Optional[int]:
        """The largest K (up to 65 536) at which HybComm still sends ``layer`` by SFB."""
        if layer.kind != "fc" or Scheme.SFB not in candidates:
            return None

        def sfb(k: int) -> bool:
            choice = hybcomm_choice(
                layer.with_rows(k),
                args.workers,
                servers,
                link=link,
                candidates=candidates,
                hosts=on_hosts,
                merged=not args.unmerged,
            )
            return choice is Scheme.SFB

        if not sfb(1):
            return 0
        lo, hi = 1, 1 << 16
        if sfb(hi):
            return hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if sfb(mid) else (lo, mid)
        return lo

    keys = (
        "ps_worker",
        "ps_combined",
        "sfb",
        "adam",
        "allreduce",
        "chosen",
        "hybcomm_floats",
        "cluster_ps",
        "cluster_sfb",
        "cluster_adam",
    )
    rows, totals = [], {k: 0.0 for k in keys}
    for layer in layers:
        cost = layer_cost(layer, args.workers, servers)
        choice = best_scheme(layer, args.workers, servers)
        hybrid = hybcomm_choice(
            layer, args.workers, servers, link=link, candidates=candidates, hosts=hosts, merged=not args.unmerged
        )
        floats = {
            Scheme.PS: cost.ps_combined,
            Scheme.SFB: cost.sfb,
            Scheme.ALLREDUCE: cost.allreduce,
            Scheme.ROWS: cost.rows,
        }
        fc = layer.kind == "fc"
        row = {
            "name": layer.name,
            "kind": layer.kind.value,
            "shape": [layer.m, layer.n] if fc else [layer.params],
            "K": layer.rows if fc else None,
            "ps_worker": cost.ps_worker,
            "ps_combined": cost.ps_combined,
            "sfb": cost.sfb if fc else None,
            "adam": cost.adam if fc else None,
            "allreduce": cost.allreduce,
            "choice": choice.value,
            "chosen": floats[choice],
            "hybcomm": hybrid.value,
            "hybcomm_floats": floats[hybrid],
            "predicted_s": {
                c.value: predicted_time(layer, c, args.workers, servers, link, hosts=hosts) for c in candidates
            },
            "cluster_ps": cost.cluster_ps,
            "cluster_sfb": cost.cluster_sfb if fc else None,
            "cluster_adam": cost.cluster_adam if fc else None,
        }
        if hosts is not None:  # the same job with every worker a peer of its own, beside it
            row["hybcomm_flat"] = hybcomm_choice(
                layer, args.workers, servers, link=link, candidates=candidates, merged=not args.unmerged
            ).value
            row["sfb_up_to_k"] = sfb_up_to(layer, hosts)
            row["sfb_up_to_k_flat"] = sfb_up_to(layer, None)
        rows.append(row)
        for key in totals:
            value = (
                row[key]
                if row.get(key) is not None
                else row["cluster_ps" if key.startswith("cluster") else "ps_combined"]
            )
            totals[key] += value
    if args.json:
        out = {
            "workers": args.workers,
            "hosts": hosts.hosts if hosts else None,
            "local": hosts.local if hosts else None,
            "servers": servers,
            "batch": args.batch,
            "alpha_s": link.alpha,
            "beta_s_per_byte": link.beta,
            "schemes": [c.value for c in candidates],
            "layers": rows,
            "totals": totals,
        }
        print(json.dumps(out))
        return 0

    def mf(x):
        return "-" if x is None else f"{x / 1e6:.2f}"

    print(
        "floats per worker node, in and out, millions "
        f"(P1={args.workers} workers, P2={servers} shards, K={args.batch} rows)"
    )
    print(
        f"{'layer':<24} {'kind':<5} {'shape':<14} {'K':>5} {'PS worker':>10} {'PS w+s':>10} "
        f"{'SFB':>10} {'Adam':>10} {'all-red.':>10}  paper  hybcomm"
    )
    for r in rows:
        shape = "x".join(map(str, r["shape"]))
        print(
            f"{r['name'][:24]:<24} {r['kind']:<5} {shape:<14} {r['K'] or '-':>5} "
            f"{mf(r['ps_worker']):>10} {mf(r['ps_combined']):>10} "
            f"{mf(r['sfb']):>10} {mf(r['adam']):>10} {mf(r['allreduce']):>10}  {r['choice']:<6} {r['hybcomm']}"
        )
    print(
        f"{'total':<24} {'':<5} {'':<14} {'':>5} "
        f"{mf(totals['ps_worker']):>10} {mf(totals['ps_combined']):>10} {mf(totals['sfb']):>10} "
        f"{mf(totals['adam']):>10} {mf(totals['allreduce']):>10}  "
        f"paper's hybrid {mf(totals['chosen'])}, hybcomm {mf(totals['hybcomm_floats'])}"
    )
    print(
        "cluster totals per iteration (2015 paper's accounting), millions: "
        f"full-matrix PS {mf(totals['cluster_ps'])}, "
        f"SFB {mf(totals['cluster_sfb'])}, Adam {mf(totals['cluster_adam'])} "
        "(non-FC layers counted as PS in the last two)"
    )
    what = (
        f"{args.bandwidth} links, alpha {args.alpha:g} us"
        if args.bandwidth
        else "bytes only (give --bandwidth and --alpha for times)"
    )
    print(
        f"hybcomm: the least predicted time among {', '.join(c.value for c in candidates)} on {what}; "
        "ties go to the paper's choice"
        + ("" if args.unmerged or not args.alpha else "; a mergeable scheme's start-ups are its merge group's")
    )
    if hosts is not None:
        print(
            f"\n{hosts.hosts} hosts of {hosts.local} workers: times on a host's link (every scheme by host), "
            "beside the same job flat; SFB up to K: the largest batch rows a worker at which HybComm still "
            "sends the layer by SFB"
        )
        print(f"{'layer':<24} {'hybcomm':<10} {'flat':<10} {'SFB up to K':>12} {'flat':>8}")
        for r in rows:
            up, flat = r["sfb_up_to_k"], r["sfb_up_to_k_flat"]
            print(
                f"{r['name'][:24]:<24} {r['hybcomm']:<10} {r['hybcomm_flat']:<10} "
                f"{'-' if up is None else up:>12} {'-' if flat is None else flat:>8}"
            )
    return 0


def _plan_layers(args: argparse.Namespace) -> list:
    """The layers of ``--model`` / ``--fc`` as the plan sees them, with their parameters' shapes."""
    from .plan.cost import LayerShape, layers_of_manifest
    from .plan.hybcomm import PlanLayer

    out = []
    if args.model:
        from .plan.models import PRESETS

        specs = list(PRESETS[args.model]())
        shapes: dict = {}
        for spec in specs:
            shapes.setdefault(spec.name.rpartition(".")[0], []).append(tuple(spec.shape))
        for layer in layers_of_manifest(specs, rows=args.batch):
            out.append(PlanLayer(layer, layer.kind.value == "fc", params=tuple(shapes[layer.name])))
    for i, text in enumerate(args.fc or []):
        m, n = (int(x) for x in text.lower().split("x"))
        out.append(PlanLayer(LayerShape(f"fc{i}", "fc", m, n, rows=args.batch, bias=True), True, params=((m, n), (m,))))
    return out


def _explain_compression(args: argparse.Namespace, candidates: tuple, link) -> int:
    """Per layer: every candidate's predicted time (exact schemes and the lossy ones it suits),
    the choice and why, with the compression compute measured on this machine."""
    import json

    from .errors import ConfigError
    from .plan.hybcomm import Mode, choose_schemes
    from .plan.lossy import CompressionConfig, LossyPlanner
    from .sync.compress import measure_compute

    try:
        config = CompressionConfig(args.compression, rank=args.rank, ratio=args.ratio, min_elements=args.min_elements)
    except ConfigError as exc:
        print(f"explain: {exc}", file=sys.stderr)
        return 2
    layers = _plan_layers(args)
    servers = args.servers or args.workers
    costs = measure_compute(config)
    report: dict = {}
    rows = {layer.name: layer.shape.rows for layer in layers}
    choose_schemes(
        layers,
        rows,
        mode=Mode.POSEIDON,
        workers=args.workers,
        shards=servers,
        link=link,
        candidates=candidates,
        compression=LossyPlanner(config, costs),
        report=report,
        merged=not args.unmerged,
    )
    if args.json:
        out = {
            "workers": args.workers,
            "servers": servers,
            "alpha_s": link.alpha,
            "beta_s_per_byte": link.beta,
            "compression": json.loads(config.settings()),
            "compute": json.loads(costs.to_json()),
            "layers": [
                {
                    "name": name,
                    "params": [list(p) for p in layer.params],
                    "predicted_s": w.times,
                    "exact": w.exact.value,
                    "choice": w.choice.value,
                    "why": w.why,
                }
                for layer, (name, w) in zip(layers, report.items())
            ],
        }
        print(json.dumps(out))
        return 0
    seen = {s for w in report.values() for s in w.times}
    names = [s for s in [*(c.value for c in candidates), *(s.value for s in config.schemes)] if s in seen]
    print(
        f"predicted ms per layer sync (P1={args.workers} workers, P2={servers} shards, "
        f"{args.bandwidth} links, alpha {args.alpha:g} us; "
        f"compression {config.method.value}: PowerSGD rank {config.rank}, top-k {config.ratio:g}, "
        f"exact under {config.min_elements} elements)"
    )
    print(f"{'layer':<24} {'elements':>10} " + " ".join(f"{n:>9}" for n in names) + "  choice     why")
    for layer, (name, w) in zip(layers, report.items()):
        cells = " ".join(f"{w.times[n] * 1e3:>9.3f}" if n in w.times else f"{'-':>9}" for n in names)
        print(f"{name[:24]:<24} {layer.shape.params:>10} {cells}  {w.choice.value:<10} {w.why}")
    lossy = [name for name, w in report.items() if w.choice.value not in {c.value for c in candidates}]
    print(
        f"lossy: {len(lossy)} of {len(report)} layers; "
        f"compute measured here, seconds = a + b x elements: {costs.to_json()}"
    )
    return 0


def _run(args: argparse.Namespace) -> int:
    """N workers on this host through torchrun (in this process, so a failure reads as one line per
    rank); with ``--nnodes``, this host's part of a job over several, each started alike."""
    import logging
    import os
    import secrets
    import shutil
    import socket
    import tempfile

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun

    from .cluster.launcher import free_port
    from .errors import ConfigError
    from .net.credentials import TOKEN_ENV, TOKEN_FILE_ENV, self_signed, tls_env, token_from_env

    hosts = args.nnodes
    if hosts < 1 or not 0 <= args.node_rank < hosts or args.nproc < 1:
        raise ConfigError(
            f"--nnodes {hosts} --node-rank {args.node_rank} -n {args.nproc}: need -n >= 1 and "
            "0 <= --node-rank < --nnodes"
        )
    if hosts > 1:
        if args.master_addr is None or args.master_port is None:
            raise ConfigError(
                "with --nnodes > 1 give every host the same --master-addr (host 0's address) and --master-port"
            )
        if not (args.token_file or os.environ.get(TOKEN_ENV) or os.environ.get(TOKEN_FILE_ENV)):
            raise ConfigError(
                f"with --nnodes > 1 every host needs the same cluster token: set {TOKEN_ENV} or give --token-file "
                "(the same file's contents on every host); it never travels through the rendezvous"
            )
        if args.tls:
            raise ConfigError(
                "--tls makes a certificate for one host's run; with --nnodes > 1 give every host the same files "
                "through POSEIDON_TLS_CERT, POSEIDON_TLS_KEY and POSEIDON_TLS_CA"
            )
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if args.token_file:
        env[TOKEN_FILE_ENV] = os.path.abspath(args.token_file)
        token_from_env({TOKEN_FILE_ENV: env[TOKEN_FILE_ENV]})  # unreadable or short: say so now
    elif not (os.environ.get(TOKEN_ENV) or os.environ.get(TOKEN_FILE_ENV)):
        # A fresh token for this job's local workers, handed over in their environment (readable
        # by this user and root only), never through the rendezvous store.
        env[TOKEN_ENV] = secrets.token_hex(32)
    tls_dir = None
    if args.tls:
        tls_dir = tempfile.mkdtemp(prefix="poseidon-tls-")  # mode 0700
        env.update(tls_env(self_signed(tls_dir)))
    if args.trace:
        env["POSEIDON_TRACE"] = os.path.abspath(args.trace)
    env["POSEIDON_ERRORS"] = "full" if args.debug else "brief"
    os.environ.update(env)
    master = args.master_addr or "127.0.0.1"
    port = args.master_port
    if args.node_rank == 0 and not port:  # this host's agent hosts the store
        port = free_port("127.0.0.1" if hosts == 1 else "")
    elif args.node_rank == 0:  # a port in use fails here, in one line
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1" if hosts == 1 else "", port))
            except OSError as exc:
                raise ConfigError(
                    f"--master-port {port} cannot be used here ({exc.strerror}): another job may hold it; "
                    "give another port, or leave --master-port out for a free one"
                ) from None
    torch_args = get_args_parser().parse_args(
        [
            f"--nproc-per-node={args.nproc}",
            f"--nnodes={hosts}",
            f"--node-rank={args.node_rank}",
            f"--master-addr={master}",
            f"--master-port={port}",
            args.script,
            *args.script_args,
        ]
    )
    if not args.debug:
        # torchrun's agent logs each SIGTERM it sends and a report per failure; the ranks have
        # already said what went wrong, in one line each.
        # (Its modules set their own loggers' levels, so each is quietened, not just the parent.)
        for name in ["torch.distributed.elastic", *logging.root.manager.loggerDict]:
            if name.startswith("torch.distributed.elastic"):
                logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        torchrun(torch_args)
        return 0
    except ChildFailedError as exc:
        if args.debug:
            raise
        codes = {rank: failure.exitcode for rank, failure in sorted(exc.failures.items())}
        print(
            f"poseidon-aio run: rank(s) {sorted(codes)} of {args.script} failed (exit codes {list(codes.values())}); "
            "their errors are above, --debug shows full tracebacks",
            file=sys.stderr,
        )
        return 1
    except SignalException as exc:
        if args.debug:
            raise
        print(f"poseidon-aio run: stopped by {exc.sigval.name}; every rank was stopped", file=sys.stderr)
        return 128 + int(exc.sigval)
    finally:
        if tls_dir is not None:
            shutil.rmtree(tls_dir, ignore_errors=True)


def main(argv=None) -> int:
    from . import __version__

    parser = argparse.ArgumentParser(prog="poseidon-aio", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"poseidon-aio {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, the codec and event loop in use, network interfaces")
    info.add_argument(
        "--require-extension",
        action="store_true",
        help="fail if the Cython codec, receive core or shard tally is not built",
    )
    info.set_defaults(func=_info)
    shard = sub.add_parser("shard", help="run one parameter-server shard in this process")
    shard.add_argument("--index", type=int, required=True, help="which shard (0 .. shards-1)")
    shard.add_argument("--workers", type=int, help="number of workers (default: $WORLD_SIZE)")
    shard.add_argument("--master-addr", help="rendezvous host (default: $MASTER_ADDR)")
    shard.add_argument("--master-port", type=int, help="rendezvous port (default: $MASTER_PORT)")
    shard.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the workers")
    shard.set_defaults(func=_shard)
    explain = sub.add_parser("explain", help="the cost model and BestScheme, per layer")
    explain.add_argument("--model", choices=["vgg19", "alexnet", "resnet50"], help="a model preset")
    explain.add_argument(
        "--fc", action="append", metavar="MxN", help="a fully-connected layer (outputs x inputs); repeatable"
    )
    explain.add_argument("--workers", type=int, default=8)
    explain.add_argument("--hosts", type=int, help="P_h hosts of --local workers each (sets --workers)")
    explain.add_argument("--local", type=int, help="L workers a host (with --hosts; default 1)")
    explain.add_argument(
        "--inside", help="the link between a host's workers, e.g. 20gbit (with --hosts; default: free)"
    )
    explain.add_argument("--servers", type=int, help="parameter-server shards (default: one per worker)")
    explain.add_argument("--batch", type=int, default=32, help="K, rows per worker")
    explain.add_argument(
        "--bandwidth", help="each worker's link, e.g. 1gbit, 100mbit or bytes/s (default: compare bytes)"
    )
    explain.add_argument("--alpha", type=float, default=0.0, help="start-up per round of messages, microseconds")
    explain.add_argument("--schemes", default="ps,sfb,allreduce", help="what HybComm weighs (the paper's: ps,sfb)")
    explain.add_argument(
        "--unmerged",
        action="store_true",
        help="every layer a message of its own (MergeConfig(kind='none')); by default, as the trainer plans, a "
        "mergeable scheme's start-ups are its merge group's",
    )
    explain.add_argument(
        "--compression",
        choices=["auto", "fp16", "powersgd", "topk"],
        help=(
            "weigh lossy schemes too: per layer every candidate's predicted time and the choice "
            "(link: --bandwidth, default 1gbit)"
        ),
    )
    explain.add_argument("--rank", type=int, default=4, help="PowerSGD's rank (with --compression)")
    explain.add_argument("--ratio", type=float, default=0.01, help="top-k's density (with --compression)")
    explain.add_argument(
        "--min-elements",
        type=int,
        default=16384,
        help="matrix elements under which a layer stays exact (with --compression)",
    )
    explain.add_argument("--json", action="store_true")
    explain.set_defaults(func=_explain)
    runner = sub.add_parser("run", help="start N workers of a script on this host (a thin wrapper over torchrun)")
    runner.add_argument("-n", "--nproc", type=int, required=True, help="workers on this host")
    runner.add_argument("--nnodes", type=int, default=1, help="hosts in the job, each started alike (default 1)")
    runner.add_argument("--node-rank", type=int, default=0, help="this host's index, 0 .. nnodes-1 (default 0)")
    runner.add_argument("--master-addr", help="host 0's address, where the rendezvous is (with --nnodes > 1)")
    runner.add_argument(
        "--master-port", type=int, help="rendezvous port (default: a free one; with --nnodes > 1, required)"
    )
    runner.add_argument(
        "--token-file", help="file holding the cluster token (default: $POSEIDON_TOKEN, else a fresh one)"
    )
    runner.add_argument(
        "--tls", action="store_true", help="TLS on every connection, with a self-signed certificate made for this run"
    )
    runner.add_argument("--trace", metavar="PATH", help="write one Chrome/Perfetto trace of every rank there")
    runner.add_argument("--debug", action="store_true", help="full tracebacks and torchrun's own reports on failure")
    runner.add_argument("script")
    runner.add_argument("script_args", nargs=argparse.REMAINDER)
    runner.set_defaults(func=_run)
    args = parser.parse_args(argv)
    from .errors import ConfigError

    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"poseidon-aio {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
