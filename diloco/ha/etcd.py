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
answers. A call is never sent twice (its outcome may be unknown); the driver's next call, a fraction of a second
later, is. An answer, even a refusal (a lease etcd no longer has), keeps the endpoint.

- campaign: grant a lease of `ttl_s`, then one transaction: if the leader key's create_revision is 0 (no key),
  put {replica_id, address} under the lease and read the key back, else read the key. Won: the epoch is the
  key's create_revision. Lost: the holder and its epoch. Anything else (an error, a timeout: the transaction
  may or may not have happened) revokes the lease (best effort, which deletes the key if it was created) and
  raises `EtcdUnavailable`.
- renew: one keepalive of the lease. True while the lease lives; False when etcd says it is gone.
- observe: read the key: its holder, or None.
- resign: delete the key if its create_revision is still our epoch (a transaction), then revoke the lease.

The newest standby wins (`diloco.core.leadership`, "The newest standby wins"): each standby keeps an entry
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
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import re
import ssl
import threading
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import etcd3gw
import requests
from etcd3gw import exceptions as etcd_errors

from diloco.core.leadership import LeaderInfo
from diloco.errors import ConfigError, InvalidArgument, Unavailable

MAX_KEY_CHARS = 256
MAX_ENDPOINTS = 5  # members of one etcd cluster a replica is given
MAX_PEERS = 64  # standby entries read (the newest standby wins); more are not looked at
MAX_HANGING = 4  # requests given up on and still running; beyond this a call fails without starting one
FORGET_FAILURE_S = 60.0  # an endpoint's failure older than this no longer counts against it (`next_endpoint`)


class EtcdUnavailable(Unavailable):
    """No answer from etcd (refused, timed out, an error reply): the outcome of a write is unknown."""


class EtcdUnreachable(EtcdUnavailable):
    """The endpoint gave no answer (refused, timed out, hanging, a server error): the next call tries the next."""


class EtcdRefused(EtcdUnreachable):
    """Nothing took the connection (refused or reset): the member is down, or not at this address."""


class EtcdTlsRefused(EtcdUnreachable):
    """The TLS handshake with the endpoint failed: its certificate is not trusted, or it refused this replica's."""


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
class EtcdConfig:
    host: str = "127.0.0.1"
    port: int = 2379
    key: str = "/diloco/coordinator/leader"
    call_timeout_s: float = 0.5
    others: tuple[tuple[str, int], ...] = ()  # more members of the same etcd cluster, tried in turn (module docstring)
    tls: EtcdTls | None = None  # None: plain HTTP; else https to every endpoint (module docstring)

    def __post_init__(self) -> None:
        if self.tls is not None and not isinstance(self.tls, EtcdTls):
            raise ConfigError(f"etcd tls must be an EtcdTls or None, got {type(self.tls).__name__}")
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
        """This standby's entry: the newest version a leader vouched for, under `lease_id`."""
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
        outcome: list[dict[str, Any] | EtcdUnavailable] = []
        thread = threading.Thread(
            target=lambda: outcome.append(self._send(self._clients[at], where, path, body)),
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

    @staticmethod
    def _send(
        client: etcd3gw.Etcd3Client, where: str, path: str, body: dict[str, Any]
    ) -> dict[str, Any] | EtcdUnavailable:
        """The request itself (on its own thread): the reply, or the failure to raise."""
        try:
            reply = client.post(client.get_url(path), json=body)
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
            return EtcdUnavailable(f"{where}: {type(e).__name__} {(e.detail_text or '').strip()[:200]}".rstrip())
        except Exception as e:  # anything else the client raises (requests, a reply that is not JSON): no answer
            return EtcdUnreachable(f"{where}: {type(e).__name__}: {e}"[:300])
        if not isinstance(reply, dict):
            return EtcdUnavailable(f"{where}: the reply is not a JSON object")
        return reply


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
