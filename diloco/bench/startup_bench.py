"""Start-up time of each service: from `exec` of the process to its first answer (ALGORITHM.md: a restarted
service must be back quickly; issue #16 item 3).

Every process is a real child on loopback with mutual TLS and tokens, as deployed (certificates from
`diloco.rpc.tls.write_bundle` in a temp folder). Per run:

- a service (`python -m services.healthd`, `diloco healthd`, `python -m services.coordinator` fresh and resuming
  from a checkpoint): the clock starts just before `Popen`; the service binds port 0 and logs `<service>.started`
  with the port (read from its stdout); then `grpc.health.v1` Check is polled every few ms until it answers
  SERVING. "to log line" and "to SERVING" are both from the spawn. Learning the port from the log means the
  health client connects to a listening port at once (a channel to a port nobody listens on yet backs off for up
  to a second between attempts, which would measure gRPC's backoff, not the service).
- `diloco ctl status`: the whole command, spawn to exit, against a running coordinator (TLS handshake and one
  `GetStatus` included).
- the floors: `python -c 'pass'` (the interpreter alone) and `python -c 'import torch'`.

One untimed warm-up run of everything comes first (a restarted service finds its files in the page cache).

The coordinator builds its task (model and data) before it serves; the default task is used, as `diloco
coordinator` runs it without flags. Its checkpoint is written once by an in-process coordinator of the same task;
loading it (`services.coordinator.checkpoint.load`) is timed on its own in this process, so the target "≤ 2 s plus
checkpoint load" can be checked. Medians of `repeats` runs (interleaved, so every command sees the same load).

    python -m diloco.bench.startup_bench [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from diloco.bench.section import Context, Log, standalone, table
from diloco.rpc.security import SecurityConfig
from diloco.rpc.tls import ADMIN_TOKEN_FILE, JOIN_TOKEN_FILE, write_bundle


@dataclass(frozen=True)
class StartupSettings:
    repeats: int = 5
    timeout_s: float = 120.0  # per process, to SERVING (a loaded machine is slow, never this slow)
    poll_s: float = 0.005  # between health checks
    healthd_target_s: float = 0.5
    ctl_target_s: float = 0.5
    coordinator_target_s: float = 2.0  # plus the checkpoint's load time when it resumes from one
    coordinator_args: tuple[str, ...] = ()  # the default task, as `diloco coordinator` runs without flags
    warmup: bool = True  # one untimed run of everything first


FULL = StartupSettings()
QUICK = StartupSettings(repeats=1, warmup=False)

# the floors: the interpreter alone, and with torch (which the coordinator cannot do without)
FLOORS = ("pass", "import torch")
# label -> how it is started; `{tls}` is replaced by the security flags of the named identity
COMMANDS: dict[str, tuple[str, ...]] = {
    "python -m services.healthd": ("-m", "services.healthd"),
    "diloco healthd": ("-m", "diloco.cli.main", "healthd"),
    "diloco coordinator": ("-m", "diloco.cli.main", "coordinator"),
    "diloco coordinator, resuming from a checkpoint": ("-m", "diloco.cli.main", "coordinator"),
}


class _Child:
    """A child process whose stdout lines are read by a thread (so the pipe never fills) with their arrival time."""

    def __init__(self, argv: Sequence[str]) -> None:
        self.lines: queue.Queue[tuple[float, str]] = queue.Queue()
        self.started = time.monotonic()
        self.popen = subprocess.Popen(
            list(argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
        self.tail: list[str] = []
        self._reader = threading.Thread(target=self._read, args=(self.popen.stdout,), daemon=True)
        self._reader.start()

    def _read(self, stream: IO[bytes] | None) -> None:
        assert stream is not None
        for raw in stream:
            line = raw.decode(errors="replace").rstrip()
            self.tail = [*self.tail[-20:], line]
            self.lines.put((time.monotonic(), line))

    def wait_event(self, event: str, deadline: float) -> tuple[float, dict[str, Any]]:
        """The arrival time and fields of the first JSON log line with `event`."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or (self.popen.poll() is not None and self.lines.empty()):
                raise RuntimeError(f"no {event} line (exit {self.popen.poll()}); last output:\n" + "\n".join(self.tail))
            try:
                t, line = self.lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if line.startswith("{"):
                try:
                    doc = json.loads(line)
                except ValueError:
                    continue
                if doc.get("event") == event:
                    return t, doc

    def stop(self, grace_s: float = 30.0) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=30)
        self._reader.join(timeout=10)


def _serving_at(address: str, security: SecurityConfig, deadline: float, poll_s: float) -> float:
    """Poll grpc.health.v1 until SERVING; the time of that answer."""
    with security.channel(address, admin=True) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return time.monotonic()
            except grpc.RpcError:
                pass
            time.sleep(poll_s)
    raise TimeoutError(f"{address} did not answer SERVING in time")


class _Bench:
    def __init__(self, s: StartupSettings, root: Path, log: Log) -> None:
        self.s = s
        self.root = root
        self.log = log
        self.tls = root / "tls"
        write_bundle(self.tls, [], hosts=("localhost", "127.0.0.1"))
        self.security = SecurityConfig(
            tls_dir=str(self.tls),
            tls_name="admin",
            insecure=False,
            join_token=(self.tls / JOIN_TOKEN_FILE).read_text().strip(),
            admin_token=(self.tls / ADMIN_TOKEN_FILE).read_text().strip(),
        )
        self.checkpoint_dir = root / "checkpoints"

    def tls_args(self, name: str, tokens: Sequence[str]) -> list[str]:
        args = ["--tls-dir", str(self.tls), "--tls-name", name]
        for kind in tokens:
            args += [f"--{kind}-token-file", str(self.tls / (JOIN_TOKEN_FILE if kind == "join" else ADMIN_TOKEN_FILE))]
        return args

    def service_argv(self, label: str) -> tuple[list[str], str]:
        argv = [sys.executable, *COMMANDS[label], "--port", "0"]
        if "healthd" in label:
            return [*argv, *self.tls_args("healthd", ("join", "admin"))], "healthd.started"
        argv += [*self.s.coordinator_args, "--bulk-port", "-1", *self.tls_args("coordinator", ("join", "admin"))]
        if "checkpoint" in label:
            argv += ["--checkpoint-dir", str(self.checkpoint_dir)]
        return argv, "coordinator.started"

    def start(self, label: str) -> tuple[_Child, str, dict[str, float]]:
        """Start one service and wait until it serves; the child (still running), its address and timings."""
        argv, event = self.service_argv(label)
        child = _Child(argv)
        deadline = child.started + self.s.timeout_s
        try:
            logged, doc = child.wait_event(event, deadline)
            address = f"127.0.0.1:{doc['port']}"
            serving = _serving_at(address, self.security, deadline, self.s.poll_s)
        except BaseException:
            child.stop()
            raise
        cpu = _cpu_s(child.popen.pid)
        return child, address, {"log_s": logged - child.started, "serving_s": serving - child.started, "cpu_s": cpu}

    def ctl_status(self, address: str) -> tuple[float, float]:
        argv = [sys.executable, "-m", "diloco.cli.main", "ctl", "--coordinator", address, "--json", "status"]
        argv += self.tls_args("admin", ("admin",))
        cpu0, started = _children_cpu_s(), time.monotonic()
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=self.s.timeout_s, check=False)
        took, cpu = time.monotonic() - started, _children_cpu_s() - cpu0
        if proc.returncode != 0 or '"version"' not in proc.stdout:
            raise RuntimeError(f"ctl status failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
        return took, cpu

    def floor(self, code: str) -> tuple[float, float]:
        cpu0, started = _children_cpu_s(), time.monotonic()
        subprocess.run([sys.executable, "-c", code], check=True, timeout=self.s.timeout_s)
        return time.monotonic() - started, _children_cpu_s() - cpu0

    def write_checkpoint(self) -> dict[str, Any]:
        """One checkpoint of the coordinator's task, written by a coordinator in a child process (its logs stay out
        of this one's stdout); its size, and its load time in this process."""
        from services.coordinator import checkpoint

        argv = [*self.s.coordinator_args, "--port", "0", "--bulk-port", "-1", "--insecure"]
        argv += ["--checkpoint-dir", str(self.checkpoint_dir)]
        proc = subprocess.run(
            [sys.executable, "-c", WRITE_CHECKPOINT, json.dumps(argv)],
            capture_output=True,
            text=True,
            timeout=self.s.timeout_s,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"writing the checkpoint failed: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        path = Path(proc.stdout.strip().splitlines()[-1])
        loads = []
        for _ in range(max(3, self.s.repeats)):
            started = time.monotonic()
            checkpoint.load(path)
            loads.append(time.monotonic() - started)
        return {"bytes": path.stat().st_size, "load_s": statistics.median(loads), "load_runs_s": loads}


WRITE_CHECKPOINT = """
import json, sys
from services.coordinator.config import parse
from services.coordinator.server import CoordinatorServer
server = CoordinatorServer(parse(json.loads(sys.argv[1]), {}))
server.start()
try:
    written = server.checkpoint_now()
finally:
    server.stop(0)
print(written[0])
"""


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) process `pid` has used so far, from /proc/<pid>/stat (NaN
    where there is no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    """CPU seconds of every reaped child so far (a finished command's share is the difference around it)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _summary(runs: list[float], cpu: list[float]) -> dict[str, Any]:
    return {
        "median_s": statistics.median(runs),
        "min_s": min(runs),
        "max_s": max(runs),
        "runs_s": runs,
        "cpu_median_s": statistics.median(cpu),
        "cpu_runs_s": cpu,
    }


CTL = "diloco ctl status"


def measure(s: StartupSettings, log: Log) -> dict[str, Any]:
    load = list(os.getloadavg())
    names = [*COMMANDS, CTL, *(f"python -c '{code}'" for code in FLOORS)]
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    logged: dict[str, list[float]] = {label: [] for label in COMMANDS}
    with tempfile.TemporaryDirectory(prefix="diloco-bench-startup-") as tmp:
        b = _Bench(s, Path(tmp), log)
        ckpt = b.write_checkpoint()
        log(f"  checkpoint: {ckpt['bytes'] / 1e6:.1f} MB, loads in {ckpt['load_s']:.3f} s")
        first = -1 if s.warmup else 0
        for i in range(first, s.repeats):  # run -1 warms the file cache up and is not counted
            for code in FLOORS:
                took, used = b.floor(code)
                wall[f"python -c '{code}'"].append(took)
                cpu[f"python -c '{code}'"].append(used)
            for label in COMMANDS:
                child, address, t = b.start(label)
                try:
                    if label == "diloco coordinator":
                        took, used = b.ctl_status(address)
                        wall[CTL].append(took)
                        cpu[CTL].append(used)
                finally:
                    child.stop()
                wall[label].append(t["serving_s"])
                cpu[label].append(t["cpu_s"])
                logged[label].append(t["log_s"])
            log(
                f"  {'warm-up' if i < 0 else f'run {i + 1}/{s.repeats}'}: "
                + ", ".join(f"{n} {wall[n][-1]:.2f} s ({cpu[n][-1]:.2f} CPU-s)" for n in names)
            )
        if s.warmup:
            for runs in (*wall.values(), *cpu.values(), *logged.values()):
                del runs[0]
    rows = [
        {
            "name": n,
            "kind": "service" if n in COMMANDS else "round trip" if n == CTL else "floor",
            **_summary(wall[n], cpu[n]),
            **({"log_median_s": statistics.median(logged[n])} if n in COMMANDS else {}),
        }
        for n in names
    ]
    by_name = {r["name"]: r for r in rows}

    def check(name: str, row: str, limit: float, extra: str = "") -> dict[str, Any]:
        median, cpu = by_name[row]["median_s"], _s(by_name[row]["cpu_median_s"])
        return {
            "name": name,
            "target": f"≤ {limit:.2f} s{extra} (median of {s.repeats})",
            "measured": f"{median:.2f} s ({cpu} s of CPU)",
            "pass": median <= limit,
        }

    resume = "diloco coordinator, resuming from a checkpoint"
    checks = [
        check("`python -m services.healthd` start to SERVING", "python -m services.healthd", s.healthd_target_s),
        check("`diloco healthd` start to SERVING", "diloco healthd", s.healthd_target_s),
        check("`diloco ctl status` round trip", "diloco ctl status", s.ctl_target_s),
        check("coordinator start to SERVING", "diloco coordinator", s.coordinator_target_s),
        check(
            "coordinator resuming from a checkpoint, start to SERVING",
            resume,
            s.coordinator_target_s + ckpt["load_s"],
            f" ({s.coordinator_target_s:g} s + {ckpt['load_s']:.2f} s checkpoint load)",
        ),
    ]
    return {"settings": asdict(s), "load_average": load, "checkpoint": ckpt, "rows": rows, "checks": checks}


def section(ctx: Context) -> dict[str, Any]:
    return measure(QUICK if ctx.quick else FULL, ctx.log)


def _s(x: float | None) -> str:
    """Seconds with two decimals; `-` for a figure this platform could not measure (NaN, null in JSON)."""
    return "-" if x is None or math.isnan(x) else f"{x:.2f}"


def summary(r: dict[str, Any]) -> str:
    """The headline table (the repository README shows it): medians against the targets."""
    return table(
        ["what", "target", "median", "result"],
        [[c["name"], c["target"], c["measured"], "pass" if c["pass"] else "**missed**"] for c in r["checks"]],
    )


def markdown(r: dict[str, Any]) -> str:
    s, ckpt = r["settings"], r["checkpoint"]
    rows = [
        [
            f"`{row['name']}`",
            f"{row['median_s']:.2f}",
            f"{row['min_s']:.2f} – {row['max_s']:.2f}",
            _s(row["cpu_median_s"]),
            f"{row['log_median_s']:.2f}" if "log_median_s" in row else "",
        ]
        for row in r["rows"]
    ]
    return "\n\n".join(
        [
            f"Settings: every process a real child on loopback with mutual TLS and tokens; median of {s['repeats']} "
            "runs, interleaved. A service's time runs from the spawn to its first `grpc.health.v1` SERVING answer "
            "(its port is read from its `<service>.started` log line, then the health check is polled every "
            f"{s['poll_s'] * 1000:g} ms); `diloco ctl status` from the spawn to its exit with the reply; "
            "`python -c 'pass'` is the interpreter alone and `python -c 'import torch'` the coordinator's floor. "
            + ("One untimed warm-up run of everything goes first. " if s.get("warmup", True) else "")
            + "The coordinator builds its default task "
            "(a 2-layer byte-level GPT on the standard library's sources) before it serves. The checkpoint "
            f"({ckpt['bytes'] / 1e6:.1f} MB, the same task) loads in {ckpt['load_s']:.3f} s on its own. Load average "
            f"when the section started: {', '.join(f'{x:.1f}' for x in r['load_average'])} (1, 5, 15 min): on a "
            "busy machine every figure here grows with the load.",
            table(
                ["command", "start → serving (s)", "min – max (s)", "CPU used (s)", "start → `started` log line (s)"],
                rows,
            ),
            "CPU used: user + system time of the process (every thread) up to SERVING, or of the whole command: "
            "what a start costs on an idle core. Wall time beyond it is waiting, mostly for a CPU when the "
            "machine is loaded.",
            "healthd and `diloco ctl` never import torch (`tests/test_startup.py` checks it); the coordinator "
            "needs it for the model, so its floor is the interpreter plus torch plus building the task.",
        ]
    )


def _flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=int, default=FULL.repeats)


def main(argv: Sequence[str] | None = None) -> int:
    return standalone(__doc__, _flags, lambda a, log: measure(StartupSettings(repeats=a.repeats), log), markdown, argv)


if __name__ == "__main__":
    sys.exit(main())
