"""``poseidon-aio``: the command line.

    poseidon-aio info [--require-extension]   which codec and event loop this install uses
    poseidon-aio shard --index S              host one parameter-server shard (standalone layout)
    poseidon-aio explain --fc 4096x4096 ...   per-layer cost model and scheme choice
    poseidon-aio run -n 4 script.py [args]    N local workers of a script, through torchrun
"""

from __future__ import annotations

import argparse
import sys


def _info(args: argparse.Namespace) -> int:
    from . import __version__
    from .net import LOOP
    from .wire import CODEC, CODECS

    print(f"poseidon_aio {__version__}: codec {CODEC} (built: {', '.join(sorted(CODECS))}), loop {LOOP}")
    if args.require_extension and "cython" not in CODECS:
        print("the compiled codec is not built: is a C compiler installed?", file=sys.stderr)
        return 1
    return 0


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

    from .sync.cost import LayerShape, Scheme, best_scheme, layer_cost, layers_of_manifest

    layers = []
    if args.model:
        from .cluster.models import PRESETS

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
    servers = args.servers or args.workers
    rows, totals = [], {k: 0.0 for k in ("ps_worker", "ps_combined", "sfb", "adam", "chosen", "cluster_ps", "cluster_sfb", "cluster_adam")}
    for layer in layers:
        cost = layer_cost(layer, args.workers, servers)
        choice = best_scheme(layer, args.workers, servers)
        chosen = cost.sfb if choice is Scheme.SFB else cost.ps_combined
        fc = layer.kind == "fc"
        row = {
            "name": layer.name, "kind": layer.kind, "shape": [layer.m, layer.n] if fc else [layer.params],
            "K": layer.rows if fc else None, "ps_worker": cost.ps_worker, "ps_combined": cost.ps_combined,
            "sfb": cost.sfb if fc else None, "adam": cost.adam if fc else None, "choice": choice.value,
            "chosen": chosen, "cluster_ps": cost.cluster_ps,
            "cluster_sfb": cost.cluster_sfb if fc else None, "cluster_adam": cost.cluster_adam if fc else None,
        }
        rows.append(row)
        for key in totals:
            value = row[key] if row.get(key) is not None else row["cluster_ps" if key.startswith("cluster") else "ps_combined"]
            totals[key] += value
    if args.json:
        print(json.dumps({"workers": args.workers, "servers": servers, "batch": args.batch, "layers": rows, "totals": totals}))
        return 0
    mf = lambda x: "-" if x is None else f"{x / 1e6:.2f}"  # noqa: E731
    print(f"floats per worker node, millions (P1={args.workers} workers, P2={servers} shards, K={args.batch} rows)")
    print(f"{'layer':<24} {'kind':<5} {'shape':<14} {'K':>5} {'PS worker':>10} {'PS w+s':>10} {'SFB':>10} {'Adam':>10}  choice")
    for r in rows:
        shape = "x".join(map(str, r["shape"]))
        print(f"{r['name'][:24]:<24} {r['kind']:<5} {shape:<14} {r['K'] or '-':>5} {mf(r['ps_worker']):>10} {mf(r['ps_combined']):>10} {mf(r['sfb']):>10} {mf(r['adam']):>10}  {r['choice']}")
    print(f"{'total':<24} {'':<5} {'':<14} {'':>5} {mf(totals['ps_worker']):>10} {mf(totals['ps_combined']):>10} {mf(totals['sfb']):>10} {mf(totals['adam']):>10}  hybrid {mf(totals['chosen'])}")
    print(
        f"cluster totals per iteration (2015 paper's accounting), millions: full-matrix PS {mf(totals['cluster_ps'])}, "
        f"SFB {mf(totals['cluster_sfb'])}, Adam {mf(totals['cluster_adam'])} (non-FC layers counted as PS in the last two)"
    )
    return 0


def _run(args: argparse.Namespace) -> int:
    import os
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = args.master_port or s.getsockname()[1]
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}", "--nnodes=1",
        "--master-addr=127.0.0.1", f"--master-port={port}", args.script, *args.script_args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.call(command, env=env)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="poseidon-aio", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="which codec and event loop are active")
    info.add_argument("--require-extension", action="store_true", help="fail if the Cython codec is not built")
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
    explain.add_argument("--fc", action="append", metavar="MxN", help="a fully-connected layer (outputs x inputs); repeatable")
    explain.add_argument("--workers", type=int, default=8)
    explain.add_argument("--servers", type=int, help="parameter-server shards (default: one per worker)")
    explain.add_argument("--batch", type=int, default=32, help="K, rows per worker")
    explain.add_argument("--json", action="store_true")
    explain.set_defaults(func=_explain)
    runner = sub.add_parser("run", help="start N local workers of a script (a thin wrapper over torchrun)")
    runner.add_argument("-n", "--nproc", type=int, required=True)
    runner.add_argument("--master-port", type=int, help="rendezvous port (default: a free one)")
    runner.add_argument("script")
    runner.add_argument("script_args", nargs=argparse.REMAINDER)
    runner.set_defaults(func=_run)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
