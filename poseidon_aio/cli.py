"""``poseidon-aio``: the command line.

    poseidon-aio info [--require-extension]   which codec and event loop this install uses
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="poseidon-aio", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="which codec and event loop are active")
    info.add_argument("--require-extension", action="store_true", help="fail if the Cython codec is not built")
    info.set_defaults(func=_info)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
