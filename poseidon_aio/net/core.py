"""Which receive core a :class:`~poseidon_aio.net.connection.Connection` is built on.

``RECEIVE_CORE`` says which: ``"cython"`` (``_ext/receive.pyx``, compiled beside the codec) or
``"python"`` (:mod:`poseidon_aio.net.receive`). The compiled core drives the compiled decoder
through C calls, so it is active only with the compiled codec; ``POSEIDON_NO_EXTENSIONS=1``
forces both twins. ``RECEIVE_CORES`` maps both names to their classes where both exist, so the
tests can run each; ``LANDINGS`` does the same for the :class:`~poseidon_aio.net.receive.Landing`
of each, and ``Landing`` is the active core's.
"""

from __future__ import annotations

from contextlib import suppress

from ..wire import CODEC
from . import receive

RECEIVE_CORES: dict = {"python": receive.ReceiveCore}
LANDINGS: dict = {"python": receive.Landing}
with suppress(ImportError):
    from ._creceive import Landing as _CompiledLanding  # type: ignore[import-not-found]
    from ._creceive import ReceiveCore as _CompiledCore  # type: ignore[import-not-found]

    RECEIVE_CORES["cython"] = _CompiledCore
    LANDINGS["cython"] = _CompiledLanding

RECEIVE_CORE = "cython" if CODEC == "cython" and "cython" in RECEIVE_CORES else "python"
ReceiveCore = RECEIVE_CORES[RECEIVE_CORE]
Landing = LANDINGS[RECEIVE_CORE]

__all__ = ["LANDINGS", "RECEIVE_CORE", "RECEIVE_CORES", "Landing", "ReceiveCore"]
