"""`diloco ctl`: the operator's tool over the coordinator RPCs."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from rich.console import Console
from rich.table import Table

from diloco.errors import InvalidArgument
from diloco.rpc import security
from diloco.rpc.vocab import MODES, POWER_SOURCES, WORKER_STATES
from diloco.v1 import coordinator_pb2, coordinator_pb2_grpc


def state_name(value: int) -> str:
    return WORKER_STATES.from_proto(value).value


def power_text(tp: Any) -> str:
    """'612 W (nvml)', or '-' when the learner reports no power."""
    source = POWER_SOURCES.from_proto(tp.power_source).value if tp.power_source else ""
    return f"{tp.watts:,.0f} W ({source})" if source else "-"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("ctl", help="operate a running coordinator", description="Call coordinator RPCs.")
    p.add_argument("--coordinator", required=True, metavar="HOST:PORT")
    p.add_argument("--timeout-s", type=float, default=10.0)
    p.add_argument("--json", action="store_true", help="print the reply as JSON")
    p.add_argument(
        "action",
        choices=("status", "workers", "ledger", "checkpoint", "drain", "evict", "release", "pause", "resume"),
    )
    p.add_argument("worker_id", nargs="?", help="for drain, evict and release")
    p.add_argument("--reason", default="evicted by operator")
    security.add_flags(p, os.environ, tls_name="admin", tokens=("admin",))
    p.set_defaults(func=run)


def call(args: argparse.Namespace) -> Message:
    sec = security.from_args(args, os.environ)
    stub = coordinator_pb2_grpc.CoordinatorStub(sec.channel(args.coordinator, admin=True))
    t = args.timeout_s
    needs_id = {"drain", "evict", "release"}
    if args.action in needs_id and not args.worker_id:
        raise SystemExit(f"diloco ctl {args.action}: give a WORKER_ID (see `diloco ctl ... workers`)")
    calls: dict[str, Callable[[], Message]] = {
        "status": lambda: stub.GetStatus(coordinator_pb2.GetStatusRequest(), timeout=t),
        "workers": lambda: stub.ListWorkers(coordinator_pb2.ListWorkersRequest(), timeout=t),
        "ledger": lambda: stub.GetLedger(coordinator_pb2.GetLedgerRequest(), timeout=t),
        "checkpoint": lambda: stub.Checkpoint(coordinator_pb2.CheckpointRequest(), timeout=t),
        "drain": lambda: stub.DrainWorker(coordinator_pb2.DrainWorkerRequest(worker_id=args.worker_id), timeout=t),
        "evict": lambda: stub.EvictWorker(
            coordinator_pb2.EvictWorkerRequest(worker_id=args.worker_id, reason=args.reason), timeout=t
        ),
        "release": lambda: stub.ReleaseWorker(
            coordinator_pb2.ReleaseWorkerRequest(worker_id=args.worker_id), timeout=t
        ),
        "pause": lambda: stub.Pause(coordinator_pb2.PauseRequest(), timeout=t),
        "resume": lambda: stub.Resume(coordinator_pb2.ResumeRequest(), timeout=t),
    }
    return calls[args.action]()


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
