"""TLS and bearer tokens for every port: the flags (:class:`SecurityConfig`), the server side
(credentials, the token interceptor, the loopback rule) and the client side (:func:`channel`,
the one way corpusd opens a gRPC channel).

A process has one identity, set once by its command (:func:`configure`) or taken from the
environment (``CORPUSD_TLS_CA``, ``CORPUSD_TLS_CERT``, ``CORPUSD_TLS_KEY``, ``CORPUSD_TOKEN``).
With neither, a client talking to a loopback address uses the credentials of a running secure
``corpusd up`` (its ``up.json`` names them), so the CLI just works after ``up``; it never sends
them anywhere else.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from corpusd.auth import TokenAuth, load_tokens
from corpusd.local_ca import LocalCA

ENV_CA, ENV_CERT, ENV_KEY, ENV_TOKEN = (
    "CORPUSD_TLS_CA",
    "CORPUSD_TLS_CERT",
    "CORPUSD_TLS_KEY",
    "CORPUSD_TOKEN",
)


@dataclass(frozen=True, slots=True)
class SecurityConfig:
    """TLS and token flags, shared by every daemon and client command."""

    tls_cert: str = field(
        default="",
        metadata={"help": "PEM certificate this process presents (default: $CORPUSD_TLS_CERT)"},
    )
    tls_key: str = field(default="", metadata={"help": "its PEM key (default: $CORPUSD_TLS_KEY)"})
    tls_ca: str = field(
        default="",
        metadata={"help": "PEM CA that peers' certificates must chain to; a daemon given one "
                  "requires client certificates (mutual TLS) (default: $CORPUSD_TLS_CA)"},
    )  # fmt: skip
    auth_tokens: str = field(
        default="",
        metadata={"help": "daemons: file of 'RIGHT TOKEN' lines (mode 0600) that calls must "
                  "carry one of; needs TLS"},
    )  # fmt: skip
    insecure: int = field(
        default=0,
        metadata={"help": "1 (or the flag alone): plaintext and no tokens, also off loopback",
                  "const": 1},
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.insecure not in (0, 1):
            raise ValueError(f"insecure must be 0 or 1, got {self.insecure}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.insecure and (self.tls_cert or self.tls_ca or self.auth_tokens):
            raise ValueError("--insecure contradicts --tls-cert/--tls-ca/--auth-tokens")
        if self.auth_tokens and not self.tls_cert:
            raise ValueError(
                "--auth-tokens needs --tls-cert/--tls-key: tokens never travel in clear"
            )


@dataclass(frozen=True, slots=True)
class Identity:
    """What a process presents and trusts: PEM bytes (empty: none) and its bearer token."""

    ca: bytes = b""
    cert: bytes = b""
    key: bytes = b""
    token: str = ""
    insecure: bool = False

    @property
    def tls(self) -> bool:
        return bool(self.ca)


def _read(path: str, what: str) -> bytes:
    if not path:
        return b""
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as e:
        raise ValueError(f"{what} {path}: {e.strerror}") from None


def identity_from(ca: str, cert: str, key: str, token: str, insecure: bool = False) -> Identity:
    """An identity from paths and a token. Raises ValueError naming the missing file, a cert
    without its key, a token without a CA (a token is only sent over TLS), or a token that
    cannot travel in a header. A short token is sent as it is: the server's answer to a wrong
    one is UNAUTHENTICATED, whatever its length."""
    if bool(cert) != bool(key):
        raise ValueError("a TLS certificate and its key go together (--tls-cert/--tls-key)")
    if token and not ca and not insecure:
        raise ValueError(
            f"a bearer token is only sent over TLS: give a CA (--tls-ca or ${ENV_CA}) too"
        )
    return Identity(
        _read(ca, "--tls-ca"),
        _read(cert, "--tls-cert"),
        _read(key, "--tls-key"),
        _sendable(token),
        insecure,
    )


def _env_text(name: str) -> str:
    """One of the TLS/token variables as text ("" when unset), through :mod:`corpusd.env`."""
    from corpusd import env

    value = env.get(name)
    return "" if value is None else str(value)


def _sendable(token: str) -> str:
    """``token`` stripped; ValueError unless it is printable ASCII (it travels in a header)."""
    t = token.strip()
    if not all(33 <= ord(c) < 127 for c in t):
        raise ValueError(f"${ENV_TOKEN}: a token is printable ASCII without spaces")
    return t


_configured: Identity | None = None
_server: SecurityConfig | None = None


def configure(cfg: SecurityConfig) -> None:
    """Set this process's identity and (for daemons) what its servers require from its
    command's flags, each defaulting to its env var. Raises ValueError (see
    :func:`identity_from`)."""
    global _configured, _server
    e = _env_text
    if not cfg.insecure:
        cfg = SecurityConfig(
            tls_cert=cfg.tls_cert or e(ENV_CERT),
            tls_key=cfg.tls_key or e(ENV_KEY),
            tls_ca=cfg.tls_ca or e(ENV_CA),
            auth_tokens=cfg.auth_tokens,
        )
    token = e(ENV_TOKEN)
    if cfg.insecure:
        _configured = Identity(insecure=True)
    elif cfg.tls_ca or cfg.tls_cert:
        _configured = identity_from(cfg.tls_ca, cfg.tls_cert, cfg.tls_key, token)
    else:  # no files given: client_identity may still find a running secure `up`'s
        _configured = None
    _server = cfg


def _loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def client_identity(address: str) -> Identity:
    """Who this process is towards ``address``: as configured, else from the env vars, else
    (for the daemons a running secure ``corpusd up`` started: its up.json names them) that
    ``up``'s, else plaintext."""
    if _configured is not None:
        return _configured
    e = _env_text
    token = e(ENV_TOKEN)
    if any(e(v) for v in (ENV_CA, ENV_CERT, ENV_KEY)):
        return identity_from(e(ENV_CA), e(ENV_CERT), e(ENV_KEY), token)
    ca = up_ca(address)
    if ca is not None:  # $CORPUSD_TOKEN alone: that token, with up's certificates
        return identity_from(str(ca.ca), str(ca.cert), str(ca.key), token or ca.token("admin"))
    return identity_from("", "", "", token)  # plaintext; a lone token is refused


def up_ca(address: str = "") -> LocalCA | None:
    """The local CA of the running secure ``corpusd up`` when ``address`` is one of its
    daemons ("" : any), else None. Its files are only ever used towards loopback."""
    if address and not _loopback(address):
        return None
    from corpusd import env

    info = env.running_up() or {}
    sec = info.get("security")
    if not sec or (address and address not in _up_addresses(info)):
        return None
    return LocalCA(Path(sec["dir"]))


def _up_addresses(info: dict[str, Any]) -> set[str]:
    """Every daemon address a ``corpusd up`` names in its ``up.json``."""
    parts = [info.get("coordinator") or {}, info.get("agent") or {}, *info.get("holders", ())]
    # a coordinator address may be a list (``up --state etcd``: the leader and a standby)
    return {a for p in parts for a in str(p.get("address", "")).split(",") if a}


#: gRPC's reconnect backoff grows 1.6× a failure up to 120 s, and a channel in backoff fails
#: every call at once: a client whose daemon was down for a minute went on failing for up to two
#: more after it was back (found by tools/soak.py). Capped, a daemon that returns is reached
#: within RECONNECT_BACKOFF_MS (plus gRPC's 20 % jitter).
#: Not ``grpc.min_reconnect_backoff_ms``: gRPC takes a connection attempt's timeout from it (20 s
#: by default), and at 250 ms a TLS handshake over a slow link never finished.
RECONNECT_BACKOFF_MS = 2000
RECONNECT = (
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
)


def channel(
    address: str, options: Sequence[tuple[str, Any]] = (), ident: Identity | None = None
) -> grpc.aio.Channel:
    """A grpc.aio channel to ``address``: TLS (with a client certificate when there is one and
    the bearer token as call credentials) when the identity has a CA, else plaintext. Its
    reconnect backoff is capped at RECONNECT_BACKOFF_MS (``options`` may override it)."""
    me = ident if ident is not None else client_identity(address)
    given = {k for k, _ in options}
    options = [*options, *((k, v) for k, v in RECONNECT if k not in given)]
    if not me.tls:
        return grpc.aio.insecure_channel(address, options=list(options))
    creds = grpc.ssl_channel_credentials(
        root_certificates=me.ca, private_key=me.key or None, certificate_chain=me.cert or None
    )
    if me.token:
        creds = grpc.composite_channel_credentials(
            creds, grpc.access_token_call_credentials(me.token)
        )
    return grpc.aio.secure_channel(address, creds, options=list(options))


@dataclass(frozen=True, slots=True)
class Serving:
    """How a daemon's ports are served: gRPC credentials (None: plaintext), interceptors to put
    first, and the metrics endpoint's TLS arguments (for prometheus_client)."""

    credentials: grpc.ServerCredentials | None
    interceptors: tuple[grpc.aio.ServerInterceptor, ...]
    metrics_tls: dict[str, Any]

    @property
    def scheme(self) -> str:
        return "https" if self.credentials is not None else "http"


def serving(host: str) -> Serving:
    """The server side of this process's configuration for a bind on ``host``. Raises
    ValueError for a non-loopback bind without TLS unless --insecure, or a bad tokens file."""
    cfg = _server or SecurityConfig()
    cert, key, ca = cfg.tls_cert, cfg.tls_key, cfg.tls_ca
    if cfg.insecure or not cert:
        if not cfg.insecure and not _loopback(f"{host}:0"):
            raise ValueError(
                f"--host {host} is not loopback: serve it with TLS (--tls-cert/--tls-key) or "
                f"pass --insecure to serve plaintext anyway"
            )
        return Serving(None, (), {})
    pair = (_read(key, "--tls-key"), _read(cert, "--tls-cert"))
    creds = grpc.ssl_server_credentials(
        [pair], root_certificates=_read(ca, "--tls-ca") or None, require_client_auth=bool(ca)
    )
    interceptors = (TokenAuth(load_tokens(cfg.auth_tokens)),) if cfg.auth_tokens else ()
    metrics: dict[str, Any] = {"certfile": cert, "keyfile": key}
    if ca:
        metrics.update(client_cafile=ca, client_auth_required=True)
    return Serving(creds, interceptors, metrics)


#: ``--http-client-cert``: what the HTTP port asks of a client's certificate
HTTP_CLIENT_CERT = ("optional", "required")


def http_serving(
    host: str, client_cert: str = "optional"
) -> tuple[dict[str, Any], dict[str, str] | None]:
    """An HTTP port on ``host`` (the agent's OpenAI API) served with the daemon's certificate
    and tokens, asking for what OpenAI clients can give: TLS and the bearer token (their
    ``api_key``). A client certificate is ``optional`` (verified against the daemon's CA when
    one is presented) unless ``client_cert`` is ``required``. Returns uvicorn's TLS arguments
    and the tokens (token → right) a request's ``Authorization: Bearer`` must name, or None
    when the daemon takes no tokens. Raises as :func:`serving` does."""
    if client_cert not in HTTP_CLIENT_CERT:
        raise ValueError(f"--http-client-cert: {client_cert!r}; one of {HTTP_CLIENT_CERT}")
    sec = serving(host)
    cfg = _server or SecurityConfig()
    if sec.credentials is None:
        return {}, None
    import ssl

    tls: dict[str, Any] = {"ssl_certfile": cfg.tls_cert, "ssl_keyfile": cfg.tls_key}
    if cfg.tls_ca:
        reqs = ssl.CERT_REQUIRED if client_cert == "required" else ssl.CERT_OPTIONAL
        tls.update(ssl_ca_certs=cfg.tls_ca, ssl_cert_reqs=reqs)
    return tls, (load_tokens(cfg.auth_tokens) if cfg.auth_tokens else None)
