"""Package-level promises: which codec is active, and dependencies pointing one way."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _python(code: str, **env) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout.strip()


def test_no_extensions_switch_selects_the_python_twin():
    assert _python("import poseidon_aio.wire as w; print(w.CODEC)", POSEIDON_NO_EXTENSIONS="1") == "python"


@pytest.mark.parametrize("module", ["poseidon_aio.wire", "poseidon_aio.errors"])
def test_sans_io_layers_import_no_asyncio_socket_or_torch(module):
    loaded = _python(
        f"import sys, {module}; print(sorted(m for m in ('asyncio', 'socket', 'torch') if m in sys.modules))"
    )
    assert loaded == "[]", f"{module} pulled in {loaded}"


def test_net_does_not_import_torch():
    assert _python("import sys, poseidon_aio.net; print('torch' in sys.modules)") == "False"
