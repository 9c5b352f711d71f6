"""The etcd side of coordinator leadership (ALGORITHM.md section 11): four calls over etcd v3's JSON gateway
(`etcd3gw`), each bounded by `call_timeout_s` as a whole: the HTTP client's own timeout bounds the connect and each
read of the reply, but not a host name that does not resolve (a cut-off replica's resolver can block for many
seconds) nor a reply that trickles in; so every request runs on a thread of its own and the caller stops waiting at
`call_timeout_s` (`EtcdUnavailable`). A request given up on finishes, or fails, on that thread, unseen; while
`MAX_HANGING` of them still hang on an endpoint, a new call there fails at once rather than start another.

Several endpoints (the members of one etcd cluster, `EtcdConfig.others`): calls go to one at a time; when it gives
no answer (refused, timed out, hanging, a server error: `EtcdUnreachable`) the next call goes to another one
(`next_endpoint`): one that has not failed in the last `FORGET_FAILURE_S` first, then one that was only slow, and
last one that refused the connection (nothing listens there: a member that is down), each in round-robin order. So
a leader whose member died and whose next member is slow under load does not go back to the dead one while another
answers. A call is never sent twice (its outcome may be unknown; the one exception, a call etcd refused for its
token, is below); the driver's next call, a fraction of a second later, is. An answer, even a refusal (a lease etcd
no longer has), keeps the endpoint.

- campaign: grant a lease of `ttl_s`, then one transaction: if the leader key's create_revision is 0 (no key),
  put {replica_id, address} under the lease and read the key back, else read the key. Won: the epoch is the
  key's create_revision. Lost: the holder and its epoch. Anything else (an error, a timeout: the transaction
  may or may not have happened) revokes the lease (best effort, which deletes the key if it was created) and
  raises `EtcdUnavailable`.
- renew: one keepalive of the lease. True while the lease lives; False when etcd says it is gone.
- observe: read the key: its holder, or None.
- resign: delete the key if its create_revision is still our epoch (a transaction), then revoke the lease.

The newest holder wins (`diloco.core.leadership`, "The newest holder wins"): each standby keeps an entry
`{key}.standbys/{replica_id}` = {"version": v} under a lease of its own (`grant`, `publish`, kept alive by `renew`),
and followers read the leader key and every such entry in one transaction (`observe_all`). An entry that is not
such a record is left out.

Every failure to get an answer is `EtcdUnavailable` (the caller retries); a key that does not hold a leader
record is `MalformedLeaderKey` (also unavailable: nobody can tell who leads until it is fixed).

Over https (`EtcdConfig.tls`, an `EtcdTls`): every endpoint is reached over TLS, etcd's certificate verified against
`ca_file` (for the host name the endpoint gives), and, with `cert_file`/`key_file`, this replica presents its client
certificate (an etcd started with `--client-cert-auth`). The files are read and checked when the `EtcdTls` is made.
A handshake that fails (etcd's certificate not signed by that CA, or this replica's refused by etcd) fails the call
at once as `EtcdTlsRefused`, whose message says which file to check; it is retried like any call without an answer
(another member may hold other certificates), so a replica with the wrong files never leads and says why.

With a user (`EtcdConfig.auth`, an `EtcdAuth`: etcd with `auth enable`): before its first call the client
authenticates (`/auth/authenticate` with the user's name and password, at the endpoint calls go to) and sends the
token it gets as the `Authorization` header of every call, to whichever endpoint. One token serves all: etcd
replicates an authentication through raft, so every member holds the token ("simple" tokens; a JWT is good
anywhere by construction); a member refuses a simple token only once it went unused there for etcd's
`--auth-token-ttl` (each member keeps that clock apart), which a new authentication mends like any other refusal.
Tokens per endpoint would cost etcd an authentication (a raft write and a bcrypt check) per member and save none.
A call that etcd refuses for its token (`TOKEN_REFUSED`: none; expired; dropped at an `auth disable` or a change of
the user's password; or checked against users and roles that changed before the call was applied) did not happen:
etcd checks the token before applying anything, and a call refused when applied changes nothing. So it is the one
call sent twice: the client authenticates again and sends it once more, within the same `call_timeout_s`. An etcd
that answers that authentication is not enabled gets calls without a token until it asks for one (logged as
`etcd.auth_off`: that etcd lets anyone write). Credentials etcd refuses, and a user without permission on the key,
fail the call as `EtcdAuthRefused` (an answer: the endpoint stays; etcd's users are the same at every member), whose
message names the user and the flags to check; after credentials were refused, no authentication is sent for
`AUTH_RETRY_S` (each costs etcd a bcrypt check, and the driver retries ten times a second): calls fail at once with
the same message meanwhile, and each refusal etcd gives is logged (`etcd.auth_refused`, at error). The driver
retries them like any failure, so a replica with the wrong credentials never leads, says why, and leads once etcd
takes them (when etcd's side was wrong, without a restart). Without a user, etcd asking for one is `EtcdAuthRefused`
too, naming the flags to give.
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import os
import re
import ssl
import stat
import threading
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import etcd3gw
import requests
from etcd3gw import exceptions as etcd_errors

from diloco import log
from diloco.core.leadership import LeaderInfo
from diloco.errors import ConfigError, InvalidArgument, Unavailable

MAX_KEY_CHARS = 256
MAX_ENDPOINTS = 5  # members of one etcd cluster a replica is given
MAX_PEERS = 64  # standby entries read (the newest holder wins); more are not looked at
MAX_HANGING = 4  # requests given up on and still running; beyond this a call fails without starting one
FORGET_FAILURE_S = 60.0  # an endpoint's failure older than this no longer counts against it (`next_endpoint`)
AUTH_RETRY_S = 5.0  # after etcd refused the credentials, no authentication is sent for this long
MAX_PASSWORD_BYTES = 4096  # --etcd-password-file holds at most this much
MAX_USER_CHARS = 256

# What etcd answers (its gateway's "error" text) about authentication. A call refused for its token was not applied:
# the token is checked when the call comes in, the auth store's revision before the call is applied (and a refused
# call changes nothing); "user name is empty" is the answer to a call without a token.
TOKEN_REFUSED = (
    "etcdserver: invalid auth token",
    "etcdserver: revision of auth store is old",
    "etcdserver: user name is empty",
)
CREDENTIALS_REFUSED = "etcdserver: authentication failed, invalid user ID or password"
AUTH_NOT_ENABLED = "etcdserver: authentication is not enabled"
PERMISSION_DENIED = "etcdserver: permission denied"


class EtcdUnavailable(Unavailable):
    """No answer from etcd (refused, timed out, an error reply): the outcome of a write is unknown."""


class EtcdUnreachable(EtcdUnavailable):
    """The endpoint gave no answer (refused, timed out, hanging, a server error): the next call tries the next."""


class EtcdRefused(EtcdUnreachable):
    """Nothing took the connection (refused or reset): the member is down, or not at this address."""


class EtcdTlsRefused(EtcdUnreachable):
    """The TLS handshake with the endpoint failed: its certificate is not trusted, or it refused this replica's."""


class EtcdAuthRefused(EtcdUnavailable):
    """etcd refused this replica's credentials (or asks for some and none are given), or its user has no permission
    on the key: no call succeeds until the flags or etcd's users and roles are fixed. The message says which."""


class EtcdTokenRefused(EtcdUnavailable):
    """etcd refused a call for its token (`reason`, one of `TOKEN_REFUSED`): the call did not happen; authenticate
    and send it again."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{where}: {reason}")
        self.reason = reason


class MalformedLeaderKey(EtcdUnavailable):
    """The leader key exists but does not hold a leader record."""


@dataclass(frozen=True)
class EtcdTls:
    """etcd over https: `ca_file`, the CA that signed etcd's certificate (PEM); `cert_file` and `key_file`, this
    replica's client certificate and key (PEM), both or neither (etcd with `--client-cert-auth` needs them). The files
    are read and checked here, so a missing, unreadable or wrong one is a `ConfigError` naming its flag."""

    ca_file: str
    cert_file: str = ""
    key_file: str = ""

    def __post_init__(self) -> None:
        for flag, path in (
            ("--etcd-ca-file", self.ca_file),
            ("--etcd-cert-file", self.cert_file),
            ("--etcd-key-file", self.key_file),
        ):
            if not isinstance(path, str) or not path.isprintable():
                raise ConfigError(f"{flag} must be a path, got {path!r}")
        if not self.ca_file:
            raise ConfigError(
                "etcd over https needs the CA that signed etcd's certificate: --etcd-ca-file FILE (ca.pem of the TLS "
                "folder when `diloco certs --etcd` wrote etcd's certificate)"
            )
        if bool(self.cert_file) != bool(self.key_file):
            given, missing = ("--etcd-cert-file", "--etcd-key-file")[:: 1 if self.cert_file else -1]
            raise ConfigError(f"{given} is given without {missing}: give both (the client certificate and its key)")
        self._check_files()

    @property
    def client_cert(self) -> tuple[str, str] | None:
        return (self.cert_file, self.key_file) if self.cert_file else None

    def _check_files(self) -> None:
        """Load the files as a client would; `ConfigError` naming the flag of the file that cannot be read or is not
        what it should be (a CA certificate; a certificate and its own key)."""
        files = [("--etcd-ca-file", self.ca_file)]
        if self.cert_file:
            files += [("--etcd-cert-file", self.cert_file), ("--etcd-key-file", self.key_file)]
        for flag, path in files:
            try:
                with open(path, "rb"):
                    pass
            except OSError as e:
                raise ConfigError(f"{flag}: cannot read {path!r} ({e.strerror or e})") from e
        try:
            ctx = ssl.create_default_context(cafile=self.ca_file)
        except (ssl.SSLError, ValueError) as e:
            raise ConfigError(f"--etcd-ca-file: {self.ca_file!r} holds no PEM CA certificate ({e})") from e
        if self.client_cert is not None:
            try:
                ctx.load_cert_chain(self.cert_file, self.key_file)
            except (ssl.SSLError, ValueError) as e:
                raise ConfigError(
                    f"--etcd-cert-file/--etcd-key-file: {self.cert_file!r} and {self.key_file!r} are not a PEM "
                    f"certificate and its own private key ({e})"
                ) from e


@dataclass(frozen=True)
class EtcdAuth:
    """etcd's user/password authentication (etcd with `auth enable`): `user`, and `password_file`, a file holding
    the password on one line (a trailing newline is dropped). The file is read and checked here, so a missing,
    unreadable, empty or oversized one is a `ConfigError` naming its flag; the password is kept out of repr (and so
    of every log line and error message)."""

    user: str
    password_file: str
    password: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.user, str) or not self.user or len(self.user) > MAX_USER_CHARS:
            raise ConfigError(f"--etcd-user must be etcd's user name, 1 to {MAX_USER_CHARS} characters")
        if not self.user.isprintable() or self.user != self.user.strip():
            raise ConfigError(f"--etcd-user must be printable, without spaces around it, got {self.user!r}")
        if not isinstance(self.password_file, str) or not self.password_file or not self.password_file.isprintable():
            raise ConfigError(f"--etcd-password-file must be the path of a file, got {self.password_file!r}")
        object.__setattr__(self, "password", read_password(self.password_file))


def read_password(path: str) -> str:
    """The password `path` holds: one line of printable UTF-8, at most `MAX_PASSWORD_BYTES` (its newline dropped).
    `ConfigError` naming --etcd-password-file and what to do; the message never holds the file's content."""
    flag = "--etcd-password-file"
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a folder; or a pipe, which would block the start
            raise ConfigError(f"{flag}: {path!r} is not a file; give a file holding etcd's password for --etcd-user")
        with open(path, "rb") as f:
            data = f.read(MAX_PASSWORD_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{flag}: cannot read {path!r} ({e.strerror or e})") from e
    if len(data) > MAX_PASSWORD_BYTES:
        raise ConfigError(
            f"{flag}: {path!r} holds more than {MAX_PASSWORD_BYTES} bytes; it must hold the password alone"
        )
    try:
        password = data.decode("utf-8").removesuffix("\n").removesuffix("\r")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{flag}: {path!r} is not UTF-8 text; it must hold the password alone") from e
    if not password:
        raise ConfigError(f"{flag}: {path!r} is empty; write etcd's password for --etcd-user into it")
    if not password.isprintable():
        raise ConfigError(
            f"{flag}: {path!r} must hold the password alone, on one line of printable characters (no tabs, no second "
            "line)"
        )
    return password


@dataclass(frozen=True)
class EtcdConfig:
    host: str = "127.0.0.1"
    port: int = 2379
    key: str = "/diloco/coordinator/leader"
    call_timeout_s: float = 0.5
    others: tuple[tuple[str, int], ...] = ()  # more members of the same etcd cluster, tried in turn (module docstring)
    tls: EtcdTls | None = None  # None: plain HTTP; else https to every endpoint (module docstring)
    auth: EtcdAuth | None = None  # None: no user; else a token for every call (module docstring)

    def __post_init__(self) -> None:
        if self.tls is not None and not isinstance(self.tls, EtcdTls):
            raise ConfigError(f"etcd tls must be an EtcdTls or None, got {type(self.tls).__name__}")
        if self.auth is not None and not isinstance(self.auth, EtcdAuth):
            raise ConfigError(f"etcd auth must be an EtcdAuth or None, got {type(self.auth).__name__}")
        if not isinstance(self.others, tuple) or len(self.others) > MAX_ENDPOINTS - 1:
            raise ConfigError(f"etcd: at most {MAX_ENDPOINTS} endpoints, as a tuple of (host, port)")
        for host, port in self.endpoints:
            if not isinstance(host, str) or not host or not host.isprintable():
                raise ConfigError(f"etcd host must be a non-empty host name or IP, got {host!r}")
            if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
                raise ConfigError(f"etcd port must be an integer in 1..65535, got {port!r}")
        if len(set(self.endpoints)) != len(self.endpoints):
            raise ConfigError("etcd: an endpoint is given twice; give each member once")
        if not isinstance(self.key, str) or not self.key.startswith("/") or len(self.key) > MAX_KEY_CHARS:
            raise ConfigError(f"etcd key must start with '/' and have at most {MAX_KEY_CHARS} characters")
        t = self.call_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ConfigError(f"call_timeout_s must be a finite number > 0 (seconds), got {t!r}")

    @property
    def endpoints(self) -> tuple[tuple[str, int], ...]:
        return ((self.host, self.port), *self.others)

    @property
    def scheme(self) -> str:
        return "http" if self.tls is None else "https"


@dataclass(frozen=True)
class Won:
    epoch: int
    lease_id: int


@dataclass(frozen=True)
class Lost:
    holder: LeaderInfo


def encode_record(replica_id: str, address: str) -> bytes:
    """What the leader key holds."""
    return json.dumps({"replica_id": replica_id, "address": address}, sort_keys=True).encode()


def decode_record(value: bytes, epoch: int) -> LeaderInfo:
    try:
        record = json.loads(value)
        return LeaderInfo(str(record["replica_id"]), str(record["address"]), epoch)
    except (ValueError, KeyError, TypeError, InvalidArgument) as e:
        raise MalformedLeaderKey(f"the leader key (epoch {epoch}) does not hold a leader record: {e}") from e


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


class EtcdElection:
    """A thin client of etcd's endpoints for the leader key, one at a time. Not thread-safe: one driver thread uses
    it."""

    def __init__(self, cfg: EtcdConfig) -> None:
        self.cfg = cfg
        session = requests.Session()
        session.trust_env = False  # no proxy (nor CA bundle) from the environment between a replica and its etcd
        if cfg.tls is not None:  # etcd3gw ignores its own TLS arguments when given a session
            session.verify = cfg.tls.ca_file
            session.cert = cfg.tls.client_cert
        self._session = session
        self._clients = [
            etcd3gw.client(
                host=h, port=p, protocol=cfg.scheme, timeout=cfg.call_timeout_s, api_path="/v3/", session=session
            )
            for h, p in cfg.endpoints
        ]
        self._at = 0  # the endpoint calls go to now
        self._key = _b64(cfg.key.encode())
        self._peers_prefix = (cfg.key + ".standbys/").encode()
        self._hanging: list[set[threading.Thread]] = [set() for _ in self._clients]  # given up on, still running
        self._failed: dict[int, tuple[bool, float]] = {}  # endpoint -> (refused, when) of its last failure
        # with a user (module docstring): the token (None: none yet; "": etcd has authentication off), and when etcd
        # last refused the credentials, with its message. Written by the request threads.
        self._token: str | None = None
        self._auth_refused: tuple[float, str] | None = None
        self._log = log.get("ha")

    @property
    def endpoint(self) -> str:
        """HOST:PORT of the endpoint calls go to now."""
        host, port = self.cfg.endpoints[self._at]
        return f"{host}:{port}"

    def close(self) -> None:
        self._session.close()

    # --- the four calls -------------------------------------------------------------------------------------
    def campaign(self, replica_id: str, address: str, ttl_s: int) -> Won | Lost:
        granted = self._post("/lease/grant", {"TTL": ttl_s, "ID": 0})
        try:
            lease_id, granted_ttl = int(granted["ID"]), int(granted.get("TTL", 0))
        except (KeyError, TypeError, ValueError) as e:
            raise EtcdUnavailable(f"unexpected lease grant reply from etcd: {e!r}") from e
        if granted_ttl < ttl_s:
            self._revoke_quietly(lease_id)
            raise EtcdUnavailable(f"etcd granted a lease of {granted.get('TTL')} s, asked for {ttl_s} s")
        read = {"request_range": {"key": self._key}}
        put = {"key": self._key, "value": _b64(encode_record(replica_id, address)), "lease": lease_id}
        txn = {
            "compare": [{"key": self._key, "result": "EQUAL", "target": "CREATE", "create_revision": 0}],
            "success": [
                {"request_put": put},
                read,
            ],
            "failure": [read],
        }
        try:
            reply = self._post("/kv/txn", txn)
            responses = reply["responses"]
            if reply.get("succeeded"):
                kv = responses[1]["response_range"]["kvs"][0]
                return Won(int(kv["create_revision"]), lease_id)
            kvs = responses[0]["response_range"].get("kvs", [])
            if not kvs:
                raise EtcdUnavailable("the campaign lost, yet its read found no leader key")
            holder = self._holder(kvs[0])
        except (EtcdUnavailable, KeyError, IndexError, TypeError, ValueError) as e:
            self._revoke_quietly(lease_id)
            if isinstance(e, EtcdUnavailable):
                raise
            raise EtcdUnavailable(f"unexpected transaction reply from etcd: {e!r}") from e
        self._revoke_quietly(lease_id)
        return Lost(holder)

    def renew(self, lease_id: int) -> bool:
        reply = self._post("/lease/keepalive", {"ID": lease_id})
        try:
            return int(reply["result"].get("TTL", 0)) > 0
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise EtcdUnavailable(f"unexpected keepalive reply from etcd: {e!r}") from e

    def observe(self) -> LeaderInfo | None:
        reply = self._post("/kv/range", {"key": self._key})
        kvs = reply.get("kvs") or []
        if not isinstance(kvs, list):
            raise EtcdUnavailable("unexpected range reply from etcd: kvs is not a list")
        return self._holder(kvs[0]) if kvs else None

    def observe_all(self) -> tuple[LeaderInfo | None, dict[str, int]]:
        """The leader key's holder (or None) and the versions the live standbys published, in one read."""
        prefix = self._peers_prefix
        end = prefix[:-1] + bytes([prefix[-1] + 1])
        peers = {"key": _b64(prefix), "range_end": _b64(end), "limit": MAX_PEERS}
        txn = {"compare": [], "success": [{"request_range": {"key": self._key}}, {"request_range": peers}]}
        reply = self._post("/kv/txn", txn)
        try:
            leader_kvs, peer_kvs = (r["response_range"].get("kvs") or [] for r in reply["responses"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise EtcdUnavailable(f"unexpected transaction reply from etcd: {e!r}") from e
        holder = self._holder(leader_kvs[0]) if leader_kvs else None
        return holder, dict(p for p in (self._peer(kv) for kv in peer_kvs) if p is not None)

    def grant(self, ttl_s: int) -> int:
        """A new lease of `ttl_s` seconds: its id."""
        granted = self._post("/lease/grant", {"TTL": ttl_s, "ID": 0})
        try:
            return int(granted["ID"])
        except (KeyError, TypeError, ValueError) as e:
            raise EtcdUnavailable(f"unexpected lease grant reply from etcd: {e!r}") from e

    def publish(self, replica_id: str, version: int, lease_id: int) -> None:
        """This standby's entry: the version its state is at (`Leadership.hold`), under `lease_id`."""
        key = _b64(self._peers_prefix + replica_id.encode())
        self._post("/kv/put", {"key": key, "value": _b64(json.dumps({"version": version}).encode()), "lease": lease_id})

    def resign(self, lease_id: int, epoch: int) -> None:
        txn = {
            "compare": [{"key": self._key, "result": "EQUAL", "target": "CREATE", "create_revision": epoch}],
            "success": [{"request_delete_range": {"key": self._key}}],
            "failure": [],
        }
        self._post("/kv/txn", txn)
        self.revoke(lease_id)

    def revoke(self, lease_id: int) -> None:
        """Revoke the lease (its keys go with it); a lease etcd no longer has counts as revoked."""
        try:
            self._post("/kv/lease/revoke", {"ID": lease_id})
        except EtcdUnavailable as e:
            if "lease not found" not in str(e):
                raise

    # --- internals ------------------------------------------------------------------------------------------
    def _revoke_quietly(self, lease_id: int) -> None:
        with contextlib.suppress(EtcdUnavailable):  # else the lease expires on its own after its TTL
            self.revoke(lease_id)

    def _peer(self, kv: Any) -> tuple[str, int] | None:
        """A standby entry as (replica id, version); None when it is not one."""
        try:
            replica_id = base64.b64decode(kv["key"], validate=True)[len(self._peers_prefix) :].decode()
            version = json.loads(base64.b64decode(kv.get("value", ""), validate=True))["version"]
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        ok = replica_id.isprintable() and 0 < len(replica_id) <= 128 and type(version) is int and version >= 0
        return (replica_id, version) if ok else None

    def _holder(self, kv: dict[str, Any]) -> LeaderInfo:
        try:
            epoch = int(kv["create_revision"])
            value = base64.b64decode(kv.get("value", ""), validate=True)
        except (KeyError, TypeError, ValueError) as e:
            raise EtcdUnavailable(f"unexpected key-value in etcd's reply: {e!r}") from e
        return decode_record(value, epoch)

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One request to the current endpoint, answered or failed within `call_timeout_s`; no answer moves the next
        call to the next endpoint (module docstring)."""
        at = self._at
        try:
            return self._post_to(at, path, body)
        except EtcdUnreachable as e:
            now = time.monotonic()
            self._failed[at] = (isinstance(e, EtcdRefused | EtcdTlsRefused), now)
            self._at = next_endpoint(at, len(self._clients), self._failed, now)
            raise

    def _post_to(self, at: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
        where = f"etcd {self.endpoint}{path}"
        hanging = self._hanging[at] = {t for t in self._hanging[at] if t.is_alive()}
        if len(hanging) >= MAX_HANGING:
            raise EtcdUnreachable(f"{where}: {len(hanging)} earlier requests still hang; not sending another")
        deadline = time.monotonic() + self.cfg.call_timeout_s
        outcome: list[dict[str, Any] | EtcdUnavailable] = []
        thread = threading.Thread(
            target=lambda: outcome.append(self._exchange(at, where, path, body, deadline)),
            name="etcd-call",
            daemon=True,
        )
        thread.start()
        thread.join(self.cfg.call_timeout_s)
        if thread.is_alive() or not outcome:
            hanging.add(thread)
            raise EtcdUnreachable(f"{where}: no answer within {self.cfg.call_timeout_s:g} s")
        reply = outcome[0]
        if isinstance(reply, EtcdUnavailable):
            raise reply
        return reply

    def _exchange(
        self, at: int, where: str, path: str, body: dict[str, Any], deadline: float
    ) -> dict[str, Any] | EtcdUnavailable:
        """The call (on its own thread), with the token when there is a user: authenticate first when there is none
        yet, and once more (then send the call again) when etcd refuses the token (module docstring). Nothing more is
        sent once `deadline` passed: the caller no longer waits."""
        if self.cfg.auth is None:
            reply = self._send(at, where, path, body, None)
            if isinstance(reply, EtcdTokenRefused):
                return EtcdAuthRefused(
                    f"{where}: etcd has authentication enabled ({reply.reason}); give this replica an etcd user: "
                    "--etcd-user NAME and --etcd-password-file FILE"
                )
            return reply
        token = self._token
        if token is None:
            first = self._authenticate(at)
            if isinstance(first, EtcdUnavailable):
                return first
            if time.monotonic() >= deadline:
                return EtcdUnreachable(f"{where}: no time left after authenticating")
            token = first
        reply = self._send(at, where, path, body, token)
        if not isinstance(reply, EtcdTokenRefused) or time.monotonic() >= deadline:
            return reply
        again = self._authenticate(at)  # the call did not happen: authenticate again and send it once more
        if isinstance(again, EtcdUnavailable):
            return again
        if time.monotonic() >= deadline:
            return EtcdUnreachable(f"{where}: no time left after authenticating again")
        return self._send(at, where, path, body, again)

    def _authenticate(self, at: int) -> str | EtcdUnavailable:
        """A new token from endpoint `at` ("" when etcd has authentication off), kept for the next calls; or the
        failure. Not sent for `AUTH_RETRY_S` after etcd refused the credentials (module docstring)."""
        auth = self.cfg.auth
        assert auth is not None
        host, port = self.cfg.endpoints[at]
        where = f"etcd {host}:{port}/auth/authenticate"
        refused = self._auth_refused
        if refused is not None and time.monotonic() - refused[0] < AUTH_RETRY_S:
            return EtcdAuthRefused(f"{refused[1]} (not asked again for {AUTH_RETRY_S:g} s)")
        self._token = None
        reply = self._send(at, where, "/auth/authenticate", {"name": auth.user, "password": auth.password}, None)
        if isinstance(reply, EtcdUnavailable) and AUTH_NOT_ENABLED in str(reply):
            self._token = ""
            self._log.warning("etcd.auth_off", etcd=f"{host}:{port}", user=auth.user, error=AUTH_NOT_ENABLED)
            return ""
        if isinstance(reply, EtcdUnavailable) and CREDENTIALS_REFUSED in str(reply):
            message = (
                f"{where}: etcd refused user {auth.user!r} ({CREDENTIALS_REFUSED}): check --etcd-user and the "
                f"password in --etcd-password-file {auth.password_file!r} (etcd's `user add`/`user passwd`)"
            )
            self._auth_refused = (time.monotonic(), message)
            self._log.error("etcd.auth_refused", etcd=f"{host}:{port}", user=auth.user, error=message)
            return EtcdAuthRefused(message)
        if isinstance(reply, EtcdUnavailable):
            return reply
        token = reply.get("token")
        if not isinstance(token, str) or not token or not token.isprintable():
            return EtcdUnavailable(f"{where}: unexpected authenticate reply from etcd: no token")
        self._auth_refused = None
        self._token = token
        return token

    def _send(
        self, at: int, where: str, path: str, body: dict[str, Any], token: str | None
    ) -> dict[str, Any] | EtcdUnavailable:
        """The request itself (on its own thread), with `token` as its Authorization header unless None or "": the
        reply, or the failure to raise."""
        client = self._clients[at]
        headers = {"Authorization": token} if token else None
        try:
            reply = client.post(client.get_url(path), json=body, headers=headers)
        except etcd_errors.ConnectionFailedError as e:
            if isinstance(e.__context__, requests.exceptions.SSLError):  # etcd3gw wraps what requests raised
                return _tls_refused(where, e.__context__)
            reset = _reset_in_handshake(e)
            if reset is not None:
                return _tls_refused(where, reset)
            return EtcdRefused(f"{where}: {type(e).__name__} {(e.detail_text or '').strip()[:200]}".rstrip())
        except etcd_errors.ConnectionTimeoutError as e:
            return EtcdUnreachable(f"{where}: {type(e).__name__} {(e.detail_text or '').strip()[:200]}".rstrip())
        except etcd_errors.InternalServerError as e:  # a member without quorum, say: another may answer
            return EtcdUnreachable(f"{where}: {type(e).__name__} {(e.detail_text or '').strip()[:200]}".rstrip())
        except etcd_errors.Etcd3Exception as e:
            text = e.detail_text or ""
            refused = next((r for r in TOKEN_REFUSED if r in text), None)
            if refused is not None:
                return EtcdTokenRefused(where, refused)
            if PERMISSION_DENIED in text:
                return self._permission_denied(where)
            return EtcdUnavailable(f"{where}: {type(e).__name__} {text.strip()[:200]}".rstrip())
        except Exception as e:  # anything else the client raises (requests, a reply that is not JSON): no answer
            return EtcdUnreachable(f"{where}: {type(e).__name__}: {e}"[:300])
        if not isinstance(reply, dict):
            return EtcdUnavailable(f"{where}: the reply is not a JSON object")
        return reply

    def _permission_denied(self, where: str) -> EtcdAuthRefused:
        key = self.cfg.key
        who = f"etcd user {self.cfg.auth.user!r}" if self.cfg.auth else "this replica's etcd user"
        return EtcdAuthRefused(
            f"{where}: {PERMISSION_DENIED}: {who} may not read or write {key!r}; grant it a role with readwrite "
            f"permission on the keys with prefix {key!r} (etcd's `role grant-permission ROLE --prefix=true readwrite "
            f"{key}`)"
        )


def next_endpoint(at: int, n: int, failed: Mapping[int, tuple[bool, float]], now: float) -> int:
    """Where calls go after endpoint `at` of `n` gave no answer, from each endpoint's last failure (`failed`: whether
    it refused the connection, and when): one not failed in the last `FORGET_FAILURE_S` first, then one that was only
    slow (timed out, hung, a server error), then one that refused; among equals, round robin from `at`. `at` itself
    only when it is the only endpoint."""

    def rank(i: int) -> int:
        refused, when = failed.get(i, (False, -math.inf))
        return 0 if now - when > FORGET_FAILURE_S else (2 if refused else 1)

    others = [(at + k) % n for k in range(1, n)]
    return min(others, key=rank) if others else at  # min keeps the first of equals: round-robin order


def _reset_in_handshake(err: BaseException) -> ConnectionError | None:
    """The reset under `err` if it came in the TLS handshake, told by a frame of `do_handshake` on its traceback
    (etcd's plain HTTP port may reset a ClientHello rather than close it); None for a reset of a connection already
    up (an etcd dying mid-call), or any other failure. (An SSL error is a refused handshake wherever it comes: with
    TLS 1.3, etcd refuses a client certificate at the client's first read, after its handshake is done.)"""
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, ConnectionResetError | ConnectionAbortedError):
            in_handshake = any(f.name == "do_handshake" for f in traceback.extract_tb(cause.__traceback__))
            return cause if in_handshake else None
        cause = cause.__cause__ or cause.__context__
    return None


def _tls_refused(where: str, err: BaseException) -> EtcdTlsRefused:
    """What a failed handshake means (`err`: the SSL error, or the reset in the handshake), and which file to
    check."""
    text = str(err)
    found = re.search(r"\[SSL[^\]]*\][^(')]*|EOF occurred in violation of protocol", text)
    reason = found.group(0).strip() if found else text[-200:]
    if "CERTIFICATE_VERIFY_FAILED" in text:
        return EtcdTlsRefused(
            f"{where}: TLS: etcd's certificate is not trusted ({reason}); --etcd-ca-file must be the CA that signed "
            "etcd's --cert-file, and that certificate must name the host given in --etcd"
        )
    return EtcdTlsRefused(
        f"{where}: TLS: etcd refused the handshake ({reason}); with --client-cert-auth it needs --etcd-cert-file and "
        "--etcd-key-file: a client certificate signed by a CA in etcd's --trusted-ca-file (or etcd serves plain HTTP "
        "there: give its http:// address)"
    )
