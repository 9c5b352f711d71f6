"""A local cluster of real processes on loopback: healthd, the coordinator and N workers, each a separate
`python -m services.<name>` process talking only gRPC. Used by `diloco local`, the multi-process tests and the
benchmarks. Every child is reaped on exit, whatever happens."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from diloco.rpc.security import SecurityConfig
from diloco.rpc.server import channel
from diloco.rpc.tls import ADMIN_TOKEN_FILE, JOIN_TOKEN_FILE, add_identity, write_bundle
from diloco.v1 import coordinator_pb2, coordinator_pb2_grpc, healthd_pb2, healthd_pb2_grpc

# A task small enough that a round takes a fraction of a second on a CPU: for tests, chaos runs and quick demos.
TINY_TASK_ARGS: tuple[str, ...] = (
    *("--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "32", "--batch-size", "8"),
    *("--max-bytes", "400000", "--shards", "8", "--eval-tokens", "2048"),
)


class RunShape(Protocol):
    """What a cluster run asks of the coordinator (ClusterConfig here, the chaos suite's config in containers)."""

    @property
    def mode(self) -> str: ...
    @property
    def min_quorum(self) -> int: ...
    @property
    def local_steps(self) -> int: ...
    @property
    def min_local_steps(self) -> int: ...
    @property
    def codec(self) -> str: ...
    @property
    def workers(self) -> int: ...
    @property
    def outer_steps(self) -> int: ...
    @property
    def checkpoint_every(self) -> int: ...


def coordinator_flags(run: RunShape, port: int, healthd_address: str, checkpoint_dir: str) -> list[str]:
    """The coordinator's command-line flags for a run (the task flags come on top)."""
    return [
        *("--port", str(port), "--healthd-address", healthd_address, "--mode", run.mode),
        *("--min-quorum", str(run.min_quorum), "--local-steps", str(run.local_steps)),
        *("--min-local-steps", str(run.min_local_steps), "--codec", run.codec),
        *("--expected-workers", str(run.workers), "--target-outer-steps", str(run.outer_steps)),
        *("--checkpoint-dir", checkpoint_dir, "--checkpoint-every", str(run.checkpoint_every)),
    ]


def wait_serving(
    address: str,
    timeout_s: float,
    check_alive: Callable[[], None] = lambda: None,
    make_channel: Callable[[str], grpc.Channel] = channel,
) -> None:
    """Poll grpc.health.v1 at `address` until it answers SERVING; `check_alive` may raise to give up early
    (the process exited). Raises TimeoutError after `timeout_s`. `make_channel`: e.g. a TLS channel."""
    deadline = time.monotonic() + timeout_s
    with make_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            check_alive()
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"{address} did not become healthy within {timeout_s} s")


V = TypeVar("V")

# What a call to a live service can fail with for a while and then succeed: the server is (re)starting or busy,
# a TLS handshake failed under load ("UNAVAILABLE: Handshake read failed"), a call ran past its deadline.
TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def transient(error: Exception) -> bool:
    """A transient RPC failure: the condition is not known yet, ask again."""
    return isinstance(error, grpc.RpcError) and error.code() in TRANSIENT


def wait_for(
    what: str,
    probe: Callable[[], V],
    timeout_s: float = 10.0,
    interval_s: float = 0.02,
    retry_on: Callable[[Exception], bool] = transient,
) -> V:
    """Poll `probe` until it returns something truthy and return that. An exception `retry_on` accepts (by default
    a transient RPC failure, `TRANSIENT`) counts as "not yet"; any other ends the wait. On timeout, fails with
    `what` and the last error the wait let pass, if any."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    tick = threading.Event()  # never set: waits `interval_s` between polls
    while True:
        try:
            value = probe()
            if value:
                return value
        except Exception as e:
            if not retry_on(e):
                raise
            last = e
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}" + describe(last))
        tick.wait(interval_s)


def describe(error: Exception | None) -> str:
    """`; last error: ...` for a timeout message, or nothing."""
    if error is None:
        return ""
    if isinstance(error, grpc.RpcError) and isinstance(error, grpc.Call):
        return f"; last error: {error.code().name}: {error.details()}"
    return f"; last error: {error!r}"


def seconds_until(
    what: str,
    probe: Callable[[], object],
    timeout_s: float,
    interval_s: float = 0.05,
    retry_on: Callable[[Exception], bool] = transient,
) -> float:
    """`wait_for`, returning the seconds the wait took."""
    start = time.monotonic()
    wait_for(what, probe, timeout_s, interval_s, retry_on)
    return time.monotonic() - start


@dataclass(frozen=True)
class LedgerShard:
    """One shard of a ledger as plain data (from GetLedger, or from `diloco ctl ledger --json`)."""

    shard_id: int
    committed: int
    ranges: tuple[tuple[int, int], ...]


def ledger_shards(ledger: coordinator_pb2.GetLedgerResponse) -> list[LedgerShard]:
    return [
        LedgerShard(s.shard_id, s.committed, tuple((r.start, r.end) for r in s.committed_ranges)) for s in ledger.shards
    ]


def ledger_json_shards(ledger: dict[str, Any]) -> list[LedgerShard]:
    """`ledger_shards` of `diloco ctl ledger --json`'s output."""

    def ranges(s: dict[str, Any]) -> tuple[tuple[int, int], ...]:
        return tuple((int(r["start"]), int(r["end"])) for r in s["committed_ranges"])

    return [LedgerShard(int(s["shard_id"]), int(s["committed"]), ranges(s)) for s in ledger["shards"]]


def ledger_check(ledger: coordinator_pb2.GetLedgerResponse) -> list[str]:
    """`ledger_problems` of one GetLedger reply, against the tokens applied that it read with the shards (a status
    read apart may be a round older or newer while training goes on)."""
    return ledger_problems(ledger_shards(ledger), ledger.tokens_applied)


def ledger_problems(shards: Iterable[LedgerShard], tokens_applied: int) -> list[str]:
    """What keeps a ledger from being exactly once (empty: it is): every shard's committed ranges must tile
    [0, committed) in order, with no gap (a lost range) and no overlap (a duplicate), and the cursors must add up
    to the tokens the coordinator applied."""
    problems: list[str] = []
    total = 0
    for s in shards:
        cursor = 0
        for start, end in s.ranges:
            if start < cursor:
                what = f"overlaps the one before: applied twice (cursor {cursor})"
                problems.append(f"shard {s.shard_id}: range [{start}, {end}) {what}")
            elif start > cursor:
                problems.append(f"shard {s.shard_id}: range [{start}, {end}) leaves a gap: [{cursor}, {start}) lost")
            if end <= start:
                problems.append(f"shard {s.shard_id}: range [{start}, {end}) is empty or inverted")
            cursor = max(cursor, end)
        if cursor != s.committed:
            problems.append(f"shard {s.shard_id}: ranges end at {cursor}, committed cursor is {s.committed}")
        total += s.committed
    if total != tokens_applied:
        problems.append(f"the committed cursors add up to {total} tokens, the coordinator applied {tokens_applied}")
    return problems


def logged_at(fields: dict[str, Any]) -> float:
    """When a service wrote a log line (its `timestamp`, ISO 8601 in UTC), in seconds since the epoch: the same
    clock as `time.time()` in this machine's other processes."""
    return datetime.datetime.fromisoformat(str(fields["timestamp"]).replace("Z", "+00:00")).timestamp()


@dataclass(frozen=True)
class LogLine:
    read_at: float  # time.monotonic() when the follower read it
    fields: dict[str, Any]

    @property
    def event(self) -> str:
        return str(self.fields.get("event", ""))

    @property
    def logged_at(self) -> float:
        """When the service wrote it (`logged_at`); KeyError for a line without a timestamp (a traceback)."""
        return logged_at(self.fields)


def _ends_a_line(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


class LogFollower:
    """Reads the JSON log lines a child appends to its log file (`tail -f`): `read()` returns the complete lines
    written since the last call. A restarted child appends to the same file, so one follower sees every
    incarnation in order. Lines that are not JSON objects (a traceback) come back as `{"event": "", "text": ...}`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def read(self) -> list[LogLine]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        *complete, self._partial = (self._partial + data).split(b"\n")
        now = time.monotonic()
        out = []
        for raw in complete:
            text = raw.decode(errors="replace").strip()
            if not text:
                continue
            fields: Any = None
            if text.startswith("{"):
                try:
                    fields = json.loads(text)
                except ValueError:
                    fields = None
            out.append(LogLine(now, fields if isinstance(fields, dict) else {"event": "", "text": text}))
        return out


@dataclass(frozen=True)
class ClusterConfig:
    workers: int = 4
    mode: str = "decoupled"
    slowdowns: tuple[float, ...] = ()  # per worker; missing entries run at full speed
    outer_steps: int = 30
    local_steps: int = 30
    min_local_steps: int = 5
    min_quorum: int = 2
    codec: str = "int8"
    dead_after_s: float = 2.0
    heartbeat_interval_s: float = 0.5
    checkpoint_every: int = 5
    run_dir: Path = Path("runs/local")
    task_args: tuple[str, ...] = ()  # model/data flags passed to the coordinator
    coordinator_args: tuple[str, ...] = ()
    worker_env: dict[int, dict[str, str]] = field(default_factory=dict)  # per worker: extra environment
    worker_args: dict[int, tuple[str, ...]] = field(default_factory=dict)  # extra flags of one worker (fault tests)
    insecure: bool = False  # False: mutual TLS and tokens, generated into a temporary folder
    nproc_per_worker: int = 1  # > 1: every worker is an island of this many ranks (torchrun, DDP)


@dataclass
class Proc:
    name: str
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen[bytes]
    log_file: IO[bytes]
    started_at: float
    log_offset: int = 0  # where this incarnation's lines start in the log (a restarted child appends to it)

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None


class LocalCluster:
    def __init__(self, cfg: ClusterConfig) -> None:
        self.cfg = cfg
        self.run_dir = cfg.run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # 0 until the first start: each service binds port 0 and logs the port it got (`<service>.started`); a
        # restarted one binds the same port again (it was ours)
        self.coordinator_port = 0
        self.healthd_port = 0
        self.procs: dict[str, Proc] = {}
        self._channel: grpc.Channel | None = None
        self._channel_address = ""  # where _channel goes
        self.tls_dir: Path | None = None
        self.security = SecurityConfig()  # plaintext on loopback, no tokens
        if not cfg.insecure:
            self.tls_dir = Path(tempfile.mkdtemp(prefix="diloco-tls-"))
            write_bundle(self.tls_dir, [f"worker{i}" for i in range(cfg.workers)], hosts=("localhost", "127.0.0.1"))
            self.security = SecurityConfig(
                tls_dir=str(self.tls_dir),
                tls_name="admin",
                insecure=False,
                join_token=(self.tls_dir / JOIN_TOKEN_FILE).read_text().strip(),
                admin_token=(self.tls_dir / ADMIN_TOKEN_FILE).read_text().strip(),
            )

    @property
    def coordinator_address(self) -> str:
        return f"127.0.0.1:{self.coordinator_port}"

    @property
    def healthd_address(self) -> str:
        return f"127.0.0.1:{self.healthd_port}"

    # --- processes --------------------------------------------------------------------------------------------
    def security_args(self, name: str, tokens: Sequence[str] = ("join", "admin")) -> list[str]:
        """The security flags of child `name`: its TLS identity and token files (never token values in argv)."""
        if self.tls_dir is None:
            return ["--insecure"]
        if not (self.tls_dir / f"{name}.pem").exists():
            add_identity(self.tls_dir, name)
        args = ["--tls-dir", str(self.tls_dir), "--tls-name", name]
        for kind in tokens:
            token_file = JOIN_TOKEN_FILE if kind == "join" else ADMIN_TOKEN_FILE
            args += [f"--{kind}-token-file", str(self.tls_dir / token_file)]
        return args

    def _spawn(self, name: str, module: str, args: Sequence[str], env: dict[str, str] | None = None) -> Proc:
        old = self.procs.get(name)
        if old is not None:
            if old.alive:
                raise RuntimeError(f"{name} is already running")
            old.log_file.close()  # the ended incarnation's; the new one appends to the same file
        log_path = self.run_dir / f"{name}.log"
        log_file = open(log_path, "ab")  # noqa: SIM115 - closed in _reap
        if log_file.tell() and not _ends_a_line(log_path):  # a killed incarnation's torn last line ends here, or
            log_file.write(b"\n")  # the new one's first line (`replica.started`, say) would be read glued to it
            log_file.flush()
        offset = log_file.tell()
        argv = [sys.executable, "-m", module, *args]
        child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        popen = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, env=child_env, start_new_session=True)
        proc = Proc(name, argv, log_path, popen, log_file, time.monotonic(), offset)
        self.procs[name] = proc
        return proc

    def start_healthd(self, coordinators: str | None = None) -> Proc:
        """Start healthd on its port (0 before the first start); it reports to the coordinator once that has a
        port (before, it only tracks heartbeats), or to `coordinators` (replicas: HOST:PORT,HOST:PORT...)."""
        c = self.cfg
        if coordinators is None:
            coordinators = self.coordinator_address if self.coordinator_port else ""
        return self._spawn(
            "healthd",
            "services.healthd",
            [
                "--port",
                str(self.healthd_port),
                "--coordinator-address",
                coordinators,
                "--heartbeat-interval-s",
                str(c.heartbeat_interval_s),
                "--dead-after-s",
                str(c.dead_after_s),
                *self.security_args("healthd"),
            ],
        )

    def start_coordinator(self) -> Proc:
        c = self.cfg
        return self._spawn(
            "coordinator",
            "services.coordinator",
            [
                *coordinator_flags(c, self.coordinator_port, self.healthd_address, str(self.run_dir / "checkpoints")),
                *c.task_args,
                *c.coordinator_args,
                *self.security_args("coordinator"),
            ],
        )

    def start_replica(self, name: str, etcd: str, port: int = 0, args: Sequence[str] = ()) -> Proc:
        """Start coordinator replica `name` under etcd leadership (`--etcd`, docs/ha.md): it campaigns, then leads
        or follows the leader as a hot standby. Port 0: a free port, advertised in etcd and logged in its
        `replica.started` line; start it again on that port after it ended (a supervisor's restart) and it comes
        back as a standby, from its checkpoints in `run_dir/checkpoints-<name>`. `args`: replication flags and the
        like, after the run's own (`--sync-replicas 1`, ...)."""
        c = self.cfg
        checkpoints = str(self.run_dir / f"checkpoints-{name}")
        return self._spawn(
            name,
            "services.coordinator",
            [
                *coordinator_flags(c, port, self.healthd_address, checkpoints),
                *("--etcd", etcd, "--replica-id", name),
                *c.task_args,
                *c.coordinator_args,
                *args,
                *self.security_args("coordinator"),
            ],
        )

    def worker_flags(self, i: int) -> list[str]:
        """Worker `i`'s command-line flags (`python -m services.worker ...`): the cluster's addresses and settings,
        then its own `worker_args` (a later flag wins)."""
        c = self.cfg
        slowdown = c.slowdowns[i] if i < len(c.slowdowns) else 1.0
        return [
            *("--coordinator", self.coordinator_address, "--healthd", self.healthd_address),
            *("--name", f"worker{i}", "--slowdown", str(slowdown)),
            *("--heartbeat-interval-s", str(c.heartbeat_interval_s)),
            *self.security_args(f"worker{i}", tokens=("join",)),
            *(("--nproc-per-node", str(c.nproc_per_worker)) if c.nproc_per_worker > 1 else ()),
            *c.worker_args.get(i, ()),
        ]

    def start_worker(self, i: int) -> Proc:
        return self._spawn(f"worker{i}", "services.worker", self.worker_flags(i), env=self.cfg.worker_env.get(i))

    def start(self, timeout_s: float = 60.0) -> None:
        """Start healthd, the coordinator and the workers; return once both services answer SERVING.

        No port is picked here (a port found free and closed can be taken by another process before the child
        binds it): each service binds port 0 and this reads the port from its `<service>.started` log line. Each
        needs the other's address, so healthd starts first without a coordinator to report to, the coordinator
        starts with healthd's address, and healthd is started again on the same port with the coordinator's."""
        deadline = time.monotonic() + timeout_s
        self.healthd_port = self.bound_port(self.start_healthd(), "healthd.started", timeout_s)
        coordinator = self.start_coordinator()
        self.coordinator_port = self.bound_port(coordinator, "coordinator.started", deadline - time.monotonic())
        self.stop_child("healthd", grace_s=10)
        self.start_healthd()
        self.wait_serving(self.healthd_address, deadline - time.monotonic())
        self.wait_serving(self.coordinator_address, deadline - time.monotonic())
        for i in range(self.cfg.workers):
            self.start_worker(i)

    def bound_port(self, proc: Proc, event: str, timeout_s: float) -> int:
        """The port child `proc` bound, from its `event` log line (`<service>.started`, which has `port`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with open(proc.log_path, "rb") as f:
                f.seek(proc.log_offset)
                for raw in f.read().splitlines():
                    try:
                        fields = json.loads(raw)
                    except ValueError:
                        continue
                    if isinstance(fields, dict) and fields.get("event") == event:
                        return int(fields["port"])
            if not proc.alive:
                raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{self.tail(proc.name)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{proc.name} did not log {event} within {timeout_s:g} s:\n{self.tail(proc.name)}")
            time.sleep(0.02)

    def stop_child(self, name: str, grace_s: float) -> None:
        """SIGTERM child `name` and wait for it to exit (SIGKILL after `grace_s`)."""
        p = self.procs[name]
        self.signal(name, signal.SIGTERM)
        try:
            p.popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.popen.pid, signal.SIGKILL)
            p.popen.wait(timeout=10)

    def wait_serving(self, address: str, timeout_s: float) -> None:
        """Wait until a service answers SERVING on grpc.health.v1 (raises with the log tail if it exits)."""

        def check_alive() -> None:
            for p in self.procs.values():
                if not p.alive and p.name in ("coordinator", "healthd"):
                    raise RuntimeError(f"{p.name} exited with {p.popen.returncode}:\n{self.tail(p.name)}")

        wait_serving(address, timeout_s, check_alive, make_channel=lambda a: self.security.channel(a, admin=True))

    def signal(self, name: str, sig: int) -> None:
        proc = self.procs[name]
        if proc.alive:
            os.kill(proc.popen.pid, sig)

    def kill(self, name: str) -> None:
        self.signal(name, signal.SIGKILL)
        self.procs[name].popen.wait(timeout=10)

    def respawn(self, name: str) -> Proc:
        """Start child `name` (`coordinator`, `healthd` or `worker<i>`) again after it ended, with the same flags:
        the same port, and for the coordinator the same checkpoint folder (it resumes from its newest checkpoint
        under a new epoch). Raises if it is still running."""
        if name == "coordinator":
            return self.start_coordinator()
        if name == "healthd":
            return self.start_healthd()
        if name.startswith("worker") and name.removeprefix("worker").isdigit():
            return self.start_worker(int(name.removeprefix("worker")))
        raise ValueError(f"no child named {name!r}: coordinator, healthd or worker<i>")

    def set_target(self, outer_steps: int) -> None:
        """The job's target from the coordinator's next start on (`respawn`): an operator changes a running job's
        target by restarting its coordinator with another `--target-outer-steps` (it resumes from its checkpoint;
        0: none). Used by the kill storm, whose job has no target until its final fault."""
        if outer_steps < 0:
            raise ValueError(f"outer_steps must be >= 0 (0: no target), got {outer_steps}")
        self.cfg = dataclasses.replace(self.cfg, outer_steps=outer_steps)

    def follow(self, name: str) -> LogFollower:
        """A follower of child `name`'s log from its beginning (every incarnation's lines)."""
        return LogFollower(self.run_dir / f"{name}.log")

    def tail(self, name: str, lines: int = 30) -> str:
        path = self.procs[name].log_path
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM workers, then the coordinator(s) and healthd; SIGKILL what is left after the grace period."""
        workers = [n for n in self.procs if n.startswith("worker")]
        services = [n for n in self.procs if n not in workers and n != "healthd"] + ["healthd"]  # coordinator(s)
        for group in (workers, services):
            for name in group:
                if name in self.procs:
                    self.signal(name, signal.SIGCONT)
                    self.signal(name, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for name in group:
                if name not in self.procs:
                    continue
                p = self.procs[name]
                try:
                    p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    os.killpg(p.popen.pid, signal.SIGKILL)
                    p.popen.wait(timeout=10)
        for p in self.procs.values():
            p.log_file.close()
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self.tls_dir is not None:
            shutil.rmtree(self.tls_dir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- RPC helpers ------------------------------------------------------------------------------------------
    @property
    def stub(self) -> coordinator_pb2_grpc.CoordinatorStub:
        """The coordinator's, at `coordinator_port` (moved to another port, e.g. the leader among replicas: a new
        channel there)."""
        if self._channel is not None and self._channel_address != self.coordinator_address:
            self._channel.close()
            self._channel = None
        if self._channel is None:
            self._channel = self.security.channel(self.coordinator_address, admin=True)
            self._channel_address = self.coordinator_address
        return coordinator_pb2_grpc.CoordinatorStub(self._channel)

    def status(self, timeout_s: float = 3.0) -> coordinator_pb2.GetStatusResponse:
        return self.stub.GetStatus(coordinator_pb2.GetStatusRequest(), timeout=timeout_s)

    def final_status(self, timeout_s: float = 120.0) -> coordinator_pb2.GetStatusResponse:
        """The status once the version it names has been evaluated (evaluation runs after a round, in the
        background, so right after the last round `validation_loss` may still be an earlier version's)."""
        evals, evaluated = self.follow("coordinator"), set[int]()

        def evaluated_now() -> bool:
            evaluated.update(int(x.fields["version"]) for x in evals.read() if x.event == "eval.done")
            return self.status().version in evaluated

        seconds_until("the evaluation of the newest version", evaluated_now, timeout_s=timeout_s, interval_s=0.2)
        return self.status()

    def workers(self, timeout_s: float = 3.0) -> coordinator_pb2.ListWorkersResponse:
        return self.stub.ListWorkers(coordinator_pb2.ListWorkersRequest(), timeout=timeout_s)

    def ledger(self, timeout_s: float = 5.0) -> coordinator_pb2.GetLedgerResponse:
        return self.stub.GetLedger(coordinator_pb2.GetLedgerRequest(), timeout=timeout_s)

    def nodes(self, timeout_s: float = 3.0) -> healthd_pb2.ListNodesResponse:
        with self.security.channel(self.healthd_address, admin=True) as ch:
            return healthd_pb2_grpc.HealthDaemonStub(ch).ListNodes(healthd_pb2.ListNodesRequest(), timeout=timeout_s)

    def workers_alive(self) -> list[str]:
        return [n for n, p in self.procs.items() if n.startswith("worker") and p.alive]
