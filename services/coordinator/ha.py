"""A coordinator replica under etcd leadership (ALGORITHM.md section 11; `--etcd`): the wiring between the
leadership driver (`diloco.ha.driver`), the hot standby (`services.coordinator.standby`) and the coordinator server.

Every replica campaigns. What the process does follows `diloco.core.leadership.duty` of the driver's view, asked
every `POLL_S`:

- FOLLOW: a hot standby of the leader at the address its etcd key holds (`StandbyFollower`), writing checkpoints to
  `--checkpoint-dir`; a new leader address means a new follower (it resumes from its own checkpoints).
- SERVE: promotion. The follower stops, its state (the newest version it applied) is written as a checkpoint, and a
  `CoordinatorServer` started on `--checkpoint-dir` resumes from it and serves on the address advertised in etcd,
  under the leadership epoch as its coordinator epoch. When a leader vouched for the standby (it accepted an
  acknowledgement) the server keeps the learner table the round log carried: those learners go on without
  registering again. Its state checks `may_accept()` (the fencing by time) before accepting a registration or a
  submission, and before closing and publishing a round; when it is false those calls get UNAVAILABLE "not the
  leader; leader is at HOST:PORT" (`diloco.errors.NotLeader`).
- RETIRE: a replica that served and lost leadership stops serving (final checkpoint) and exits with status 3; a
  supervisor restarts it and it comes back as a standby of the new leader.
- WAIT: nobody is known to lead yet; keep what it holds.

Step-down (the StepDown RPC, `diloco ctl step-down`; `step_down`): the leader stops accepting registrations,
submissions and rounds (its fence refuses them), waits until a standby acknowledged its newest version, writes a
final checkpoint and gives its etcd key back (delete, revoke the lease), so a standby takes over at once; the RPC
answers with the successor once it is seen, and then the old leader stops serving and exits with status 0 (a planned
exit: start it again, e.g. on the new version, and it comes back as a standby). With no standby following, or none
catching up in time, the step-down is refused (FAILED_PRECONDITION) and the leader goes on leading.

While not leading, the replica serves a stand-in on its advertised port (`NotLeaderServer`): every Coordinator
call gets UNAVAILABLE naming the leader, and health says NOT_SERVING, so a learner that reached a standby moves to
the leader. The stand-in is stopped just before the server binds the same port.

Metrics (`--metrics-port`): the replica binds the port once, at its start, and serves its own series whatever it
does (`ReplicaCollector`: its role; while it follows, the version it applied, how far behind the leader it is, the
epoch it follows; the snapshots and resyncs it took). A promoted server registers the leader's metrics in the same
registry (`ServedMetrics`): the same port then serves them too, with no second bind.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import replace
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry

from diloco import log as logging
from diloco.core.codecs import warm_up
from diloco.core.leadership import Duty, Handover, LeaderInfo, LeadershipConfig, duty
from diloco.errors import FailedPrecondition, not_leader
from diloco.rpc.metrics import ServedMetrics, serve_metrics
from diloco.rpc.status import details_of, status_of
from services.coordinator import checkpoint
from services.coordinator.announce import LeaderAnnouncer
from services.coordinator.config import CoordinatorServiceConfig
from services.coordinator.metrics import ReplicaCollector, ReplicaRole, StandbyView
from services.coordinator.replication import ReplicationLog
from services.coordinator.server import SERVICE_NAME, CoordinatorServer
from services.coordinator.standby import StandbyFollower, follower_from

POLL_S = 0.05  # how often the replica looks at its leadership view
EXIT_RETIRED = 3  # the process served and lost leadership
EXIT_REFUSED = 2  # the leader refused this replica as a standby for good (another task's fingerprint)
# a retiring leader accepts nothing (its fence refuses it) and may be cut off from the learners whose streams a
# drain waits for: it drains this long, not --shutdown-grace-s, then writes its final checkpoint and exits
RETIRE_GRACE_S = 1.0
EXIT_UNBOUND = 4  # it could not serve on its address (the port is taken, or the host name does not resolve)
SUCCESSOR_WAIT_S = 3.0  # how long a step-down waits to see who took over before it answers
NO_STANDBY = (
    "no standby follows this leader, so none could take over; start another replica with the same flags and --etcd "
    "(it follows this one), wait until `diloco ctl status` lists it with lag 0, then step down again"
)


def free_port(host: str) -> int:
    """A port free on `host` now (the replica must advertise its address before it serves)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


class NotLeaderServer:
    """A replica's stand-in while it does not lead: every `diloco.v1.Coordinator` method answers UNAVAILABLE
    naming the leader (`hint()`), health answers NOT_SERVING."""

    def __init__(self, cfg: CoordinatorServiceConfig, hint: Callable[[], str]) -> None:
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="not-leader"))
        hint_of = hint

        class Handler(grpc.GenericRpcHandler):  # type: ignore[type-arg]
            def service(self, details: grpc.HandlerCallDetails) -> Any:
                method: str = details.method
                if method.startswith("/grpc.health.v1.Health/Check"):

                    def health(_req: bytes, _ctx: grpc.ServicerContext) -> bytes:
                        status = health_pb2.HealthCheckResponse.NOT_SERVING
                        return health_pb2.HealthCheckResponse(status=status).SerializeToString()

                    return grpc.unary_unary_rpc_method_handler(health)
                if not method.startswith(f"/{SERVICE_NAME}/"):
                    return None

                def refuse(_req: Any, ctx: grpc.ServicerContext) -> bytes:
                    err = not_leader(hint_of())
                    ctx.abort(status_of(err), details_of(err))  # the one table: diloco.rpc.status

                return grpc.stream_stream_rpc_method_handler(refuse)

        self._server.add_generic_rpc_handlers((Handler(),))
        where = f"{cfg.host}:{cfg.port}"
        creds = cfg.security.server_credentials()
        try:
            bound = (
                self._server.add_insecure_port(where) if creds is None else self._server.add_secure_port(where, creds)
            )
        except RuntimeError:  # grpc's "Failed to bind to address"
            bound = 0
        if bound != cfg.port:
            self._server.stop(0)
            raise OSError(
                f"cannot serve on {where}: another process holds the port, or the host name does not resolve (a "
                "network partition); free the port or give another --host/--port, or restart this replica once the "
                "network is back"
            )

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        self._server.stop(0).wait()


class HaReplica:
    """One coordinator replica (`--etcd`). `run()` blocks until `stop()` (exit 0), until it retires (exit 3), or
    until the leader refuses it as a standby for good (another task: exit 2); it returns 4 at once when it cannot
    serve on its address."""

    def __init__(self, cfg: CoordinatorServiceConfig, leadership: LeadershipConfig = LeadershipConfig()) -> None:
        etcd = cfg.etcd_config()
        assert etcd is not None, "HaReplica needs cfg.etcd"
        if cfg.port == 0:
            cfg = replace(cfg, port=free_port(cfg.host))
        self.cfg = cfg
        self.address = f"{cfg.host}:{cfg.port}"
        self.replica_id = cfg.replica_id or f"coordinator-{socket.gethostname()}-{cfg.port}"
        # here, not at the top: a coordinator without --etcd never loads the etcd client (requests, etcd3gw)
        from diloco.ha.driver import LeadershipDriver
        from diloco.ha.etcd import EtcdElection

        election = EtcdElection(etcd)
        self.driver = LeadershipDriver(self.replica_id, self.address, election, leadership)
        self.server: CoordinatorServer | None = None
        self.promoted_at: float | None = None  # monotonic time of the promotion (None: never led)
        self._announcer: LeaderAnnouncer | None = None  # tells healthd this replica leads (with --healthd-address)
        self._follower: StandbyFollower | None = None
        self._channel: grpc.Channel | None = None
        self._following = ""
        self._standin: NotLeaderServer | None = None
        self._metrics_http: Any = None  # the metrics port's HTTP server (None: no --metrics-port)
        self.served_metrics: ServedMetrics | None = None  # the registry served there and the port bound
        self._counts_lock = threading.Lock()  # `_follower` and the counts of the followers before it
        self._counted = (0, 0)  # snapshots and resyncs of the followers stopped so far
        self._stop = threading.Event()
        self._step_down_call = threading.Lock()  # one step-down at a time
        self._stepping_down = threading.Event()  # a step-down call is running: the replica does not retire yet
        self._handing_over = threading.Event()  # a step-down fences the leader (it accepts nothing)
        self.stepped_down = False  # leadership was handed over on request: the process exits 0
        self.in_step = False  # a leader accepted this standby's acknowledgement of a version it applied
        self.log = logging.get("coordinator", role="replica", replica_id=self.replica_id)

    def stop(self) -> None:
        self._stop.set()

    def role(self) -> ReplicaRole:
        if self.server is not None:
            return ReplicaRole.LEADER
        return ReplicaRole.STANDBY if self._follower is not None else ReplicaRole.CANDIDATE

    def _standby_view(self) -> StandbyView | None:
        follower = self._follower
        return follower.view() if follower is not None else None

    def _standby_counts(self) -> tuple[int, int]:
        with self._counts_lock:
            (snapshots, resyncs), follower = self._counted, self._follower
        if follower is not None:
            snapshots, resyncs = snapshots + follower.snapshots, resyncs + follower.resyncs
        return snapshots, resyncs

    def _serve_metrics(self) -> None:
        """Bind `--metrics-port` (if given) for the whole life of the replica (module docstring)."""
        registry = CollectorRegistry()
        registry.register(ReplicaCollector(self.role, self._standby_view, self._standby_counts))
        server, port = serve_metrics(registry, self.cfg.host, self.cfg.metrics_port)
        if server is not None:
            self._metrics_http, self.served_metrics = server, ServedMetrics(registry, port)

    def _stop_metrics(self) -> None:
        server, self._metrics_http = self._metrics_http, None
        if server is not None:
            server.shutdown()
            server.server_close()

    def hint(self) -> str:
        leader = self.driver.view().leader
        return leader.address if leader is not None and leader.address != self.address else ""

    def fence(self) -> None:
        """Raise NotLeader unless this replica may accept work now (the state's `fence`)."""
        if self._handing_over.is_set() or not self.driver.may_accept():
            raise not_leader(self.hint())

    def run(self) -> int:
        try:
            self._serve_metrics()
            self._standin = NotLeaderServer(self.cfg, self.hint)
        except OSError as e:  # before anything started: one line saying what to do, no traceback
            self._stop_metrics()
            self.log.error(
                "replica.bind_failed", address=self.address, metrics_port=self.cfg.metrics_port, error=str(e)
            )
            return EXIT_UNBOUND
        self._standin.start()
        warm_up(self.cfg.codec, self.cfg.broadcast_codec)  # while it follows: its first round as leader needs them
        self.driver.start()
        port = self.served_metrics.port if self.served_metrics is not None else -1
        self.log.info("replica.started", address=self.address, etcd=self.cfg.etcd, metrics_port=port)
        code = 0
        try:
            while not self._stop.wait(POLL_S):
                follower = self._follower
                if follower is not None and follower.failed:  # the leader refused it for good (another task)
                    self.log.error("replica.refused", leader=self._following, error=follower.failed)
                    code = EXIT_REFUSED
                    break
                view = self.driver.view()
                d = duty(view, self.server is not None)
                if self._stepping_down.is_set():
                    continue  # the step-down answers its caller before this replica stops serving
                if self.stepped_down:
                    self.log.info("replica.stepped_down", epoch=view.epoch, leader=self.hint() or None)
                    break
                if d is Duty.RETIRE:
                    self.log.warning("replica.retiring", role=view.role.value, epoch=view.epoch)
                    code = EXIT_RETIRED
                    break
                if d is Duty.SERVE and self.server is None:
                    self._promote(view.epoch)
                elif d is Duty.FOLLOW and view.leader is not None and view.leader.address != self._following:
                    self._follow(view.leader.address)
        finally:
            self._shutdown(RETIRE_GRACE_S if code == EXIT_RETIRED else None)
        return code

    # --- duties ---------------------------------------------------------------------------------------------
    def _follow(self, address: str) -> None:
        self._stop_follower()
        cfg = replace(self.cfg, etcd="", etcd_ca_file="", etcd_cert_file="", etcd_key_file="")  # a --follow standby
        follower, chan = follower_from(replace(cfg, follow=address, replica_id=self.replica_id))
        follower.on_version = self.driver.hold  # what it tells the other replicas it holds (the newest wins)
        follower.on_acked = self._acked  # in step with a leader: may take over
        self._follower, self._channel, self._following = follower, chan, address
        follower.start()
        self.log.info("replica.following", leader=address)

    def _acked(self, version: int) -> None:
        """The leader accepted this standby's acknowledgement of `version`: in step with it (it may take over at
        once, and keeps the learner table when it does)."""
        self.in_step = True
        self.driver.caught_up()

    def _promote(self, epoch: int) -> None:
        started = time.monotonic()
        held = self._stop_follower()
        if self._standin is not None:
            self._standin.stop()
            self._standin = None
        server = CoordinatorServer(
            self.cfg,
            epoch=epoch,
            fence=self.fence,
            leadership=self.driver.view,
            step_down=self.step_down,
            # a standby a leader vouched for holds its learner table: those learners need not register again
            adopt_learners=held is not None and self.in_step,
            served_metrics=self.served_metrics,  # the same port goes on, now with the leader's metrics too
        )
        server.start()
        self.server, self.promoted_at = server, time.monotonic()
        if self.cfg.healthd_address:
            self._announcer = LeaderAnnouncer(
                self.cfg.healthd_address, self.cfg.security, epoch, self.address, self.log
            )
            self._announcer.start()
        self.log.info(
            "replica.promoted",
            epoch=epoch,
            version=server.core.version,
            learners=len(server.core.adopted),
            standby_version=held,
            address=server.address,
            seconds=round(self.promoted_at - started, 3),
        )

    def step_down(self, reason: str) -> Handover:
        """Hand leadership to a standby (module docstring); blocks for up to the replica ack timeout plus
        `SUCCESSOR_WAIT_S`. NotLeader when this replica does not lead; FailedPrecondition when no standby could
        take over (nothing changed: it goes on leading)."""
        if not self._step_down_call.acquire(blocking=False):
            raise FailedPrecondition("a step-down is already in progress; `diloco ctl status` shows who leads")
        self._stepping_down.set()
        try:
            self.fence()
            server = self.server
            log = server.replication if server is not None else None
            if server is None or log is None:
                raise not_leader(self.hint())
            if not log.replicas():
                raise FailedPrecondition(NO_STANDBY)
            epoch = self.driver.view().epoch
            version, held = self._catch_up(server, log)
            self.stepped_down = True
            self.driver.step_down(f"step-down: {reason}")
            successor = self._successor(epoch)
            self.log.info(
                "replica.handed_over",
                version=version,
                held_by=list(held),
                successor=successor.replica_id if successor else None,
                reason=reason,
            )
            return Handover(version, held, successor)
        finally:
            self._stepping_down.clear()
            self._step_down_call.release()

    def _catch_up(self, server: CoordinatorServer, log: ReplicationLog) -> tuple[int, tuple[str, ...]]:
        """Fence this leader, wait until a standby holds its newest version and write a final checkpoint; on
        failure the fence is lifted and FailedPrecondition raised. The fence is set holding the state's `work` lock,
        under which a round closes, steps and publishes: no round is between its checks then, so none is left
        stepped but unpublished, and none closes after."""
        with server.state.work:
            self._handing_over.set()
            version = log.newest
        wait_s = self.cfg.replica_ack_timeout_s
        try:
            held = log.wait_held(version, wait_s)
            if not held:
                behind = ", ".join(f"{r.replica_id} lag {r.lag}" for r in log.replicas()) or "none follows now"
                raise FailedPrecondition(
                    f"no standby acknowledged version {version} within {wait_s:g} s ({behind}); this replica goes on "
                    "leading; step down again once `diloco ctl status` shows a replica with lag 0"
                )
            server.checkpoint_now()
        except BaseException:
            self._handing_over.clear()
            raise
        return version, held

    def _successor(self, epoch: int) -> LeaderInfo | None:
        """The replica leading after `epoch`, once this replica's driver has seen it (None: not within
        `SUCCESSOR_WAIT_S`)."""
        deadline = time.monotonic() + SUCCESSOR_WAIT_S
        while time.monotonic() < deadline:
            leader = self.driver.view().leader
            if leader is not None and leader.replica_id != self.replica_id and leader.epoch > epoch:
                return leader
            if self._stop.wait(POLL_S):
                break
        return None

    def _stop_follower(self) -> int | None:
        """Stop following; write what the standby holds as a checkpoint (the server resumes from it). Returns the
        version it held."""
        follower, chan = self._follower, self._channel
        if follower is None:
            return None
        follower.stop()
        with self._counts_lock:  # its counts move to the totals as it goes (a counter never goes down)
            snapshots, resyncs = self._counted
            self._counted = (snapshots + follower.snapshots, resyncs + follower.resyncs)
            self._follower, self._channel, self._following = None, None, ""
        if chan is not None:
            chan.close()
        version = follower.version
        if version is not None:
            stale = checkpoint.discard_after(self.cfg.checkpoint_dir, version)
            # written unless the follower wrote this version itself: a file of that version from anywhere else may
            # be another history's (and a model-sized write is time the takeover waits for)
            if follower.written != version:
                checkpoint.save(self.cfg.checkpoint_dir, follower.standby.core_snapshot, keep=self.cfg.keep_checkpoints)
            if stale:
                self.log.warning("replica.checkpoints_discarded", version=version, paths=[str(p) for p in stale])
        return version

    def _shutdown(self, grace_s: float | None) -> None:
        """Stop serving (draining for `grace_s`; None: the configured grace), stop following, give the key back."""
        if self._announcer is not None:
            self._announcer.stop()
        if self.server is not None:
            self.server.stop(grace_s)
        self._stop_follower()
        if self._standin is not None:
            self._standin.stop()
            self._standin = None
        self.driver.stop(resign=True)  # gives the key back only if it is still ours
        self._stop_metrics()
