"""Where a process gets its secrets: the cluster token and TLS files, from the environment or files.

Secrets never travel through the rendezvous store: anyone who can reach MASTER_ADDR:MASTER_PORT
can read every key there without authenticating. The launcher hands them to each worker instead:

=================================  =====================================================
``POSEIDON_TOKEN``                 the cluster token itself (text, at least 16 bytes)
``POSEIDON_TOKEN_FILE``            a file holding it (e.g. a Kubernetes secret mounted read-only)
``POSEIDON_TLS_CERT``              this process's certificate chain (PEM); turns TLS on
``POSEIDON_TLS_KEY``               its private key (PEM)
``POSEIDON_TLS_CA``                CA bundle the peers' certificates must chain to (mutual TLS)
``POSEIDON_TLS_UNAUTHENTICATED``   ``1``: TLS without a CA, encryption only (README, Security)
=================================  =====================================================

``poseidon-aio run`` draws a fresh token for the job and passes it to its local workers in their
environment (readable only by the same user and root), and with ``--tls`` makes a self-signed
certificate for the run (:func:`self_signed`).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Mapping, Optional

from ..errors import ConfigError
from .config import NetConfig, TLSConfig

TOKEN_ENV = "POSEIDON_TOKEN"
TOKEN_FILE_ENV = "POSEIDON_TOKEN_FILE"
TLS_ENV = {"certfile": "POSEIDON_TLS_CERT", "keyfile": "POSEIDON_TLS_KEY", "cafile": "POSEIDON_TLS_CA"}
TLS_UNAUTHENTICATED_ENV = "POSEIDON_TLS_UNAUTHENTICATED"
MIN_TOKEN_BYTES = 16


def token_from_env(env: Optional[Mapping[str, str]] = None) -> Optional[bytes]:
    """The cluster token from ``POSEIDON_TOKEN`` or the file named by ``POSEIDON_TOKEN_FILE``.

    Returns:
        The token, or ``None`` when neither variable is set.
    Raises:
        ConfigError: both are set, the file cannot be read, or the token is shorter than 16 bytes.

    >>> token_from_env({"POSEIDON_TOKEN": "correct horse battery staple"})
    b'correct horse battery staple'
    """
    env = os.environ if env is None else env
    text, path = env.get(TOKEN_ENV), env.get(TOKEN_FILE_ENV)
    if text and path:
        raise ConfigError(f"set {TOKEN_ENV} or {TOKEN_FILE_ENV}, not both")
    if path:
        try:
            token = Path(path).read_bytes().rstrip(b"\r\n")
        except OSError as exc:
            raise ConfigError(f"{TOKEN_FILE_ENV}={path}: cannot read the token file ({exc.strerror})") from None
        source = f"the token file {path}"
    elif text:
        token, source = text.encode(), TOKEN_ENV
    else:
        return None
    if len(token) < MIN_TOKEN_BYTES:
        raise ConfigError(f"{source} holds {len(token)} bytes; a cluster token needs at least {MIN_TOKEN_BYTES}")
    return token


def tls_from_env(env: Optional[Mapping[str, str]] = None) -> Optional[TLSConfig]:
    """TLS settings from ``POSEIDON_TLS_CERT``/``_KEY``/``_CA``, or ``None`` when no certificate is set.

    Raises:
        ConfigError: a certificate without its key (or the reverse), a file that does not exist,
            or no CA without ``POSEIDON_TLS_UNAUTHENTICATED=1``.
    """
    env = os.environ if env is None else env
    files = {field: env.get(var) or None for field, var in TLS_ENV.items()}
    if not files["certfile"] and not files["keyfile"]:
        return None
    if not (files["certfile"] and files["keyfile"]):
        raise ConfigError(f"TLS needs both {TLS_ENV['certfile']} and {TLS_ENV['keyfile']}")
    for field, path in files.items():
        if path and not Path(path).is_file():
            raise ConfigError(f"{TLS_ENV[field]}={path}: no such file")
    return TLSConfig(**files, unauthenticated=env.get(TLS_UNAUTHENTICATED_ENV) == "1")


def self_signed(directory: str, *, days: int = 7) -> TLSConfig:
    """Make a self-signed certificate and key for one run in ``directory`` (created mode 0700).

    Every process of the run uses the same pair and trusts it as its CA, so connections are
    mutually authenticated TLS: a peer must hold the key file to join. The key is written
    readable by its owner only.

    Raises:
        ConfigError: the ``openssl`` command is not installed or fails.
    """
    openssl = shutil.which("openssl")
    if openssl is None:
        raise ConfigError(
            "--tls needs the openssl command to make a certificate; install it or set POSEIDON_TLS_CERT/KEY"
        )
    where = Path(directory)
    where.mkdir(mode=0o700, parents=True, exist_ok=True)
    cert, key = where / "cert.pem", where / "key.pem"
    # ECDSA P-256: a 256-bit key is generated in milliseconds, RSA-2048 takes ~100 ms or more.
    command = [
        openssl,
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-days",
        str(days),
        "-subj",
        "/CN=poseidon-aio",
        "-keyout",
        str(key),
        "-out",
        str(cert),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise ConfigError(f"openssl could not make a certificate: {done.stderr.strip()[-300:]}")
    key.chmod(stat.S_IRUSR | stat.S_IWUSR)
    return TLSConfig(certfile=str(cert), keyfile=str(key), cafile=str(cert))


def config_from_env(env: Optional[Mapping[str, str]] = None, **settings) -> NetConfig:
    """A :class:`NetConfig` whose token (and TLS, when set) come from the environment.

    Args:
        settings: any other :class:`NetConfig` field.
    Raises:
        ConfigError: no token is set (the message says how to set one), or a setting is invalid.
    """
    token = token_from_env(env)
    if token is None:
        raise ConfigError(
            f"no cluster token: set {TOKEN_ENV} (at least {MIN_TOKEN_BYTES} bytes, the same on every process) or "
            f"{TOKEN_FILE_ENV}, or pass NetConfig(token=...); `poseidon-aio run` draws one for its local workers"
        )
    settings.setdefault("tls", tls_from_env(env))
    return NetConfig(token=token, **settings)


def tls_env(tls: TLSConfig) -> dict:
    """The environment variables that hand ``tls`` to worker processes (see :func:`tls_from_env`)."""
    env = {var: getattr(tls, field) for field, var in TLS_ENV.items() if getattr(tls, field)}
    if tls.unauthenticated:
        env[TLS_UNAUTHENTICATED_ENV] = "1"
    return env
