"""Coordinator failover in containers (issue #14): etcd, two coordinator replicas under its leadership (`--etcd`,
`--sync-replicas 1`), healthd and 3 learners given both replicas' addresses (`HaDockerCluster`).

- kill-leader: `docker kill` the leading replica while training runs; the standby takes over under a higher epoch,
  the learners move to it, the job finishes there. The killed replica is started again and comes back as a standby.
- partition-leader: `docker network disconnect` the leader: it keeps running but reaches neither etcd nor anyone
  else. It must stop accepting (fenced by its lease) and retire (exit 3, restarted by its `on-failure` policy);
  the standby takes over and training goes on. The cut lasts until the old leader was restarted (still cut off);
  reconnected, it comes back as a standby of the new leader.

Both end with the invariants of every chaos scenario (`finish_and_check`: the job finishes, the exactly-once
ledger, no unexplained error line, the final loss against the fault-free baseline) and the failover's own
(`check_failover`): no learner received a version that went backwards, no version a learner received before the
fault is missing from the new leader's history (`--sync-replicas 1`), GetStatus never went backwards within an
epoch, and never two leaders accepting at once: by the replicas' logs, the old term's last accepted work (a
registration, a submission, a round) precedes the new leader's promotion, under a higher epoch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from diloco.cluster import wait_for
from tests.chaos.ha_cluster import (
    ETCD_IMAGE,
    REPLICAS,
    HaDockerCluster,
    backwards,
    leadership_terms,
    overlapping_terms,
    received_versions,
)
from tests.chaos.harness import RESULTS, DockerCluster, ScenarioResult, finish_and_check, unavailable

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(420)]  # the first to run also runs the baseline

TAKEOVER_S = 10.0  # the bound: fault -> first round committed by the new leader
REJOIN_S = 90.0  # reconnected (or started again) -> following the new leader
EXIT_RETIRED = 3  # a replica that led and lost leadership exits with it (services/coordinator/ha.py)

MakeCluster = Callable[..., DockerCluster]


@pytest.fixture
def make_ha(docker_client: Any, make_cluster: MakeCluster) -> Callable[[str], HaDockerCluster]:
    try:
        docker_client.images.get(ETCD_IMAGE)
    except Exception:
        unavailable(
            f"etcd image {ETCD_IMAGE} not found; build it with scripts/build_images.sh (offline), or pull a public "
            "one and name it in DILOCO_ETCD_IMAGE (e.g. gcr.io/etcd-development/etcd:v3.5.17)"
        )

    def make(name: str) -> HaDockerCluster:
        cluster = make_cluster(name, kind=HaDockerCluster)
        assert isinstance(cluster, HaDockerCluster)
        return cluster

    return make


def test_leader_container_killed(make_ha: Callable[[str], HaDockerCluster], baseline: ScenarioResult) -> None:
    c = make_ha("ha-kill-leader")
    c.wait_version(5, timeout_s=90)
    old = c.leader()
    new = other(old)
    epoch_before = c.status().coordinator_epoch
    fault = time.time()
    c.kill(old)
    promoted, first_round = takeover(c, new, fault)
    c.containers[old].reload()
    restarted = fault  # where to look for it following the new leader from
    if c.containers[old].status != "running":  # docker kill is a manual stop: no restart policy brings it back
        restarted = time.time()
        c.restart(old)
    rejoined = rejoin(c, old, new, restarted)
    result = ScenarioResult(
        "ha-kill-leader",
        f"docker kill the leading replica ({old}), then start it again",
        recovery_s=[first_round["unix_s"] - fault],
        notes=(
            f"{new} promoted {promoted['unix_s'] - fault:.2f} s after the kill (epoch {epoch_before} -> "
            f"{promoted['epoch']}, at v{promoted['version']}); {old} following again {rejoined:.1f} s after its start"
        ),
    )
    RESULTS.append(result)
    finish_and_check(c, result, baseline, allowed_errors=FAILOVER_ERRORS)
    check_failover(c, fault, promoted, epoch_before)
    assert result.recovery_s[0] < TAKEOVER_S, f"first round at the new leader {result.recovery_s[0]:.2f} s after"


def test_leader_cut_off_the_network(make_ha: Callable[[str], HaDockerCluster], baseline: ScenarioResult) -> None:
    c = make_ha("ha-partition-leader")
    c.wait_version(5, timeout_s=90)
    old = c.leader()
    new = other(old)
    epoch_before = c.status().coordinator_epoch
    fault = time.time()
    c.disconnect(old)
    try:
        retired = c.wait_event(old, "replica.retiring", timeout_s=30, since_unix_s=fault)
        promoted, first_round = takeover(c, new, fault)
        version = c.status().version
        c.wait_version(version + 2, timeout_s=60)  # training goes on without it
        # its supervisor (the restart policy) starts it again while it is still cut off
        exit_code, exited = wait_restarted(c, old, timeout_s=90, since=fault)
    finally:
        reconnected = time.time()
        c.connect(old)
    rejoined = rejoin(c, old, new, reconnected)
    result = ScenarioResult(
        "ha-partition-leader",
        f"docker network disconnect the leading replica ({old}) ~{reconnected - fault:.0f} s, reconnect it",
        recovery_s=[first_round["unix_s"] - fault],
        notes=(
            f"{old} fenced and retiring {retired['unix_s'] - fault:.2f} s after the cut, exit {exit_code} at "
            f"{exited - fault:.0f} s; {new} promoted {promoted['unix_s'] - fault:.2f} s after (epoch {epoch_before} "
            f"-> {promoted['epoch']}); {old} following again {rejoined:.1f} s after reconnection"
        ),
    )
    RESULTS.append(result)
    assert exit_code == EXIT_RETIRED, f"{old} exited {exit_code}, not {EXIT_RETIRED} (retired):\n{c.logs(old, 30)}"
    # Restarted with no network, the replica cannot bind its address (its name does not resolve) and exits 4 with
    # one error line (`replica.bind_failed`), until it is reconnected: the fault explains it.
    unbindable = {old: {f"Failed to bind to address {c.cname(old)}:"}}
    explained = {**FAILOVER_ERRORS, old: {"replica.bind_failed"}}
    finish_and_check(c, result, baseline, allowed_errors=explained, allowed_tracebacks=unbindable)
    check_failover(c, fault, promoted, epoch_before)
    assert result.recovery_s[0] < TAKEOVER_S, f"first round at the new leader {result.recovery_s[0]:.2f} s after"


# Error-level lines a failover explains: none today (the list is here so that a new one is a decision).
FAILOVER_ERRORS: dict[str, set[str]] = {}


# --- helpers ---------------------------------------------------------------------------------------------------
def other(role: str) -> str:
    return next(r for r in REPLICAS if r != role)


def takeover(c: HaDockerCluster, new: str, fault: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """Wait for `new` to be promoted after `fault` (unix s) and to close its first round; returns both log lines."""
    promoted = c.wait_event(new, "replica.promoted", timeout_s=30, since_unix_s=fault)
    first_round = c.wait_event(new, "round.closed", timeout_s=60, since_unix_s=promoted["unix_s"])
    return promoted, first_round


def wait_restarted(c: HaDockerCluster, role: str, timeout_s: float, since: float) -> tuple[int, float]:
    """Wait until container `role` exited and its restart policy started it again; returns the exit status of its
    first exit since `since` and when that was seen (unix s). The status comes from Docker's `die` event: the
    container's State.ExitCode is reset once the restarted process runs, so reading it then raced the restart."""

    def restarted() -> tuple[int, float] | None:
        container = c.containers[role]
        container.reload()
        if int(container.attrs.get("RestartCount", 0)) < 1:
            return None
        events = container.client.api.events(
            since=int(since),
            until=int(time.time()) + 1,
            filters={"container": container.id, "event": "die"},
            decode=True,
        )
        codes = [int(e["Actor"]["Attributes"]["exitCode"]) for e in events]
        return (codes[0], time.time()) if codes else None

    return wait_for(f"{role} to exit and be restarted", restarted, timeout_s, interval_s=0.1)


def rejoin(c: HaDockerCluster, old: str, new: str, since: float) -> float:
    """Seconds from `since` until the old leader follows `new` again and `new` streams it the round log."""
    c.wait_event(old, "replica.following", timeout_s=REJOIN_S, since_unix_s=since)
    joined = wait_follower(c, new, old, since)
    return float(joined["unix_s"] - since)


def wait_follower(c: HaDockerCluster, leader: str, replica: str, since: float) -> dict[str, Any]:
    def joined() -> dict[str, Any] | None:
        found = [e for e in c.events(leader, "replication.follower_joined", since) if e["replica_id"] == replica]
        return found[0] if found else None

    return wait_for(f"{leader} to stream its log to {replica}", joined, REJOIN_S, interval_s=0.2)


def check_failover(c: HaDockerCluster, fault: float, promoted: dict[str, Any], epoch_before: int) -> None:
    """The failover's invariants (module docstring)."""
    assert int(promoted["epoch"]) > epoch_before, f"new epoch {promoted['epoch']} is not above {epoch_before}"
    terms = [t for role in REPLICAS for t in leadership_terms(role, c.logs(role))]
    assert len(terms) >= 2, f"expected two leadership terms at least: {terms}"
    problems = overlapping_terms(terms)
    assert not problems, "two leaders accepting at once: " + "; ".join(problems)
    before_fault = 0
    for name in c.worker_names:
        log = c.logs(name)
        seen = received_versions(log)
        assert not backwards(seen), f"{name} received versions that went backwards: {backwards(seen)}"
        before_fault = max([before_fault, *received_versions(log, before_unix_s=fault)])
    assert int(promoted["version"]) >= before_fault, (
        f"the new leader resumed at v{promoted['version']}, below v{before_fault} that a learner had received"
    )
    by_epoch: dict[int, list[int]] = {}
    for _, epoch, version in c.seen:
        by_epoch.setdefault(epoch, []).append(version)
    for epoch, versions in by_epoch.items():
        assert not backwards(versions), f"GetStatus went backwards in epoch {epoch}: {backwards(versions)}"
