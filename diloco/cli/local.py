"""`diloco local`: the embedded default job. Starts healthd, the coordinator and N workers as separate
processes on loopback, shows live progress, and ends with a summary. With `--replicas N` (N >= 2) the coordinator
is N replicas under the leadership of a real etcd (`diloco.ha.local`), and the progress names the leader and its
epoch."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from diloco.cli.ctl import state_name
from diloco.cluster import ClusterConfig, LocalCluster
from diloco.core.codecs import CODEC_NAMES, CodecError, check_ef_decay
from diloco.core.fragments import check_fragments
from diloco.core.replication import WHEN_NO_STANDBY
from diloco.core.rounds import MODES
from diloco.errors import ConfigError
from diloco.rpc.limits import MAX_WATTS
from diloco.rpc.vocab import MODES as MODES_PB
from diloco.v1 import coordinator_pb2

if TYPE_CHECKING:  # diloco.ha.local imports the coordinator's service modules: when the command runs, not for --help
    from diloco.ha.local import ReplicaPlan, ReplicatedCluster


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "local",
        help="run a local cluster (healthd, coordinator, N workers) on loopback",
        description="Train on the embedded default model and data with a local cluster.",
    )
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--mode", choices=MODES, default="decoupled")
    p.add_argument("--slowdown", default="", help="per-worker slowdown, e.g. 1,1,2,4 (emulates older hardware)")
    p.add_argument(
        "--power-w",
        default="",
        help="per-worker declared watts while training, e.g. 300,300,1200 (a worker that measures its power "
        "with NVML or RAPL reports that instead); missing: none",
    )
    p.add_argument(
        "--placement",
        choices=("speed", "energy"),
        default="speed",
        help="the coordinator's placement policy (energy: pause learners far less efficient in joules per token)",
    )
    p.add_argument("--outer-steps", type=int, default=30)
    p.add_argument("-H", "--local-steps", type=int, default=30)
    p.add_argument("-K", "--min-quorum", type=int, default=2)
    p.add_argument("--codec", choices=CODEC_NAMES, default="int8")
    p.add_argument(
        "--ef-decay",
        type=float,
        default=None,
        help="every learner's error-feedback residual decay beta, in (0, 1] (1: exact; lower forgets what was not "
        "sent faster; default: the codec's, topk and sparse 0.5, the others 1)",
    )
    p.add_argument(
        "--fragments",
        type=int,
        default=1,
        help="streaming fragments: the model in P fragments, each synchronised on its own every H steps (one every "
        "~H/P steps; docs/fragments.md); each round steps about one fragment, so --outer-steps counts rounds",
    )
    p.add_argument("--dead-after-s", type=float, default=2.0)
    p.add_argument("--run-dir", type=Path, default=None, help="logs and checkpoints (default runs/local-TIME)")
    p.add_argument(
        "--nproc-per-worker",
        type=int,
        default=1,
        help="run every worker as an island of N ranks (torchrun, DistributedDataParallel; one GPU each on CUDA)",
    )
    p.add_argument(
        "--shard-model",
        action="store_true",
        help="with --nproc-per-worker N >= 2: every island shards its model over its ranks (FSDP2) instead of DDP",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="coordinator replicas (1..5): N >= 2 also starts a real etcd; one replica leads, the others follow it as "
        "hot standbys and one takes over when it fails (docs/ha.md); healthd and the workers get every address",
    )
    p.add_argument(
        "--sync-replicas",
        type=int,
        default=None,
        help="with --replicas N >= 2: standbys that must hold a version before workers get it (0..N-1; default 1)",
    )
    p.add_argument(
        "--when-no-standby",
        choices=WHEN_NO_STANDBY,
        default=None,
        help="with --replicas N >= 2: what a leader does with a version too few standbys acknowledged (default "
        "publish; wait: hold it back, docs/ha.md)",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="give up after this long")
    p.add_argument("--model", default="", help="hf:<preset-or-path>: a Hugging Face causal LM (default: the GPT)")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="plaintext without tokens (default: mutual TLS and tokens, generated into a temporary folder)",
    )
    p.set_defaults(func=run)


def _per_worker(
    text: str, workers: int, flag: str, example: str, ok: Callable[[float], bool], rule: str
) -> tuple[float, ...]:
    """A comma-separated number per worker (fewer than `workers` allowed), each passing `ok`; "" gives ()."""
    if not text:
        return ()
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError as e:
        raise ConfigError(f"{flag}: expected numbers like {example}, got {text!r}") from e
    if len(values) > workers or any(not ok(v) for v in values):
        raise ConfigError(f"{flag}: at most {workers} values, each {rule}, got {text!r}")
    return values


def parse_slowdowns(text: str, workers: int) -> tuple[float, ...]:
    return _per_worker(text, workers, "--slowdown", "1,1,2,4", lambda v: v >= 1, ">= 1 (1 = full speed)")


def parse_watts(text: str, workers: int) -> tuple[float, ...]:
    return _per_worker(
        text,
        workers,
        "--power-w",
        "300,300,1200",
        lambda v: math.isfinite(v) and 0 <= v <= MAX_WATTS,
        f"in [0, {MAX_WATTS:g}] watts",
    )


def config_from_args(a: argparse.Namespace) -> ClusterConfig:
    if a.workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {a.workers}")
    if a.nproc_per_worker < 1:
        raise ConfigError(f"--nproc-per-worker must be >= 1, got {a.nproc_per_worker}")
    if a.shard_model and a.nproc_per_worker < 2:
        raise ConfigError(
            f"--shard-model shards each island's model over its ranks: it needs --nproc-per-worker >= 2, "
            f"got {a.nproc_per_worker}"
        )
    check_fragments(a.fragments, a.local_steps)
    if a.mode == "decoupled" and not 1 <= a.min_quorum <= a.workers:
        raise ConfigError(f"min_quorum (-K {a.min_quorum}) must be between 1 and --workers ({a.workers})")
    run_dir = a.run_dir or Path("runs") / time.strftime("local-%Y%m%d-%H%M%S")
    worker_args: dict[int, tuple[str, ...]] = {}
    for i, watts in enumerate(parse_watts(a.power_w, a.workers)):
        worker_args[i] = ("--power-w", str(watts))
    if a.shard_model:
        worker_args = {i: (*worker_args.get(i, ()), "--shard-model", "true") for i in range(a.workers)}
    if a.ef_decay is not None:
        try:
            check_ef_decay(a.ef_decay)
        except CodecError as e:
            raise ConfigError(f"--ef-decay: {e}") from None
        worker_args = {i: (*worker_args.get(i, ()), "--ef-decay", str(a.ef_decay)) for i in range(a.workers)}
    return ClusterConfig(
        workers=a.workers,
        mode=a.mode,
        slowdowns=parse_slowdowns(a.slowdown, a.workers),
        outer_steps=a.outer_steps,
        local_steps=a.local_steps,
        min_local_steps=max(1, min(5, a.local_steps)),
        min_quorum=a.min_quorum,
        codec=a.codec,
        dead_after_s=a.dead_after_s,
        run_dir=run_dir,
        insecure=a.insecure,
        task_args=("--model", a.model) if a.model else (),
        nproc_per_worker=a.nproc_per_worker,
        worker_args=worker_args,
        coordinator_args=(
            *(("--placement", a.placement) if a.placement != "speed" else ()),
            *(("--fragments", str(a.fragments)) if a.fragments != 1 else ()),
        ),
    )


def replicas_from_args(a: argparse.Namespace, cfg: ClusterConfig) -> ReplicaPlan | None:
    """The coordinator replicas `--replicas` asks for (None: one coordinator, no etcd), checked against the
    coordinator's own rules for the flags each will get (`ConfigError`)."""
    from diloco.ha.local import check_replica_flags, replica_plan

    plan = replica_plan(a.replicas, a.sync_replicas, a.when_no_standby)
    if plan is not None:
        check_replica_flags(cfg, plan)
    return plan


def replicated(cluster: LocalCluster, plan: ReplicaPlan) -> ReplicatedCluster:
    from diloco.ha.local import ReplicatedCluster

    return ReplicatedCluster(cluster, plan)


def leadership(status: coordinator_pb2.GetStatusResponse) -> str:
    """Who leads and under which epoch, with the standbys following (replicas under etcd); "" otherwise."""
    if not status.HasField("ha") or not status.ha.leader_id:
        return ""
    ha = status.ha
    return f"leader {ha.leader_id} epoch {ha.leader_epoch}, {len(ha.replicas)} standby(s) following"


def view(
    status: coordinator_pb2.GetStatusResponse, workers: coordinator_pb2.ListWorkersResponse, elapsed: float
) -> Group:
    loss = "-" if math.isnan(status.validation_loss) else f"{status.validation_loss:.4f}"
    head = Table.grid(padding=(0, 3))
    head.add_row(
        f"[b]{MODES_PB.from_proto(status.mode)}[/b]",
        f"outer step {status.version}/{status.target_outer_steps}",
        f"val loss {loss}",
        f"tokens {status.tokens_applied:,}",
        f"{elapsed:.0f} s",
        "[yellow]paused[/yellow]" if status.paused else "",
        leadership(status),
    )
    t = Table()
    for col in ("worker", "state", "tokens/s (measured)", "H_m", "shards", "submissions", "tokens"):
        t.add_column(col)
    for w in workers.workers:
        if state_name(w.state) in ("left", "dead", "evicted") and any(
            o.worker_name == w.worker_name and o.registered_unix_s > w.registered_unix_s for o in workers.workers
        ):
            continue  # an older incarnation of a worker that came back
        t.add_row(
            w.worker_id,
            state_name(w.state),
            f"{w.measured_tokens_per_s:,.0f}",
            str(w.local_steps),
            str(len(w.shards)),
            str(w.submissions),
            f"{w.tokens:,}",
        )
    return Group(head, t)


def summary(cluster: LocalCluster, started: float) -> dict[str, Any]:
    status = cluster.status()
    workers = cluster.workers()
    submitted = sum(w.tokens for w in workers.workers)
    return {
        "mode": MODES_PB.from_proto(status.mode),
        "outer_steps": status.version,
        "final_validation_loss": status.validation_loss,
        "wall_time_s": round(time.monotonic() - started, 2),
        "tokens_applied": status.tokens_applied,
        "tokens_submitted": submitted,
        "goodput": round(status.tokens_applied / submitted, 4) if submitted else 0.0,
        "bytes_received": status.bytes_received,
        "bytes_sent": status.bytes_sent,
        "rejected_submissions": status.rejected_submissions,
        "placement": status.placement or "speed",
        "energy_kwh": round(status.energy_kwh, 6),
        "carbon_g": round(status.carbon_g, 4),
        "cost": round(status.cost, 6),
        "workers": {
            w.worker_id: {
                "tokens": w.tokens,
                "tokens_per_s": round(w.measured_tokens_per_s, 1),
                "watts": round(w.throughput.watts, 1),
                "energy_kwh": round(w.energy_kwh, 6),
                "carbon_g": round(w.carbon_g, 4),
                "cost": round(w.cost, 6),
            }
            for w in workers.workers
        },
        "run_dir": str(cluster.run_dir),
        **(
            {"leader": status.ha.leader_id, "leader_epoch": status.ha.leader_epoch}
            if status.HasField("ha") and status.ha.leader_id
            else {}
        ),
    }


def run(a: argparse.Namespace) -> int:
    cfg = config_from_args(a)
    plan = replicas_from_args(a, cfg)
    console = Console(stderr=a.json)
    coordinators = "coordinator" if plan is None else f"etcd, {len(plan.names)} coordinator replicas"
    console.print(f"starting healthd, {coordinators} and {cfg.workers} workers; logs in {cfg.run_dir}")
    started = time.monotonic()
    with LocalCluster(cfg) as cluster:
        ha = None if plan is None else replicated(cluster, plan)
        with ha or nullcontext():
            if ha is None:
                cluster.start()
            else:
                ha.start()
                console.print(
                    f"etcd (pid {ha.etcd.pid}) at {ha.etcd.url}, its data in {ha.workdir}; replicas at {ha.addresses} "
                    f"(diloco ctl --coordinator {ha.addresses} ...)"
                )
            failed = watch(cluster, ha, console, started, a.timeout_s)
            if failed:
                return 1
            result = summary(cluster, started)
    if a.json:
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        console.print()
        t = Table(title="summary", show_header=False)
        for k, v in result.items():
            if k != "workers":
                t.add_row(k, f"{v:,.4f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) else str(v))
        console.print(t)
    return 0


def watch(
    cluster: LocalCluster, ha: ReplicatedCluster | None, console: Console, started: float, timeout_s: float
) -> bool:
    """Show the progress until the job finished and the workers exited, `timeout_s` passed or Ctrl-C; with replicas,
    at the leader, starting again the replicas that ended (`ReplicatedCluster.supervise`). True: the coordinator
    (every replica) exited."""
    try:
        with Live(console=console, refresh_per_second=4, transient=False) as live:
            while time.monotonic() - started < timeout_s:
                try:
                    if ha is not None:
                        ha.follow()
                    status, workers = cluster.status(), cluster.workers()
                    live.update(view(status, workers, time.monotonic() - started))
                    if status.finished and not cluster.workers_alive():
                        break
                except grpc.RpcError:
                    pass
                if ha is None and not cluster.procs["coordinator"].alive:
                    console.print(f"[red]coordinator exited[/red]\n{cluster.tail('coordinator')}")
                    return True
                if ha is not None:
                    for line in ha.supervise():
                        console.print(line)
                    if not ha.running():
                        console.print("[red]every coordinator replica exited[/red]")
                        return True
                time.sleep(0.5)
    except KeyboardInterrupt:
        console.print("interrupted: stopping the cluster")
    return False
