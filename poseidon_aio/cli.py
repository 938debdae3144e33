"""``poseidon-aio``: the command line.

    poseidon-aio info [--require-extension]   which codec and event loop this install uses
    poseidon-aio shard --index S              host one parameter-server shard (standalone layout)
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
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
