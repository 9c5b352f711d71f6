"""The coordinator's Prometheus metrics, in a registry of their own (several servers may share a process)."""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:  # replication imports the state, which imports this module
    from services.coordinator.replication import HaView

_PREFIX = "diloco_coordinator_"


class CoordinatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self.rounds = Counter(_PREFIX + "rounds", "Outer steps applied", registry=r)
        self.version = Gauge(_PREFIX + "version", "Global parameter version", registry=r)
        self.live_workers = Gauge(_PREFIX + "live_workers", "Active or draining learners", registry=r)
        self.pending_submissions = Gauge(
            _PREFIX + "pending_submissions", "Accepted submissions waiting for their round", registry=r
        )
        self.round_staleness = Histogram(
            _PREFIX + "round_staleness",
            "Staleness (versions) of each applied submission",
            buckets=(0, 1, 2, 3, 4, 6, 8, 16),
            registry=r,
        )
        self.submission_tokens = Histogram(
            _PREFIX + "submission_tokens",
            "Tokens trained per accepted submission",
            buckets=(256, 1024, 4096, 16384, 65536, 262144, 1 << 20, 1 << 22, 1 << 24),
            registry=r,
        )
        self.pseudo_gradient_norm = Gauge(
            _PREFIX + "pseudo_gradient_norm", "L2 norm of the last merged pseudo-gradient", registry=r
        )
        self.upload_bytes = Counter(_PREFIX + "upload_bytes", "Pseudo-gradient payload bytes received", registry=r)
        self.download_bytes = Counter(_PREFIX + "download_bytes", "Parameter payload bytes sent", registry=r)
        self.upload_seconds = Histogram(
            _PREFIX + "upload_seconds",
            "From an upload's header to its acceptance",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=r,
        )
        self.rejected = Counter(
            _PREFIX + "rejected_submissions", "Refused submissions by reason", ["reason"], registry=r
        )
        self.reassignments = Counter(
            _PREFIX + "reassignments", "Shards moved off dead, departed or evicted learners", registry=r
        )
        self.validation_loss = Gauge(
            _PREFIX + "validation_loss", "Validation loss of the global parameters", registry=r
        )
        self.checkpoints = Counter(_PREFIX + "checkpoints", "Checkpoints written", registry=r)
        self.degraded_versions = Counter(
            _PREFIX + "degraded_versions",
            "Versions published without the standby acknowledgements --sync-replicas asks for",
            registry=r,
        )
        self.held_versions = Counter(
            _PREFIX + "held_versions",
            "Versions held back from learners until a standby acknowledged them (--when-no-standby wait)",
            registry=r,
        )
        self.held_seconds = Counter(
            _PREFIX + "held_seconds",
            "Seconds versions were held back from learners with too few standbys acknowledging (--when-no-standby "
            "wait), counted as they pass",
            registry=r,
        )
        self.holding = Gauge(
            _PREFIX + "holding", "1 while a version is held back waiting for a standby, else 0", registry=r
        )
        self.quarantines = Counter(
            _PREFIX + "quarantines", "Learners quarantined after a refused (outlier, non-finite) submission", registry=r
        )
        self.quarantined_workers = Gauge(_PREFIX + "quarantined_workers", "Learners in quarantine now", registry=r)
        self.uploads_evicted = Counter(
            _PREFIX + "uploads_evicted", "Interrupted uploads dropped to make room for new ones", registry=r
        )
        self.partial_uploads = Gauge(
            _PREFIX + "partial_uploads", "Uploads held: streaming, or interrupted and kept for a resume", registry=r
        )
        self.streaming_uploads = Gauge(_PREFIX + "streaming_uploads", "Uploads with a stream feeding them", registry=r)
        self.idle_upload_buffer_bytes = Gauge(
            _PREFIX + "idle_upload_buffer_bytes", "Upload buffers kept for the next uploads (bytes)", registry=r
        )
        # energy, carbon and cost (issue #15; services/coordinator/energy.py): per learner while the coordinator
        # holds its record (ListWorkers), and for the whole fleet since the run began (a resumed coordinator's start
        # from its checkpoint's totals: CoordinatorState)
        self.energy_joules = Counter(
            "diloco_energy_joules", "Energy a learner drew while working (watts x work seconds)", ["worker"], registry=r
        )
        self.carbon_grams = Counter(
            "diloco_carbon_grams", "Grams of CO2 of that energy at its zone's intensity", ["worker"], registry=r
        )
        self.cost = Counter("diloco_cost", "Price per hour x hours registered and not paused", ["worker"], registry=r)
        self.fleet_energy_joules = Counter("diloco_fleet_energy_joules", "Energy of every learner", registry=r)
        self.fleet_carbon_grams = Counter("diloco_fleet_carbon_grams", "Grams of CO2 of every learner", registry=r)
        self.fleet_cost = Counter("diloco_fleet_cost", "Cost of every learner", registry=r)
        self.worker_watts = Gauge(
            _PREFIX + "worker_watts", "A live learner's last reported watts while training", ["worker"], registry=r
        )
        self.placement_weight = Gauge(
            _PREFIX + "placement_weight", "A live learner's placement weight (0: paused)", ["worker"], registry=r
        )
        self.paused_workers = Gauge(_PREFIX + "paused_workers", "Live learners the placement policy paused", registry=r)
        self.placement_changes = Counter(
            _PREFIX + "placement_changes", "Times the placement policy changed the learners' weights", registry=r
        )
        self.carbon_intensity = Gauge(
            _PREFIX + "carbon_intensity", "A zone's carbon intensity (gCO2/kWh) from the provider", ["zone"], registry=r
        )
        self.carbon_provider_failures = Counter(
            _PREFIX + "carbon_provider_failures",
            "Carbon provider calls that raised, timed out, gave no value for their zone or no valid intensity, or "
            "were skipped while an earlier call still ran",
            ["reason"],
            registry=r,
        )
        self.carbon_fallbacks = Counter(
            _PREFIX + "carbon_fallbacks",
            "Carbon provider calls that gave a zone no good value, by what the zone fell back to: last_good (its last "
            "good value), trace (the carbon trace's) or unknown (the dirtiest known zone's, at least 1000 gCO2/kWh)",
            ["zone", "to"],
            registry=r,
        )
        self.validation_loss.set(float("nan"))

    def forget_worker(self, worker_id: str) -> None:
        """Drop a learner's series (its record is gone); the fleet totals keep what it used."""
        for metric in (self.energy_joules, self.carbon_grams, self.cost, self.worker_watts, self.placement_weight):
            with contextlib.suppress(KeyError):
                metric.remove(worker_id)


class HaCollector(Collector):
    """High availability at scrape time (docs/ha.md), from `view()` (None: nothing to show): `diloco_leader_epoch`,
    `diloco_is_leader` and `diloco_replica_lag_versions{replica=...}`, one series per standby following now (a
    standby that left has none); with a round log, `diloco_replication_log_bytes` (the entries' payload),
    `diloco_replication_log_max_bytes` (its cap, `--replication-log-bytes`) and `diloco_replication_log_entries`."""

    def __init__(self, view: Callable[[], HaView | None]) -> None:
        self._view = view

    def describe(self) -> Iterator[Metric]:
        return iter(self._families())

    def collect(self) -> Iterator[Metric]:
        epoch, leader, lag, log_bytes, log_max_bytes, log_entries = self._families()
        v = self._view()
        if v is None:
            return
        epoch.add_metric([], v.epoch)
        leader.add_metric([], 1.0 if v.is_leader else 0.0)
        for r in v.replicas:
            lag.add_metric([r.replica_id], r.lag)
        yield from (epoch, leader, lag)
        if v.log is not None:
            log_bytes.add_metric([], v.log.bytes)
            log_entries.add_metric([], v.log.entries)
            yield from (log_bytes, log_entries)
            if v.log.max_bytes is not None:
                log_max_bytes.add_metric([], v.log.max_bytes)
                yield log_max_bytes

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, ...]:
        return (
            GaugeMetricFamily(
                "diloco_leader_epoch", "Leadership epoch (the etcd key's creation revision; 0: no --etcd)"
            ),
            GaugeMetricFamily("diloco_is_leader", "1 while this coordinator replica holds leadership, else 0"),
            GaugeMetricFamily(
                "diloco_replica_lag_versions",
                "Versions a standby following the round log is behind its newest entry",
                labels=["replica"],
            ),
            GaugeMetricFamily(
                "diloco_replication_log_bytes", "Payload bytes (each entry's Δ and bookkeeping) the round log holds"
            ),
            GaugeMetricFamily(
                "diloco_replication_log_max_bytes",
                "The round log's byte cap (--replication-log-bytes; default: the bytes of a snapshot's tensors)",
            ),
            GaugeMetricFamily("diloco_replication_log_entries", "Entries the round log holds"),
        )


class ReplicaRole(enum.Enum):
    """What a coordinator replica does now, as its metrics say it (`diloco_replica_role{role=...}`)."""

    LEADER = "leader"  # it serves learners
    STANDBY = "standby"  # it follows a leader's round log
    CANDIDATE = "candidate"  # neither: no leader is known yet (it campaigns), or it is between two leaders


@dataclass(frozen=True)
class StandbyView:
    """A standby as its own metrics show it: the version it applied (None: none yet), the newest version its leader
    had appended when it last answered an acknowledgement (None: not known yet), the epoch of the log it follows,
    and the snapshots it loaded and resyncs it asked for, since the process started."""

    version: int | None
    leader_version: int | None
    epoch: int
    snapshots: int
    resyncs: int


class ReplicaCollector(Collector):
    """A replica's own series at scrape time, served from the replica's metrics port whatever it does: its role
    (`diloco_replica_role{role=...}`, 1 for the current one, 0 for the others) and, from `standby()` (None: not
    following now), `diloco_standby_version`, `diloco_standby_lag_versions` (versions behind the leader, once the
    leader said its newest), `diloco_standby_epoch`, `diloco_standby_snapshots_total` and
    `diloco_standby_resyncs_total` (those two also after a promotion: they never go down)."""

    def __init__(
        self,
        role: Callable[[], ReplicaRole],
        standby: Callable[[], StandbyView | None],
        counts: Callable[[], tuple[int, int]],
    ) -> None:
        """`counts()`: (snapshots, resyncs) since the process started, also while not following."""
        self._role = role
        self._standby = standby
        self._counts = counts

    def describe(self) -> Iterator[Metric]:
        return iter(self._families())

    def collect(self) -> Iterator[Metric]:
        role, version, lag, epoch, snapshots, resyncs = self._families()
        now = self._role()
        for r in ReplicaRole:
            role.add_metric([r.value], 1.0 if r is now else 0.0)
        taken, asked = self._counts()
        snapshots.add_metric([], taken)
        resyncs.add_metric([], asked)
        yield from (role, snapshots, resyncs)
        v = self._standby()
        if v is None:
            return
        epoch.add_metric([], v.epoch)
        yield epoch
        if v.version is None:
            return
        version.add_metric([], v.version)
        yield version
        if v.leader_version is not None:
            lag.add_metric([], max(0, v.leader_version - v.version))
            yield lag

    @staticmethod
    def _families() -> tuple[
        GaugeMetricFamily,
        GaugeMetricFamily,
        GaugeMetricFamily,
        GaugeMetricFamily,
        CounterMetricFamily,
        CounterMetricFamily,
    ]:
        return (
            GaugeMetricFamily(
                "diloco_replica_role", "1 for what this coordinator replica does now, else 0", labels=["role"]
            ),
            GaugeMetricFamily("diloco_standby_version", "The version this standby applied (its leader's state)"),
            GaugeMetricFamily(
                "diloco_standby_lag_versions",
                "Versions this standby is behind its leader's newest (as the leader last answered an acknowledgement)",
            ),
            GaugeMetricFamily("diloco_standby_epoch", "The coordinator epoch of the round log this standby follows"),
            CounterMetricFamily("diloco_standby_snapshots", "Snapshots this replica loaded from a leader"),
            CounterMetricFamily(
                "diloco_standby_resyncs", "Times this replica refused an entry and asked its leader for a snapshot"
            ),
        )
