"""`diloco local --replicas N` (diloco/ha/local.py): the one-command local cluster with coordinator high
availability. The whole command as a real process on the tiny task (its task flags from the environment, which the
replicas inherit): a real etcd, two replicas, healthd and two learners; the job must finish under one leader that
the summary names, and nothing may be left behind: no process of the run (etcd included), no etcd data folder.
Then the flag checks, each refused before anything starts, and the pure rules (who leads, who comes back)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from diloco.cli.main import main
from diloco.cluster import TINY_TASK_ARGS, LogFollower
from diloco.flags import env_name
from diloco.ha import local
from diloco.v1 import coordinator_pb2

TARGET = 4


def tiny_task_env() -> dict[str, str]:
    """TINY_TASK_ARGS as DILOCO_<FLAG> variables (`diloco local` has no task flags besides --model)."""
    pairs = zip(TINY_TASK_ARGS[::2], TINY_TASK_ARGS[1::2], strict=True)
    return {env_name(flag): value for flag, value in pairs}


def processes_naming(path: Path) -> dict[int, str]:
    """Every process on this machine whose command line names `path` (the run's own folders): pid -> command."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # it ended meanwhile
        if str(path) in argv:
            found[int(entry.name)] = argv
    return found


@pytest.mark.timeout(300)
def test_local_with_two_replicas_finishes_under_one_leader_and_leaves_nothing_behind(
    etcd_installed: str, tmp_path: Path
) -> None:
    tmp, run_dir = tmp_path / "tmp", tmp_path / "run"
    tmp.mkdir()
    argv = [sys.executable, "-m", "diloco.cli.main", "local", "--replicas", "2", "--workers", "2", "-K", "1"]
    argv += ["--outer-steps", str(TARGET), "-H", "5", "--run-dir", str(run_dir), "--json", "--timeout-s", "200"]
    env = {**os.environ, **tiny_task_env(), "TMPDIR": str(tmp), "COLUMNS": "400"}  # wide: one line per message
    try:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=250)
    finally:
        left = processes_naming(tmp_path)
        for pid in left:  # reap what a failed run left, before asserting
            os.kill(pid, signal.SIGKILL)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not left, f"processes of the run still running after it ended: {left}"
    result = json.loads(done.stdout)
    assert result["outer_steps"] == TARGET  # the loop ends early only once the job finished
    assert result["tokens_applied"] > 0 and result["goodput"] > 0

    # one replica led the whole job (the one the summary names); the other followed it as a hot standby
    logs = {name: LogFollower(run_dir / f"{name}.log").read() for name in ("coord-a", "coord-b")}
    led = sorted(name for name, lines in logs.items() if any(x.event == "replica.promoted" for x in lines))
    assert led == [result["leader"]], led
    assert result["leader_epoch"] > 0
    (standby,) = set(logs) - set(led)
    assert any(x.event == "replication.snapshot_loaded" for x in logs[standby])
    assert not [x.fields for lines in logs.values() for x in lines if x.fields.get("level") == "error"]
    for i in range(2):  # the learners were given both replicas' addresses
        (registered,) = (x for x in LogFollower(run_dir / f"worker{i}.log").read() if x.event == "worker.registered")
        assert registered.fields["worker_id"]

    # etcd was started, then stopped by PID, and its temporary data folder removed (the TLS folder too)
    m = re.search(r"etcd \(pid (\d+)\) at (\S+), its data in (\S+);", done.stderr)
    assert m is not None, done.stderr[-3000:]
    etcd_pid, data_dir = int(m.group(1)), Path(m.group(3))
    assert data_dir.parent == tmp and not data_dir.exists()
    assert not list(tmp.glob("diloco-etcd-*")) and not list(tmp.glob("diloco-tls-*"))
    with pytest.raises(ProcessLookupError):
        os.kill(etcd_pid, 0)
    etcd_log = (run_dir / "etcd.log").read_text()
    assert str(data_dir) in etcd_log and "closed etcd server" in etcd_log


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--replicas", "0"], "--replicas must be between 1 and 5, got 0"),
        (["--replicas", "6"], "--replicas must be between 1 and 5, got 6"),
        (["--sync-replicas", "1"], "--sync-replicas set how a leader waits for its standbys: needs --replicas >= 2"),
        (["--when-no-standby", "wait"], "--when-no-standby set how a leader waits"),
        (["--replicas", "2", "--sync-replicas", "2"], "a leader of 2 replicas has 1 standby(s) to wait for; give 0..1"),
        (["--replicas", "3", "--sync-replicas", "-1"], "give 0..2"),
        # the coordinator's own rule (services/coordinator/config.py), through its parser
        (
            ["--replicas", "2", "--sync-replicas", "0", "--when-no-standby", "wait"],
            "a coordinator replica refuses this combination: when_no_standby wait holds each version until "
            "--sync-replicas standbys acknowledged it",
        ),
    ],
)
def test_local_refuses_bad_replica_flags_before_starting_anything(
    flags: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(local, "etcd_binary", lambda: "/usr/bin/etcd")  # these checks come before etcd is run
    assert main(["local", "--run-dir", str(tmp_path / "run"), *flags]) == 2
    err = capsys.readouterr().err
    assert "diloco local: configuration error:" in err and message in err, err
    assert not (tmp_path / "run").exists()


def test_local_replicas_without_etcd_exits_2_saying_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(local, "etcd_binary", lambda: None)
    assert main(["local", "--replicas", "2", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "no etcd binary" in err and "scripts/install_etcd.sh" in err and "make etcd" in err, err
    assert not (tmp_path / "run").exists()


def test_one_replica_is_todays_cluster_and_two_run_the_replication_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    assert local.replica_plan(1, None, None) is None
    monkeypatch.setattr(local, "etcd_binary", lambda: "/usr/bin/etcd")
    plan = local.replica_plan(3, None, None)
    assert plan is not None and plan.names == ("coord-a", "coord-b", "coord-c")
    assert plan.args == ("--replication-log", "4", "--sync-replicas", "1", "--when-no-standby", "publish")
    plan = local.replica_plan(2, 0, "publish")
    assert plan is not None and plan.args[3] == "0"


def ha(is_leader: bool, epoch: int) -> coordinator_pb2.HaStatus:
    return coordinator_pb2.HaStatus(is_leader=is_leader, leader_epoch=epoch)


def test_the_leader_is_the_replica_that_says_it_leads_under_the_highest_epoch() -> None:
    assert local.pick_leader({}) is None
    assert local.pick_leader({"coord-a": ha(False, 7), "coord-b": ha(False, 7)}) is None
    assert local.pick_leader({"coord-a": ha(False, 9), "coord-b": ha(True, 9)}) == "coord-b"
    # a fenced leader not yet retired still says it leads, under its older epoch
    assert local.pick_leader({"coord-a": ha(True, 4), "coord-b": ha(True, 9)}) == "coord-b"


@pytest.mark.parametrize(
    ("code", "again"),
    [(3, True), (0, True), (-signal.SIGKILL, True), (-signal.SIGTERM, True), (1, False), (2, False), (4, False)],
)
def test_a_replica_comes_back_after_losing_leadership_a_step_down_or_a_kill_not_a_crash(code: int, again: bool) -> None:
    assert local.restarts(code) is again
