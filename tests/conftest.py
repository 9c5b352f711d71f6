"""Shared fixtures: one torch thread per test process, an in-process coordinator on port 0, and a real etcd
(diloco/ha/etcd_server.py): one member in plain HTTP, one over https, or a cluster of three over https. Shared helpers
live in tests/support.py."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from diloco.ha.etcd_server import EtcdCluster, EtcdServer, ServerTls, etcd_binary
from diloco.rpc.server import channel
from diloco.rpc.tls import write_bundle
from diloco.task.params import param_specs
from diloco.v1 import coordinator_pb2_grpc
from services.coordinator.config import CoordinatorServiceConfig
from services.coordinator.server import CoordinatorServer
from tests.support import Env, config, tiny_task


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread() -> Iterator[None]:
    """Two torch threads on a 2-core machine contend badly with anything else running."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture
def plain_coordinator() -> Iterator[CoordinatorServer]:
    """An in-process coordinator of the tiny task (insecure, port 0) expecting two workers."""
    server = CoordinatorServer(CoordinatorServiceConfig(task=tiny_task(8), expected_workers=2))
    server.start()
    yield server
    server.stop(0)


@pytest.fixture
def start() -> Iterator[Callable[..., Env]]:
    """Start in-process coordinators (`support.config(**kw)`, on `clock`), each with a channel; all stopped at the
    end."""
    made: list[Env] = []

    def _start(clock: Callable[[], float] = time.time, **kw: Any) -> Env:
        srv = CoordinatorServer(config(**kw), clock=clock)
        srv.start()
        chan = channel(srv.address)
        env = Env(srv, coordinator_pb2_grpc.CoordinatorStub(chan), chan, param_specs(srv.task.model_fn(0)))
        made.append(env)
        return env

    yield _start
    for env in made:
        env.chan.close()
        env.server.stop(0)


@pytest.fixture
def env(start: Callable[..., Env]) -> Env:
    return start()


def _etcd_binary() -> str:
    """The etcd binary; without it the test is skipped, except in CI (CI=true), where it fails: CI installs it
    (.ci/run)."""
    binary = etcd_binary()
    if binary is None:
        reason = "no etcd binary: install Debian's etcd-server (scripts/install_etcd.sh, as root)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"{reason}; CI must have it")
        pytest.skip(reason)
    return binary


@pytest.fixture
def etcd_installed() -> str:
    """The etcd binary, for a test that starts etcd itself (e.g. through `diloco local --replicas`)."""
    return _etcd_binary()


@pytest.fixture
def etcd_server(tmp_path: Path) -> Iterator[EtcdServer]:
    """A real etcd (Debian's etcd-server) on free loopback ports, stopped and reaped at the end."""
    server = EtcdServer(_etcd_binary(), tmp_path / "etcd")
    server.workdir.mkdir()
    try:
        server.start()
        yield server
    finally:
        server.stop()


def etcd_pki(tmp_path: Path) -> ServerTls:
    """`diloco certs --etcd`'s folder in `tmp_path/pki` (SANs localhost and 127.0.0.1, no learners): etcd serves with
    etcd.pem; coordinator.pem is a client certificate it trusts."""
    pki = tmp_path / "pki"
    write_bundle(pki, clients=[], hosts=("localhost", "127.0.0.1"), tokens=False, etcd=True)
    return ServerTls(pki / "ca.pem", pki / "etcd.pem", pki / "etcd.key")


@pytest.fixture
def etcd_tls(tmp_path: Path) -> Iterator[EtcdServer]:
    """A real etcd serving its clients over https only, with --client-cert-auth (`etcd_pki`)."""
    server = EtcdServer(_etcd_binary(), tmp_path / "etcd", tls=etcd_pki(tmp_path))
    server.workdir.mkdir()
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator[EtcdCluster]:
    """Three members of one etcd cluster, each serving its clients over https with --client-cert-auth (`etcd_pki`)."""
    cluster = EtcdCluster(_etcd_binary(), tmp_path / "etcd", size=3, tls=etcd_pki(tmp_path))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
