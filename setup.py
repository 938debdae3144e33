"""Builds the Cython codec, receive core and shard tally from _ext/ when a compiler is there; the
pure-Python twins otherwise.

POSEIDON_NO_EXTENSIONS=1 skips the build. A failed build (no compiler, no Python headers) is
reported and the install goes on: poseidon_aio.wire.CODEC (net.core.RECEIVE_CORE, ps.tally.TALLY)
then says "python".
"""

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    def run(self):
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any build failure means "use the twin"
            print(f"poseidon_aio: not building the Cython codec ({exc}); using pure Python", file=sys.stderr)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            print(f"poseidon_aio: building {ext.name} failed ({exc}); using pure Python", file=sys.stderr)


def extensions():
    if os.environ.get("POSEIDON_NO_EXTENSIONS") == "1":
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:
        print("poseidon_aio: Cython missing; using the pure-Python codec", file=sys.stderr)
        return []
    try:
        return cythonize(
            [
                Extension("poseidon_aio.wire._ccodec", ["_ext/codec.pyx"], extra_compile_args=["-O3"]),
                # The connection's receive core; it cimports the codec (poseidon_aio/wire/_ccodec.pxd).
                Extension("poseidon_aio.net._creceive", ["_ext/receive.pyx"], extra_compile_args=["-O3"]),
                # The shard's per-push bookkeeping (poseidon_aio/ps/tally.py's twin).
                Extension("poseidon_aio.ps._ctally", ["_ext/tally.pyx"], extra_compile_args=["-O3"]),
            ],
            compiler_directives={"language_level": "3"},
            quiet=True,
        )
    except Exception as exc:  # noqa: BLE001 - a failed translation also means "use the twin"
        print(f"poseidon_aio: Cython translation failed ({exc}); using pure Python", file=sys.stderr)
        return []


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
