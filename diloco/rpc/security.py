"""Transport security of one process, read from flags/env in one place and shared by every service, the worker,
`diloco ctl` and the local cluster: mutual TLS from a TLS folder (`diloco.rpc.tls`) and bearer tokens
(`diloco.rpc.auth`).

TLS is the default. Plaintext needs `--insecure` (env DILOCO_INSECURE=1) and a loopback address; without tokens
on an insecure loopback server, auth is off. With TLS, servers require both tokens.

Tokens come from files (`--join-token-file`, `--admin-token-file`, env DILOCO_JOIN_TOKEN_FILE, ...), or the
environment (DILOCO_JOIN_TOKEN, DILOCO_ADMIN_TOKEN), or else `join.token`/`admin.token` in the TLS folder; never
from a flag holding the value.
"""

from __future__ import annotations

import argparse
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from diloco.errors import ConfigError
from diloco.flags import parse_bool
from diloco.rpc.auth import TokenAuthInterceptor, Tokens
from diloco.rpc.server import channel
from diloco.rpc.tls import ADMIN_TOKEN_FILE, JOIN_TOKEN_FILE, TlsFiles, channel_credentials, server_credentials

HOWTO = "run `diloco certs --out DIR` and pass --tls-dir DIR (env DILOCO_TLS_DIR), or --insecure on loopback only"


def host_of(address: str) -> str:
    """The host of HOST:PORT, [V6]:PORT or a bare host."""
    a = address.strip()
    if a.startswith("["):
        return a[1 : a.find("]")]
    if a.count(":") == 1:
        return a.rsplit(":", 1)[0]
    return a


def is_loopback(address: str) -> bool:
    host = host_of(address)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_token(path: str, what: str) -> str:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"{what}: cannot read token file {path!r} ({e.strerror})") from e
    token = text.strip()
    if not token:
        raise ConfigError(f"{what}: token file {path!r} is empty; write a token into it (`diloco certs` makes one)")
    if any(c.isspace() for c in token):
        raise ConfigError(f"{what}: token file {path!r} must hold one token without spaces")
    return token


@dataclass(frozen=True)
class SecurityConfig:
    """`tls_dir` set: mutual TLS with `<tls_dir>/ca.pem` and `<tls_dir>/<tls_name>.{pem,key}`; else plaintext,
    which needs `insecure` and loopback addresses. The in-process default is plaintext on loopback (tests); the
    command-line default is TLS. Tokens are never shown in the repr."""

    tls_dir: str = ""
    tls_name: str = ""
    insecure: bool = True
    join_token: str = field(default="", repr=False)
    admin_token: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if self.tls_dir:
            if not self.tls_name:
                raise ConfigError("tls_name: the identity whose <name>.pem/<name>.key to use is required")
            TlsFiles.from_dir(self.tls_dir, self.tls_name)  # fails early, naming the missing files
        for what, token in (("join token", self.join_token), ("admin token", self.admin_token)):
            if token and (token != token.strip() or any(c.isspace() for c in token)):
                raise ConfigError(f"{what}: must be one word without spaces")

    @property
    def tls(self) -> bool:
        return bool(self.tls_dir)

    # --- server side ------------------------------------------------------------------------------------------
    def check_server(self, host: str) -> None:
        """Raise ConfigError unless a server bound to `host` with this config is allowed."""
        if not self.tls and not self.insecure:
            raise ConfigError(f"no TLS configured: {HOWTO}")
        if not self.tls and not is_loopback(host):
            raise ConfigError(f"plaintext is only allowed on loopback, not on host {host!r}: {HOWTO}")
        if bool(self.join_token) != bool(self.admin_token):
            missing = "admin" if self.join_token else "join"
            raise ConfigError(
                f"a server needs both tokens; the {missing} token is missing (--{missing}-token-file or "
                f"DILOCO_{missing.upper()}_TOKEN)"
            )
        if self.tls and not self.join_token:
            raise ConfigError(
                "with TLS a server requires tokens: pass --join-token-file and --admin-token-file "
                "(`diloco certs --out DIR` writes join.token and admin.token)"
            )
        if self.join_token and self.join_token == self.admin_token:
            raise ConfigError("the join and admin tokens must differ")

    def server_credentials(self) -> grpc.ServerCredentials | None:
        return server_credentials(TlsFiles.from_dir(self.tls_dir, self.tls_name)) if self.tls else None

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:  # type: ignore[type-arg]
        if not self.join_token:
            return []
        return [TokenAuthInterceptor(Tokens(self.join_token, self.admin_token))]

    # --- client side ------------------------------------------------------------------------------------------
    def check_client(self, address: str) -> None:
        if not self.tls and not self.insecure:
            raise ConfigError(f"no TLS configured: {HOWTO}")
        if not self.tls and not is_loopback(address):
            raise ConfigError(f"plaintext is only allowed to loopback, not to {address!r}: {HOWTO}")

    def channel(self, address: str, admin: bool = False) -> grpc.Channel:
        """A channel to `address` with this process's TLS identity, sending the admin token (`admin`) or else the
        join token, when one is configured."""
        self.check_client(address)
        creds = channel_credentials(TlsFiles.from_dir(self.tls_dir, self.tls_name)) if self.tls else None
        token = self.admin_token if admin else (self.join_token or self.admin_token)
        return channel(address, credentials=creds, token=token)


# --- flags and environment ------------------------------------------------------------------------------------


def add_flags(p: argparse.ArgumentParser, env: Mapping[str, str], tls_name: str, tokens: tuple[str, ...]) -> None:
    """The security flags: --tls-dir, --tls-name, --insecure and a --<kind>-token-file per kind in `tokens`
    ('join', 'admin'). Each falls back to DILOCO_<FLAG> in the environment."""
    g = p.add_argument_group(
        "security",
        "Mutual TLS by default: --tls-dir DIR holds ca.pem and <tls-name>.pem/<tls-name>.key (`diloco certs --out "
        "DIR` writes them). Tokens come from the files below, else DILOCO_JOIN_TOKEN/DILOCO_ADMIN_TOKEN, else "
        "join.token/admin.token in the TLS folder.",
    )
    g.add_argument(
        "--tls-dir", default=env.get("DILOCO_TLS_DIR", ""), help="TLS folder (env DILOCO_TLS_DIR)", metavar="DIR"
    )
    g.add_argument(
        "--tls-name",
        default=env.get("DILOCO_TLS_NAME", tls_name),
        help=f"identity in the TLS folder (env DILOCO_TLS_NAME; default {tls_name!r})",
    )
    try:
        insecure = parse_bool(env.get("DILOCO_INSECURE", ""))
    except ValueError as e:
        raise ConfigError(f"environment DILOCO_INSECURE: {e}") from e
    g.add_argument(
        "--insecure",
        action="store_true",
        default=insecure,
        help="plaintext without TLS, allowed on loopback addresses only (env DILOCO_INSECURE=1)",
    )
    for kind in tokens:
        name = f"DILOCO_{kind.upper()}_TOKEN_FILE"
        g.add_argument(
            f"--{kind}-token-file",
            default=env.get(name, ""),
            metavar="FILE",
            help=f"file holding the {kind} token (env {name}, or the token itself in DILOCO_{kind.upper()}_TOKEN)",
        )


def _token(a: argparse.Namespace, env: Mapping[str, str], kind: str) -> str:
    path = getattr(a, f"{kind}_token_file", None)
    if path is None:  # this process does not take this kind of token
        return ""
    if path:
        return read_token(path, f"--{kind}-token-file")
    raw = env.get(f"DILOCO_{kind.upper()}_TOKEN")
    if raw is not None and raw != "":
        token = raw.strip()
        if not token or any(c.isspace() for c in token):
            raise ConfigError(f"environment DILOCO_{kind.upper()}_TOKEN must hold one token without spaces")
        return token
    if a.tls_dir:
        default = Path(a.tls_dir) / (JOIN_TOKEN_FILE if kind == "join" else ADMIN_TOKEN_FILE)
        if default.is_file():
            return read_token(str(default), f"{kind} token")
    return ""


def from_args(a: argparse.Namespace, env: Mapping[str, str]) -> SecurityConfig:
    """The SecurityConfig of the flags `add_flags` added (and the token environment variables)."""
    return SecurityConfig(
        tls_dir=a.tls_dir,
        tls_name=a.tls_name if a.tls_dir else "",
        insecure=bool(a.insecure) and not a.tls_dir,
        join_token=_token(a, env, "join"),
        admin_token=_token(a, env, "admin"),
    )
