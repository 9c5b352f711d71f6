"""The operator CLI against a real in-process coordinator, and the worker's configuration errors."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from diloco.cli.local import config_from_args
from diloco.cli.main import COMMANDS, build_parser, main
from diloco.cluster import LocalCluster
from diloco.errors import ConfigError
from diloco.rpc.tls import write_bundle
from services.coordinator.server import CoordinatorServer
from services.worker.config import parse as parse_worker


def reply(out: str) -> dict[str, object]:
    """The pretty-printed JSON reply, after any JSON log lines the in-process server wrote to stdout."""
    doc: dict[str, object] = json.loads(out[out.index("{\n") :])
    return doc


def ctl(address: str, *args: str) -> list[str]:
    return ["ctl", "--coordinator", address, "--insecure", *args]  # the in-process coordinator is plaintext


def test_ctl_status_workers_ledger_json(
    plain_coordinator: CoordinatorServer, capsys: pytest.CaptureFixture[str]
) -> None:
    plain_coordinator.core.register("w0", 0.0)
    assert main(ctl(plain_coordinator.address, "status", "--json")) == 0
    status = reply(capsys.readouterr().out)
    assert status["live_workers"] == 1 and status["mode"] == "ROUND_MODE_DECOUPLED"
    assert main(ctl(plain_coordinator.address, "workers", "--json")) == 0
    workers = reply(capsys.readouterr().out)["workers"]
    assert [w["worker_name"] for w in workers] == ["w0"]  # type: ignore[attr-defined]
    assert main(ctl(plain_coordinator.address, "ledger")) == 0
    assert "shard ledger at version 0" in capsys.readouterr().out


def test_ctl_pause_resume_and_drain(plain_coordinator: CoordinatorServer, capsys: pytest.CaptureFixture[str]) -> None:
    worker_id = plain_coordinator.core.register("w0", 0.0).worker_id
    assert main(ctl(plain_coordinator.address, "pause")) == 0
    assert plain_coordinator.core.paused
    assert main(ctl(plain_coordinator.address, "resume")) == 0
    assert not plain_coordinator.core.paused
    assert main(ctl(plain_coordinator.address, "drain", worker_id)) == 0
    assert plain_coordinator.core.workers[worker_id].state == "draining"


def test_ctl_errors_are_clear(plain_coordinator: CoordinatorServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(ctl(plain_coordinator.address, "evict", "ghost-1")) == 1
    assert "NOT_FOUND" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="give a WORKER_ID"):
        main(ctl(plain_coordinator.address, "evict"))


# the least each command parses (its required flags)
MINIMAL_ARGS = {
    "local": [],
    "simulate": [],
    "ctl": ["--coordinator", "h:1", "status"],
    "bench": [],
    "certs": ["--out", "x"],
    "data": ["tokenize", "--corpus", "c", "--vocab-size", "300", "--out", "x"],
}


def test_each_command_parses_with_only_its_own_module_and_keeps_its_help_line() -> None:
    full = build_parser()  # every command's module: the lazy table must agree with the modules
    sub = next(a for a in full._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help for a in sub._choices_actions}
    assert set(MINIMAL_ARGS) == set(COMMANDS)
    for name, (_module, summary) in COMMANDS.items():
        assert helps[name] == summary, f"main.COMMANDS[{name!r}] says {summary!r}, its module {helps[name]!r}"
        args = build_parser(name).parse_args([name, *MINIMAL_ARGS[name]])
        assert args.command == name and callable(args.func)


def test_local_rejects_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["local", "--workers", "2", "-K", "3"]) == 2
    assert "min_quorum" in capsys.readouterr().err
    assert main(["local", "--workers", "2", "--slowdown", "1,0.5"]) == 2
    assert "--slowdown" in capsys.readouterr().err
    assert main(["local", "--workers", "2", "--power-w", "300,-1"]) == 2
    assert "--power-w" in capsys.readouterr().err


@pytest.mark.parametrize("decay", ["1.5", "0", "-0.5", "nan", "inf"])
def test_local_refuses_an_ef_decay_outside_0_1(decay: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["local", "--workers", "2", "--ef-decay", decay]) == 2
    assert "--ef-decay: error feedback decay (beta) must be in (0, 1]" in capsys.readouterr().err


def test_local_passes_ef_decay_to_every_learner(tmp_path: Path) -> None:
    def learners(*flags: str) -> list[float]:
        """The decay each learner `diloco local` would start reads from its command line."""
        argv = ["local", "--workers", "3", "--insecure", "--run-dir", str(tmp_path), *flags]
        cluster = LocalCluster(config_from_args(build_parser("local").parse_args(argv)))
        return [parse_worker(cluster.worker_flags(i), {}).ef_decay for i in range(3)]

    assert learners("--ef-decay", "0.7", "--power-w", "300") == [0.7, 0.7, 0.7]
    assert learners("--ef-decay", "1") == [1.0, 1.0, 1.0]
    assert learners() == [0.0, 0.0, 0.0]  # no flag: the codec's default


@pytest.mark.parametrize(
    ("argv", "env", "field"),
    [
        ([], {}, "coordinator"),
        (["--coordinator", "nohostport"], {}, "coordinator"),
        (["--coordinator", "h:1", "--slowdown", "0.5"], {}, "slowdown"),
        (["--coordinator", "h:1"], {"DILOCO_HEARTBEAT_INTERVAL_S": "-1"}, "heartbeat_interval_s"),
        (["--coordinator", "h:1", "--device", "tpu"], {}, "device"),
        (["--coordinator", "h:1", "--seed", "x"], {}, "--seed"),
        (["--coordinator", "h:1"], {"DILOCO_SLOWDOWN": "fast"}, "DILOCO_SLOWDOWN"),
        (["--coordinator", "h:1", "--slowdown", "inf"], {}, "slowdown"),
        (["--coordinator", "h:1", "--metrics-port", "70000"], {}, "metrics_port"),
        (["--coordinator", "h:1", "--seed", "-3"], {}, "seed"),
        (["--coordinator", "h:1", "--name", "bad\nname"], {}, "name"),
        (["--coordinator", "h:1", "--ef-decay", "1.5"], {}, r"--ef-decay: .* must be in \(0, 1\]"),
        (["--coordinator", "h:1", "--ef-decay", "-0.5"], {}, "--ef-decay"),
        (["--coordinator", "h:1"], {"DILOCO_EF_DECAY": "nan"}, "--ef-decay"),
        (["--coordinator", "h:1", "--power-w", "-5"], {}, "--power-w"),
        (["--coordinator", "h:1", "--power-w", "nan"], {}, "--power-w"),
        (["--coordinator", "h:1", "--power-w", "100001"], {}, "--power-w"),  # > 100 kW is not one learner
        (["--coordinator", "h:1"], {"DILOCO_POWER_W": "inf"}, "--power-w"),
        (["--coordinator", "h:1", "--price-per-hour", "-0.01"], {}, "--price-per-hour"),
        (["--coordinator", "h:1", "--price-per-hour", "1e9"], {}, "--price-per-hour"),
        (["--coordinator", "h:1", "--price-per-hour", "nan"], {}, "--price-per-hour"),
        (["--coordinator", "h:1", "--power-meter", "psu"], {}, "--power-meter"),
        (["--coordinator", "h:1", "--zone", "DE\n"], {}, "--zone"),
        (["--coordinator", "h:1", "--zone", "z" * 65], {}, "--zone"),
        (["--coordinator", "h:1", "--spot", "--on-demand"], {}, "--on-demand"),
        (["--coordinator", "h:1"], {"DILOCO_SPOT": "maybe"}, "DILOCO_SPOT"),
    ],
)
def test_worker_config_errors_name_the_field(argv: list[str], env: dict[str, str], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        parse_worker(["--insecure", *argv], env)  # field checks come before the transport's (TLS or loopback)


def test_worker_flags_fall_back_to_the_environment() -> None:
    cfg = parse_worker(
        ["--insecure", "--slowdown", "3"],
        {"DILOCO_COORDINATOR": "127.0.0.1:7", "DILOCO_NAME": "w7", "DILOCO_SLOWDOWN": "2", "DILOCO_SEED": "4"},
    )
    assert (cfg.coordinator, cfg.name, cfg.slowdown, cfg.seed) == ("127.0.0.1:7", "w7", 3.0, 4)  # the flag wins


def test_worker_energy_flags() -> None:
    base = ["--insecure", "--coordinator", "127.0.0.1:7"]
    cfg = parse_worker(base, {})
    assert (cfg.power_w, cfg.power_meter, cfg.zone, cfg.price_per_hour, cfg.spot) == (0.0, "auto", "", 0.0, False)
    cfg = parse_worker([*base, "--power-w", "350", "--zone", "DE", "--price-per-hour", "2.5", "--spot"], {})
    assert (cfg.power_w, cfg.zone, cfg.price_per_hour, cfg.spot) == (350.0, "DE", 2.5, True)
    assert parse_worker(base, {"DILOCO_SPOT": "true"}).spot
    assert not parse_worker([*base, "--on-demand"], {"DILOCO_SPOT": "true"}).spot  # the flag wins


def test_worker_exits_2_naming_a_bad_energy_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["worker", "--insecure", "--coordinator", "127.0.0.1:7", "--power-w", "-1"]) == 2
    assert "--power-w" in capsys.readouterr().err
    assert main(["worker", "--insecure", "--coordinator", "127.0.0.1:7", "--price-per-hour", "inf"]) == 2
    assert "--price-per-hour" in capsys.readouterr().err
    # a meter that cannot be read here, asked for by name: exit 2 before any call to the coordinator
    assert (
        main(["worker", "--insecure", "--coordinator", "127.0.0.1:7", "--device", "cpu", "--power-meter", "nvml"]) == 2
    )
    assert "--power-meter nvml" in capsys.readouterr().err


def test_worker_name_defaults_to_its_own_certificate(tmp_path: Path) -> None:
    write_bundle(tmp_path, clients=["worker", "site-a"])
    env = {"DILOCO_JOIN_TOKEN": "t"}
    own = parse_worker(["--coordinator", "127.0.0.1:1", "--tls-dir", str(tmp_path), "--tls-name", "site-a"], env)
    assert own.display_name == "site-a"
    shared = parse_worker(["--coordinator", "127.0.0.1:1", "--tls-dir", str(tmp_path)], env)  # the shared `worker`
    assert shared.display_name.endswith(f"-{os.getpid()}")


def test_worker_exits_2_on_bad_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["worker", "--insecure", "--slowdown", "2"]) == 2
    assert "DILOCO_COORDINATOR" in capsys.readouterr().err
