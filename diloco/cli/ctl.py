"""`diloco ctl`: the operator's tool over the coordinator RPCs. Given every replica's address (`--coordinator A,B`),
it follows the leader like a learner does (`diloco.rpc.coordinators`): a replica that does not lead answers
UNAVAILABLE naming the leader and the call is made there; an unreachable address moves it to the next one. Only
UNAVAILABLE is retried (the call did not run), within `--timeout-s` in all."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from rich.console import Console
from rich.table import Table

from diloco import log as logging
from diloco.core.leadership import coordinator_addresses
from diloco.errors import InvalidArgument
from diloco.rpc import security
from diloco.rpc.coordinators import MOVES_ON, Coordinators
from diloco.rpc.retry import RetryConfig
from diloco.rpc.vocab import MODES, POWER_SOURCES, WORKER_STATES
from diloco.v1 import coordinator_pb2, coordinator_pb2_grpc

ACTIONS = ("status", "workers", "ledger", "checkpoint", "drain", "evict", "release", "pause", "resume", "step-down")
Stub = coordinator_pb2_grpc.CoordinatorStub


def state_name(value: int) -> str:
    return WORKER_STATES.from_proto(value).value


def power_text(tp: Any) -> str:
    """'612 W (nvml)', or '-' when the learner reports no power."""
    source = POWER_SOURCES.from_proto(tp.power_source).value if tp.power_source else ""
    return f"{tp.watts:,.0f} W ({source})" if source else "-"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("ctl", help="operate a running coordinator", description="Call coordinator RPCs.")
    p.add_argument(
        "--coordinator",
        required=True,
        metavar="HOST:PORT[,HOST:PORT...]",
        help="the coordinator, or every replica's address (it follows the leader among them)",
    )
    p.add_argument("--timeout-s", type=float, default=10.0, help="for the whole command, moves included")
    p.add_argument("--json", action="store_true", help="print the reply as JSON")
    p.add_argument("action", choices=ACTIONS)
    p.add_argument("worker_id", nargs="?", help="for drain, evict and release")
    p.add_argument("--reason", default="", help="for evict (default 'evicted by operator') and step-down")
    security.add_flags(p, os.environ, tls_name="admin", tokens=("admin",))
    p.set_defaults(func=run)


def request(args: argparse.Namespace) -> Callable[[Stub, float], Message]:
    """The action's call: `(stub, timeout_s) -> reply`."""
    needs_id = {"drain", "evict", "release"}
    if args.action in needs_id and not args.worker_id:
        raise SystemExit(f"diloco ctl {args.action}: give a WORKER_ID (see `diloco ctl ... workers`)")
    pb, wid = coordinator_pb2, args.worker_id
    calls: dict[str, Callable[[Stub, float], Message]] = {
        "status": lambda s, t: s.GetStatus(pb.GetStatusRequest(), timeout=t),
        "workers": lambda s, t: s.ListWorkers(pb.ListWorkersRequest(), timeout=t),
        "ledger": lambda s, t: s.GetLedger(pb.GetLedgerRequest(), timeout=t),
        "checkpoint": lambda s, t: s.Checkpoint(pb.CheckpointRequest(), timeout=t),
        "drain": lambda s, t: s.DrainWorker(pb.DrainWorkerRequest(worker_id=wid), timeout=t),
        "evict": lambda s, t: s.EvictWorker(
            pb.EvictWorkerRequest(worker_id=wid, reason=args.reason or "evicted by operator"), timeout=t
        ),
        "release": lambda s, t: s.ReleaseWorker(pb.ReleaseWorkerRequest(worker_id=wid), timeout=t),
        "pause": lambda s, t: s.Pause(pb.PauseRequest(), timeout=t),
        "resume": lambda s, t: s.Resume(pb.ResumeRequest(), timeout=t),
        "step-down": lambda s, t: s.StepDown(pb.StepDownRequest(reason=args.reason), timeout=t),
    }
    return calls[args.action]


def call(args: argparse.Namespace) -> Message:
    """The action at the leader among `--coordinator`'s addresses, within `--timeout-s` in all."""
    if not (math.isfinite(args.timeout_s) and args.timeout_s > 0):
        raise SystemExit(f"diloco ctl: --timeout-s must be a number of seconds > 0, got {args.timeout_s}")
    try:
        addresses = coordinator_addresses(args.coordinator)
    except InvalidArgument as e:
        raise SystemExit(f"diloco ctl: --coordinator: {e}") from None
    fn = request(args)
    log = logging.to_stream(sys.stderr, "ctl")  # moves and retries, apart from the reply on stdout
    coordinators = Coordinators(addresses, security.from_args(args, os.environ), admin=True, who="ctl", log=lambda: log)
    deadline = time.monotonic() + args.timeout_s
    retry = RetryConfig(
        max_attempts=4 * len(addresses), max_total_s=args.timeout_s, initial_backoff_s=0.05, max_backoff_s=1.0
    )
    try:
        return coordinators.call(
            lambda stub: fn(stub, max(0.01, deadline - time.monotonic())), args.action, retry, codes=MOVES_ON
        )
    finally:
        coordinators.close()


def to_dict(msg: Message) -> dict[str, Any]:
    return MessageToDict(msg, always_print_fields_with_no_presence=True, preserving_proto_field_name=True)


def render(console: Console, action: str, msg: Any) -> None:
    if action == "status":
        t = Table(title="coordinator", show_header=False)
        loss = "-" if math.isnan(msg.validation_loss) else f"{msg.validation_loss:.4f}"
        if not math.isnan(msg.validation_loss) and msg.validation_tokens:
            loss += f" ({msg.validation_tokens:,} tokens)"
        rows = {
            "mode": MODES.from_proto(msg.mode),
            "version": f"{msg.version}" + (f" / {msg.target_outer_steps}" if msg.target_outer_steps else ""),
            "validation loss": loss,
            "live workers": str(msg.live_workers),
            "paused": str(msg.paused),
            "finished": str(msg.finished),
            "pending submissions": str(msg.pending_submissions),
            "tokens applied": f"{msg.tokens_applied:,}",
            "rejected submissions": str(msg.rejected_submissions),
            "bytes received / sent": f"{msg.bytes_received:,} / {msg.bytes_sent:,}",
            "codec": msg.codec,
            "coordinator epoch": str(msg.coordinator_epoch),
            "placement": msg.placement or "speed",
            "placement reason": msg.placement_reason or "-",
            "paused workers": str(msg.paused_workers),
            "power (live workers)": f"{msg.watts:,.0f} W",
            "energy / carbon / cost": f"{msg.energy_kwh:,.4f} kWh / {msg.carbon_g:,.2f} gCO2 / {msg.cost:,.4f}",
        }
        for k, v in rows.items():
            t.add_row(k, v)
        console.print(t)
        if msg.HasField("ha"):
            render_ha(console, msg.ha)
    elif action == "step-down":
        new = msg.leader_id and f"{msg.leader_id} at {msg.leader_address}, epoch {msg.leader_epoch}"
        console.print(
            f"stepped down at version {msg.version} (held by {', '.join(msg.held_by)}); new leader: "
            + (new or "not seen yet, see `diloco ctl status`")
        )
    elif action == "workers":
        t = Table(title="workers")
        cols = ("id", "state", "device", "tokens/s measured", "claimed", "H_m", "shards", "submissions", "tokens")
        energy = ("watts", "zone", "weight", "kWh", "gCO2", "cost")
        for col in (*cols, *energy, "reason"):
            t.add_column(col)
        for w in msg.workers:
            t.add_row(
                w.worker_id,
                state_name(w.state),
                w.throughput.device_kind,
                f"{w.measured_tokens_per_s:,.0f}",
                f"{w.throughput.tokens_per_s:,.0f}",
                str(w.local_steps),
                ",".join(str(s.shard_id) for s in w.shards),
                str(w.submissions),
                f"{w.tokens:,}",
                power_text(w.throughput),
                w.zone or "-",
                "paused" if w.placement_weight == 0 else f"{w.placement_weight:g}",
                f"{w.energy_kwh:,.4f}",
                f"{w.carbon_g:,.2f}",
                f"{w.cost:,.4f}" + (" spot" if w.spot else ""),
                w.state_reason,
            )
        console.print(t)
    elif action == "ledger":
        t = Table(title=f"shard ledger at version {msg.version}")
        for col in ("shard", "owner", "epoch", "committed", "accepted", "length", "ranges"):
            t.add_column(col)
        for s in msg.shards:
            t.add_row(
                str(s.shard_id),
                s.owner or "-",
                str(s.epoch),
                f"{s.committed:,}",
                f"{s.accepted:,}",
                f"{s.length:,}",
                str(len(s.committed_ranges)),
            )
        console.print(t)
    else:
        console.print(to_dict(msg) or "ok")


def _log_size(ha: Any) -> str:
    """What the round log holds: the versions a standby catches up from, and its bytes against the cap."""
    first, n = ha.log_oldest_version + 1, ha.log_entries
    if not n or first > ha.log_version:
        window = "no entries"
    else:
        versions = f"version {first}" if first == ha.log_version else f"versions {first}-{ha.log_version}"
        window = f"{versions} ({n} entr{'y' if n == 1 else 'ies'})"
    return f"{window}, {_mib(ha.log_bytes)} of {_mib(ha.log_max_bytes)} kept at most"


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def render_ha(console: Console, ha: Any) -> None:
    """Leadership and the standbys following the round log (GetStatusResponse.ha)."""
    t = Table(title="high availability", show_header=False)
    leader = f"{ha.leader_id} at {ha.leader_address}" if ha.leader_id else (ha.leader_address or "not known")
    rows = {
        "leader": leader,
        "this replica": f"{ha.replica_id or '-'} ({'leads' if ha.is_leader else 'does not lead'})",
        "leadership epoch": str(ha.leader_epoch),
        "sync replicas": str(ha.sync_replicas),
        "round log version": str(ha.log_version),
        "round log": _log_size(ha) if ha.log_max_bytes else "-",  # 0: no round log (or a leader before the cap)
    }
    if ha.holding_version:
        rows["held back"] = (
            f"version {ha.holding_version} for {ha.held_s:,.1f} s: too few standbys acknowledged it "
            "(--when-no-standby wait); learners get it once one does: start or mend a standby"
        )
    for k, v in rows.items():
        t.add_row(k, v)
    console.print(t)
    if not ha.replicas:
        console.print("no standby follows this coordinator's round log")
        return
    r = Table(title="standbys")
    for col in ("replica", "acked version", "lag (versions)", "state"):
        r.add_column(col)
    for x in ha.replicas:
        state = "lagging" if x.lagging else ("in sync" if x.lag_versions == 0 else "catching up")
        acked = str(x.acked_version) if x.HasField("acked_version") else "-"
        r.add_row(x.replica_id, acked, str(x.lag_versions), state)
    console.print(r)


def run(args: argparse.Namespace) -> int:
    try:
        msg = call(args)
    except grpc.RpcError as e:
        print(f"diloco ctl {args.action}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    if args.json:
        json.dump(to_dict(msg), sys.stdout, indent=2)
        print()
    else:
        try:
            render(Console(), args.action, msg)
        except InvalidArgument as e:  # an enum value this build does not know
            print(f"diloco ctl {args.action}: {e} (--json prints the reply as it is)", file=sys.stderr)
            return 1
    return 0
