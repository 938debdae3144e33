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


@pytest.mark.parametrize("module", ["poseidon_aio.wire", "poseidon_aio.errors", "poseidon_aio.units"])
def test_sans_io_layers_import_no_asyncio_socket_or_torch(module):
    # The crc32c package reads its own version through importlib.metadata, which imports email and
    # with it socket: imported first and then forgotten, so that what shows is what ours import.
    forget = "[sys.modules.pop(m, None) for m in ('asyncio', 'socket', 'torch')]"
    loaded = _python(
        f"import sys, crc32c; {forget}; import {module}; "
        "print(sorted(m for m in ('asyncio', 'socket', 'torch') if m in sys.modules))"
    )
    assert loaded == "[]", f"{module} pulled in {loaded}"


@pytest.mark.parametrize("module", ["poseidon_aio.net", "poseidon_aio.cluster", "poseidon_aio.ps", "poseidon_aio.sync"])
def test_layers_below_the_trainer_import_no_torch(module):
    # The rendezvous imports torch's TCPStore only when it opens one; the kernels are the
    # trainer's to pass in.
    assert _python(f"import sys, {module}; print('torch' in sys.modules)") == "False", f"{module} imports torch"


def test_the_plan_and_every_module_in_it_import_neither_torch_nor_asyncio():
    # The cost model, the planners, the traces and the simulator are analysis apart from runtime:
    # numbers in, decisions out, runnable without an event loop or a tensor library. The layers
    # that carry the decisions out sit above it.
    above = ("asyncio", "torch", "poseidon_aio.sync", "poseidon_aio.net", "poseidon_aio.ps", "poseidon_aio.train")
    loaded = _python(
        "import sys, pkgutil, importlib, poseidon_aio.plan as plan\n"
        "for info in pkgutil.walk_packages(plan.__path__, 'poseidon_aio.plan.'): importlib.import_module(info.name)\n"
        f"print(sorted(m for m in {above!r} if m in sys.modules))"
    )
    assert loaded == "[]", f"poseidon_aio.plan pulled in {loaded}"


def test_every_exception_the_library_defines_is_a_poseidon_error():
    # Defined in errors.py, under PoseidonError; a private exception is control flow that never
    # leaves its module (the handshake's _Malformed becomes a refusal).
    code = (
        "import inspect, pkgutil, importlib, poseidon_aio, poseidon_aio.errors as e\n"
        "bad = []\n"
        "for info in pkgutil.walk_packages(poseidon_aio.__path__, 'poseidon_aio.'):\n"
        "    if info.name.endswith('._ccodec') or '.kernels.cuda' in info.name: continue\n"
        "    mod = importlib.import_module(info.name)\n"
        "    for name, obj in vars(mod).items():\n"
        "        if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == info.name"
        " and not name.startswith('_'):\n"
        "            if not issubclass(obj, e.PoseidonError) or info.name != 'poseidon_aio.errors':"
        " bad.append(f'{info.name}.{name}')\n"
        "print(bad)"
    )
    assert _python(code) == "[]"


def test_the_gpu_tests_collect_where_pytest_asyncio_is_not_installed():
    # scripts/gpu-check.sh runs on a lent machine's own interpreter, which may lack pytest-asyncio:
    # a conftest hook of that plugin must be optional there, or pytest stops before any test
    # (it did, on 2026-11-26: "unknown hook 'pytest_asyncio_loop_factories'").
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:asyncio",
            "-p",
            "no:cacheprovider",
            "--collect-only",
            "tests/test_gpu.py",
        ],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


def test_the_package_exports_every_config_the_trainer_takes():
    import inspect
    import re

    import poseidon_aio
    from poseidon_aio.train.trainer import Trainer

    annotations = " ".join(str(p.annotation) for p in inspect.signature(Trainer).parameters.values())
    configs = set(re.findall(r"\b\w+Config\b", annotations))
    assert {
        "PSConfig",
        "NetConfig",
        "MergeConfig",
        "AllReduceConfig",
        "OptimizerConfig",
        "StartupConfig",
        "TraceConfig",
    } <= configs
    assert [name for name in sorted(configs) if not hasattr(poseidon_aio, name)] == []
