"""docker-compose.yml as a user runs it: `up` issues certificates and tokens (the `certs` service), trains the
embedded default task over mutual TLS, and `diloco ctl` works both as the README says (`docker compose run --rm ctl
...` inside the network, and from the host with the admin identity copied out of its volume); a bad configuration
makes its container exit with status 2 and a message naming the setting, and after `restart: on-failure:3` gives
up, `ps` shows it exited rather than restarting forever.

Each test uses a compose project of its own (unique name, free host ports) and removes it, volumes included."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from diloco.cluster import ledger_json_shards, ledger_problems
from tests.chaos.ha_cluster import ETCD_IMAGE
from tests.chaos.harness import (
    IMAGE,
    UNTRAINED_LOSS,
    remove_labelled,
    unavailable,
)
from tests.support import wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
HA_COMPOSE_FILE = ROOT / "docker-compose.ha.yml"
CTL = [sys.executable, "-m", "diloco.cli.main", "ctl"]  # `diloco ctl` on the host


def compose_command() -> list[str] | None:
    """`docker compose` (v2 plugin) where it exists, else the v1 `docker-compose`."""
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, check=False)
        if probe.returncode == 0:
            return ["docker", "compose"]
    path = shutil.which("docker-compose")
    return [path] if path else None


class Project:
    def __init__(self, client: Any, name: str, env: dict[str, str], file: Path = COMPOSE_FILE) -> None:
        cmd = compose_command()
        if cmd is None:
            unavailable("neither `docker compose` nor `docker-compose` is installed (scripts/start_docker.sh)")
        assert cmd is not None
        self.client = client
        self.name = f"diloco-chaos-{name}-{uuid.uuid4().hex[:8]}"
        self.cmd = [*cmd, "-f", str(file), "-p", self.name]
        # the host's DILOCO_* settings must not leak into the project: only ours
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
        self.env.update(
            DILOCO_IMAGE=IMAGE,
            DILOCO_PUBLISH_ADDRESS="127.0.0.1",
            # empty: docker picks a free host port for each (no port picked here that another process could take)
            DILOCO_COORDINATOR_HOST_PORT="",
            DILOCO_HEALTHD_HOST_PORT="",
            DILOCO_COORDINATOR_METRICS_HOST_PORT="",
            DILOCO_COORDINATOR_BULK_HOST_PORT="",
            DILOCO_HEALTHD_METRICS_HOST_PORT="",
            # docker-compose.ha.yml's replicas
            DILOCO_COORDINATOR_A_HOST_PORT="",
            DILOCO_COORDINATOR_A_METRICS_HOST_PORT="",
            DILOCO_COORDINATOR_B_HOST_PORT="",
            DILOCO_COORDINATOR_B_METRICS_HOST_PORT="",
            DILOCO_ETCD_IMAGE=ETCD_IMAGE,
            **env,
        )

    def run(self, *args: str, check: bool = True, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [*self.cmd, *args], env=self.env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def host_port(self, service: str, port: int) -> int:
        """The host port docker published `service`'s container `port` on (asked each time: a container that
        restarted may have been given another). Fails with `Unreachable` while there is none."""
        proc = self.run("port", service, str(port), check=False, timeout_s=30)
        found = re.search(r":(\d+)\s*$", proc.stdout)
        if proc.returncode != 0 or not found:
            raise Unreachable(f"no host port for {service}:{port} yet: {proc.stdout.strip()} {proc.stderr.strip()}")
        return int(found.group(1))

    @property
    def coordinator_port(self) -> int:
        return self.host_port("coordinator", 50051)

    def copy_admin_tls(self, dest: Path) -> Path:
        """The README's way to reach the cluster from the host: the admin identity out of the `ctl` volume."""
        proc = subprocess.run(
            [*self.cmd, "run", "--rm", "-T", "--entrypoint", "tar", "ctl", "-C", "/certs", "-cf", "-", "."],
            env=self.env,
            capture_output=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr.decode(errors="replace")
        dest.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as tar:
            tar.extractall(dest, filter="data")
        return dest

    def container(self, service: str) -> Any:
        found = self.client.containers.list(
            all=True,
            filters={"label": [f"com.docker.compose.project={self.name}", f"com.docker.compose.service={service}"]},
        )
        assert found, f"no container for {service}"
        return found[0]

    def down(self) -> None:
        self.run("down", "--volumes", "--remove-orphans", "--timeout", "5", check=False)
        remove_labelled(self.client, {"com.docker.compose.project": self.name})


@pytest.fixture
def project(docker_client: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """`project(name, file=..., **env)`: a compose project, brought down after the test, its `logs` kept in pytest's
    base temp folder (chaos-logs/<project>.log), pass or fail."""
    made: list[Project] = []

    def make(name: str, file: Path = COMPOSE_FILE, **env: str) -> Project:
        p = Project(docker_client, name, env, file)
        made.append(p)
        return p

    yield make
    logs = Path(tmp_path_factory.getbasetemp()) / "chaos-logs"
    for p in made:
        try:
            logs.mkdir(parents=True, exist_ok=True)
            (logs / f"{p.name}.log").write_text(p.run("logs", "--no-color", check=False).stdout)
        finally:
            p.down()


class Unreachable(AssertionError):
    """The coordinator cannot be reached right now (no published port yet, or `ctl` got a transient status: the
    server is starting, a TLS handshake failed under load): a wait asks again."""


TRANSIENT_CTL = re.compile(r": (UNAVAILABLE|DEADLINE_EXCEEDED): ")  # how `diloco ctl` reports a transient status


def reachable_yet(error: Exception) -> bool:
    """`wait_for`'s `retry_on`: an `Unreachable` coordinator is "not yet"."""
    return isinstance(error, Unreachable)


def ctl(port: int, tls_dir: Path, action: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """`diloco ctl --coordinator 127.0.0.1:PORT --tls-dir DIR --timeout-s T --json ACTION`, run from the host as a
    user would. A transient failure raises `Unreachable`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    where = ["--coordinator", f"127.0.0.1:{port}", "--tls-dir", str(tls_dir), "--timeout-s", str(timeout_s)]
    proc = subprocess.run(
        [*CTL, *where, "--json", action],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env=env,
    )
    if proc.returncode != 0 and TRANSIENT_CTL.search(proc.stderr):
        raise Unreachable(f"ctl {action} exited {proc.returncode}: {proc.stderr.strip()}")
    assert proc.returncode == 0, f"ctl {action} exited {proc.returncode}: {proc.stderr}"
    reply: dict[str, Any] = json.loads(proc.stdout)
    return reply


def test_compose_up_trains_the_default_task(project: Any, tmp_path: Path) -> None:
    p = project("up", DILOCO_TARGET_OUTER_STEPS="6", DILOCO_CHECKPOINT_EVERY="2")
    p.run("up", "-d", "--scale", "worker=1")
    tls = p.copy_admin_tls(tmp_path / "tls")
    assert sorted(f.name for f in tls.iterdir()) == ["admin.key", "admin.pem", "admin.token", "ca.pem"]
    wait_for("training to finish", lambda: ctl(p.coordinator_port, tls, "status")["finished"], 240, 0.5, reachable_yet)
    status = ctl(p.coordinator_port, tls, "status")
    assert int(status["version"]) >= 6
    assert float(status["validation_loss"]) < UNTRAINED_LOSS, status  # it learned something
    ledger = ctl(p.coordinator_port, tls, "ledger")
    assert not ledger_problems(ledger_json_shards(ledger), int(ledger["tokens_applied"]))
    ps = p.run("ps").stdout
    assert re.search(r"coordinator.*healthy", ps), ps
    workers = {w["worker_name"] for w in ctl(p.coordinator_port, tls, "workers")["workers"]}
    assert "worker-slow" in workers and len(workers) == 2, workers
    # the README's command, inside the compose network
    inside = json.loads(p.run("run", "--rm", "-T", "ctl", "--json", "status").stdout)
    assert inside["finished"] and int(inside["version"]) == int(status["version"]), inside
    # what each role holds: its own identity and only the tokens it needs, unreadable to other users
    listing = p.run("run", "--rm", "-T", "--entrypoint", "ls", "worker", "-ln", "/certs").stdout
    assert sorted(line.split()[-1] for line in listing.splitlines()[1:]) == [
        "ca.pem",
        "join.token",
        "worker.key",
        "worker.pem",
    ], listing
    assert all(line.startswith("-rw-------") for line in listing.splitlines() if "worker.key" in line), listing
    # no way in without the cluster's CA: plaintext from the host is refused
    refused = subprocess.run(
        [*CTL, "--coordinator", f"127.0.0.1:{p.coordinator_port}", "--insecure", "--timeout-s", "3", "status"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert refused.returncode != 0, refused.stdout


def test_ha_compose_up_fails_over_and_the_old_leader_comes_back_as_a_standby(
    project: Any, docker_client: Any, tmp_path: Path
) -> None:
    """docker-compose.ha.yml as its header says: etcd and two replicas, one leads (the other's stand-in answers
    "not the leader"), `kill` the leader mid-run: the other leads under a higher epoch and the job finishes there
    with the ledger exactly once; `start` the killed one: the new leader's status lists it as a standby, both are
    healthy (a standby's NOT_SERVING is healthy for the container's HEALTHCHECK), and the `ctl` service, given both
    replicas, reaches the leader."""
    try:
        docker_client.images.get(ETCD_IMAGE)
    except Exception:
        unavailable(
            f"etcd image {ETCD_IMAGE} not found; build it with scripts/build_images.sh or set DILOCO_ETCD_IMAGE"
        )
    p = project(
        "ha-up",
        file=HA_COMPOSE_FILE,
        DILOCO_TARGET_OUTER_STEPS="16",
        DILOCO_CHECKPOINT_EVERY="2",
        DILOCO_LOCAL_STEPS="5",
        DILOCO_MIN_LOCAL_STEPS="2",
    )
    p.run("up", "-d", "--scale", "worker=1", timeout_s=240)
    tls = p.copy_admin_tls(tmp_path / "tls")
    replicas = ("coordinator-a", "coordinator-b")

    def leader() -> tuple[str, dict[str, Any]]:
        for name in replicas:
            try:  # from the host one replica at a time: the leader it names is not reachable by its name from here
                return name, ctl(p.host_port(name, 50051), tls, "status", timeout_s=3)
            except Unreachable:
                continue  # a standby refuses with UNAVAILABLE, naming the leader
        raise Unreachable("no replica leads yet")

    def leader_at(version: int) -> tuple[str, dict[str, Any]] | None:
        found = leader()
        return found if int(found[1]["version"]) >= version else None

    old, before = wait_for("a leader at version 3", lambda: leader_at(3), 240, 0.5, reachable_yet)
    new = next(r for r in replicas if r != old)
    assert before["ha"]["replica_id"] == old and before["ha"]["is_leader"], before["ha"]
    p.run("kill", old)

    def led_by_new() -> dict[str, Any] | None:
        name, status = leader()
        return status if name == new else None

    after = wait_for(f"{new} to lead", led_by_new, 60, 0.5, reachable_yet)
    assert int(after["coordinator_epoch"]) > int(before["coordinator_epoch"]), (before, after)
    assert int(after["ha"]["leader_epoch"]) == int(after["coordinator_epoch"]), after["ha"]
    assert int(after["version"]) >= int(before["version"]) - 1, (before, after)  # GetStatus may name an unpublished v
    p.run("start", old)
    port = p.host_port(new, 50051)
    wait_for("training to finish", lambda: ctl(port, tls, "status")["finished"], 240, 0.5, reachable_yet)
    ledger = ctl(port, tls, "ledger")
    assert not ledger_problems(ledger_json_shards(ledger), int(ledger["tokens_applied"]))

    def following() -> bool:
        standbys = ctl(port, tls, "status")["ha"].get("replicas", [])
        return any(r["replica_id"] == old for r in standbys)

    wait_for(f"{old} to follow {new} again", following, 90, 1, reachable_yet)
    inside = json.loads(p.run("run", "--rm", "-T", "ctl", "--json", "status").stdout)  # both addresses: the leader
    assert inside["ha"]["replica_id"] == new and inside["ha"]["is_leader"], inside["ha"]

    def both_healthy() -> bool:
        ps = p.run("ps").stdout
        return all(re.search(rf"{name}.*\(healthy\)", ps) for name in replicas)

    wait_for("both replicas healthy (leader and standby)", both_healthy, 60, 1)


BAD_CONFIGS = [
    ("coordinator", {"DILOCO_MODE": "bogus"}, "mode: unknown value 'bogus'"),
    ("coordinator", {"DILOCO_CODEC": "nope"}, "codec: unknown value 'nope'"),
    ("worker", {"DILOCO_COORDINATOR": ""}, "expected HOST:PORT"),
]


def test_bad_config_exits_with_a_clear_message(project: Any) -> None:
    """All three at once (each in its own project): each container exits 2 with the message, docker restarts it
    three times (`on-failure:3`), then it stays exited and `ps` says so."""
    started = []
    for i, (service, env, message) in enumerate(BAD_CONFIGS):
        p = project(f"bad{i}", **env)
        p.run("run", "--rm", "certs")  # the certificates exist, so only the bad setting can stop the service
        p.run("up", "-d", "--no-deps", service)
        started.append((p, service, message))
    for p, service, message in started:

        def gave_up(p: Project = p, service: str = service) -> bool:
            c = p.container(service)
            c.reload()
            return bool(c.status == "exited" and c.attrs["RestartCount"] >= 3)

        wait_for(f"{service} in {p.name} to exit for good", gave_up, timeout_s=120, interval_s=0.5)
        c = p.container(service)
        assert c.attrs["State"]["ExitCode"] == 2
        assert c.attrs["RestartCount"] == 3
        logs = c.logs().decode(errors="replace")
        assert "configuration error" in logs and message in logs, logs
        ps = p.run("ps", "-a").stdout
        line = next((ln for ln in ps.splitlines() if service in ln), "")
        assert re.search(r"exit(ed)?\s*\(?2\)?", line, re.IGNORECASE), ps
