"""Fixtures of the container chaos suite: the Docker engine, the image, a fault-free baseline run (once per session)
and the summary table printed at the end of the session and written to `chaos-report.md` in pytest's base temp
folder (and to $DILOCO_CHAOS_REPORT when set).

Without a reachable engine or without the image, every chaos test is skipped with the reason; with
DILOCO_CHAOS_REQUIRE=1 (CI) that is a failure instead, so a broken setup can never pass silently.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.harness import (
    IMAGE,
    RESULTS,
    SESSION,
    SESSION_LABEL,
    ChaosConfig,
    DockerCluster,
    ScenarioResult,
    finish_and_check,
    remove_labelled,
    render_table,
    unavailable,
)


@pytest.fixture(scope="session")
def docker_client() -> Iterator[Any]:
    try:
        from docker.errors import DockerException

        import docker
    except ImportError as e:
        unavailable(f"chaos tests need the docker SDK for Python (pip install docker): {e}")
    try:
        client = docker.from_env(timeout=60)
        client.ping()
    except DockerException as e:
        unavailable(f"no Docker engine reachable ({e}); start one with scripts/start_docker.sh")
    try:
        client.images.get(IMAGE)
    except DockerException:
        unavailable(f"image {IMAGE} not found; build it with scripts/build_images.sh (or docker compose build)")
    try:
        yield client
    finally:
        remove_labelled(client, {SESSION_LABEL: SESSION})  # whatever a failed test left behind
        client.close()


def logs_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(tmp_path_factory.getbasetemp()) / "chaos-logs"


@pytest.fixture(scope="session")
def chaos_config(docker_client: Any) -> ChaosConfig:
    return ChaosConfig(image=IMAGE, session=SESSION)


@pytest.fixture
def make_cluster(
    docker_client: Any, chaos_config: ChaosConfig, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., DockerCluster]]:
    """`make_cluster(name, **overrides)` starts a cluster (a `DockerCluster`, or the subclass `kind`, e.g.
    `HaDockerCluster`); every one is torn down after the test, pass or fail, its containers' logs kept in pytest's
    base temp folder under `chaos-logs/`."""
    made: list[DockerCluster] = []

    def make(name: str, kind: type[DockerCluster] = DockerCluster, **overrides: Any) -> DockerCluster:
        cfg = ChaosConfig(**{**chaos_config.__dict__, **overrides})
        cluster = kind(docker_client, cfg, name)
        made.append(cluster)
        cluster.start()
        return cluster

    yield make
    for cluster in made:
        try:
            cluster.save_logs(logs_folder(tmp_path_factory))
        finally:
            cluster.stop()


@pytest.fixture(scope="session")
def baseline(docker_client: Any, chaos_config: ChaosConfig, tmp_path_factory: pytest.TempPathFactory) -> ScenarioResult:
    """One fault-free run of the same configuration and length, for the loss and goodput comparisons."""
    cluster = DockerCluster(docker_client, chaos_config, "baseline")
    try:
        cluster.start()
        result = finish_and_check(cluster, ScenarioResult("baseline", "none"), None)
    finally:
        try:
            cluster.save_logs(logs_folder(tmp_path_factory))
        finally:
            cluster.stop()
    RESULTS.insert(0, result)
    return result


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if not RESULTS:
        return
    table = render_table(RESULTS)
    terminalreporter.section("chaos summary")
    terminalreporter.write_line(table)
    paths = [Path(config._tmp_path_factory.getbasetemp()) / "chaos-report.md"]  # type: ignore[attr-defined]
    if os.environ.get("DILOCO_CHAOS_REPORT"):
        paths.append(Path(os.environ["DILOCO_CHAOS_REPORT"]))
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# Chaos suite\n\nimage: {IMAGE}\n\n{table}\n")
        terminalreporter.write_line(f"chaos report written to {path}")
