"""Load benchmark (issue #11 item 4): N fake learners against the real coordinator and healthd on one machine.

For every N in `learners`, a fresh `LocalCluster` (healthd and coordinator as child processes on loopback port 0,
no real workers; plaintext, the tiny task with N data shards so every learner can own one, decoupled rounds with
quorum K = max(1, round(N x `quorum_fraction`))) and one or more load-generator processes. Each generator runs its
fake learners as `grpc.aio` coroutines over a few shared channels (one per `learners_per_channel` learners). A
fake learner does what a worker does on the wire, without training:

- `Register` with the task fingerprint the coordinator announces (`task_fingerprint` of the first reply);
- holds a `WatchParameters(worker_id, follow)` stream and reads every chunk of every version;
- holds a `Heartbeat` stream to healthd, one heartbeat (with a throughput figure) every `heartbeat_interval_s`;
  the round-trip time of each is taken from its acknowledgement (matched by sequence number);
- once every ~`submit_interval_s` (the first at a random offset in [0, S), then every S x U(2/3, 4/3)) calls
  `GetWorkPlan` and submits a small pseudo-gradient (a constant 1e-5 vector in the coordinator's codec, one batch
  of tokens on its first shard) over `SubmitPseudoGradient`; a learner whose plan holds no shard yet (a shard
  moving to it waits for its owner's next submission) asks again every `SHARDLESS_POLL_S`, as a real learner polls.

The run per N: (1) services start, settle, baseline RSS/threads; (2) the learners register and connect; they are
*ready* when registered, holding version 0 and acknowledged by healthd; (3) idle for `settle_s`: RSS and threads
with N idle learners (RSS per learner = growth over baseline / learners ready) and idle CPU; (4) the active window of
`active_s`: submissions run, a prober thread in this process calls `GetStatus` and `GetWorkPlan` every
`probe_interval_ms` each (a call's latency counts from when it was due, so a stalled service cannot hide behind
calls that were never made); (5) submissions stop, `deliver_within_s` of drain, then everything stops and is
reaped.

Definitions:
- *publication* of version v: the timestamp of the coordinator's `round.closed` log line for v.
- *every watcher receives every version*: for every version published in the active window and every one of the
  N learners, the learner received v or a later version within `deliver_within_s` of v's publication (a watcher
  may skip an intermediate version when a newer one was already there: it follows the latest). A learner that
  never registered or never watched misses every version.
- *round close time* of v: from the reply to the last submission v applied (its id is in the header the watchers
  get) to v's publication: the grace window, merge, outer step and encoding of the new parameters.
- *delivery time*: from publication to a watcher holding v (or newer), over every (watcher, version) pair.
- RSS (`VmRSS`), thread count (`Threads`) and CPU seconds (utime + stime) come from /proc/<pid> of each service.

The services collect garbage with `diloco.rpc.server.tune_gc` (as they always do); the load generators and this
process (the prober) do the same, so that their own collector pauses do not show up as the services' latency.

Every call has a deadline (`call_timeout_s`; the streams the run's budget), every wait a bound, and the whole run
`budget_s`: a service that stops answering shows up as errors and late calls, never as a hang.

    python -m diloco.bench.bench_load --learners 100,300,1000 [--active-s 60] [--submit-interval-s 30] [--json]

In the suite: `diloco bench --only load`.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import datetime
import gc
import itertools
import math
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc

from diloco.bench.section import Context, Log, quick_flag, standalone, table
from diloco.cluster import TINY_TASK_ARGS, ClusterConfig, LocalCluster, LogFollower
from diloco.errors import ConfigError
from diloco.rpc.server import channel, tune_gc
from diloco.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, healthd_pb2, healthd_pb2_grpc

pb = coordinator_pb2
CHUNK = 1 << 20
# targets (issue #11), checked at the largest N of the run
TARGET_STATUS_P99_MS = 100.0
TARGET_RSS_KB_PER_LEARNER = 200.0
THREAD_SLACK = 32  # threads a service may add with N learners connected, whatever N: a bound independent of N


@dataclass(frozen=True)
class LoadSettings:
    learners: tuple[int, ...] = (100, 300, 1000)
    submit_interval_s: float = 30.0  # mean time between one learner's submissions
    heartbeat_interval_s: float = 1.0
    dead_after_s: float = 6.0  # healthd's silence before a node is dead
    quorum_fraction: float = 0.1  # K = max(1, round(N x this))
    active_s: float = 60.0  # the measurement window with submissions
    settle_s: float = 5.0  # idle time before the idle RSS/threads/CPU are read
    deliver_within_s: float = 10.0  # "receives every version": within this long of its publication
    probe_interval_ms: float = 100.0  # GetStatus and GetWorkPlan, each due this often
    learners_per_channel: int = 50
    learners_per_process: int = 500
    register_concurrency: int = 16  # Register calls in flight per generator process
    call_timeout_s: float = 10.0  # deadline of every unary call
    ready_timeout_s: float = 90.0  # the learners have this long to register and connect
    budget_s: float = 900.0  # the whole run; an N that cannot finish inside it is skipped
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.learners or min(self.learners) < 1:
            raise ConfigError(f"learners: give counts >= 1, got {self.learners}")
        for name in ("submit_interval_s", "heartbeat_interval_s", "active_s", "deliver_within_s", "call_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")
        if self.dead_after_s <= 2 * self.heartbeat_interval_s:
            raise ConfigError("dead_after_s must be more than twice heartbeat_interval_s")
        if not 0 < self.quorum_fraction <= 1:
            raise ConfigError(f"quorum_fraction must be in (0, 1], got {self.quorum_fraction}")
        if self.learners_per_channel < 1 or self.learners_per_process < 1 or self.register_concurrency < 1:
            raise ConfigError("learners_per_channel, learners_per_process and register_concurrency must be >= 1")

    def quorum(self, n: int) -> int:
        return max(1, round(n * self.quorum_fraction))


FULL = LoadSettings()
QUICK = LoadSettings(
    learners=(20, 50), submit_interval_s=4.0, active_s=12.0, settle_s=2.0, deliver_within_s=5.0, ready_timeout_s=45.0
)


# --- /proc ---------------------------------------------------------------------------------------------------------


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS (KB) and Threads of process `pid` (empty where there is no /proc or the process is gone)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "Threads"):
                    out[key] = int(value.split()[0])
    except (OSError, ValueError):
        return {}
    return out


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) of process `pid` so far; NaN when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(xs: Sequence[float], q: float) -> float:
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def latency(xs: Sequence[float], errors: int = 0) -> dict[str, Any]:
    """Percentiles in ms of `xs` (seconds)."""
    ms = [x * 1e3 for x in xs]
    return {
        "calls": len(ms),
        "errors": errors,
        "p50_ms": percentile(ms, 0.5),
        "p99_ms": percentile(ms, 0.99),
        "max_ms": max(ms, default=math.nan),
    }


# --- the load generator (a child process) ---------------------------------------------------------------------


@dataclass(frozen=True)
class GenJob:
    coordinator: str
    healthd: str
    first: int  # index of this process's first learner
    count: int
    s: LoadSettings
    stream_s: float  # deadline of the long-lived streams


@dataclass
class _Learner:
    idx: int
    name: str
    worker_id: str = ""
    version: int = -1
    lost: str = ""  # why it stopped (its registration is gone)
    register_s: float = math.nan
    received: list[tuple[int, float]] = field(default_factory=list)  # (version, wall time it was complete)
    beats: list[tuple[float, float]] = field(default_factory=list)  # (wall time sent, round trip s)
    plans: list[tuple[float, float, str]] = field(default_factory=list)  # (wall time, s, "OK" or code)
    submits: list[tuple[float, float, str, str]] = field(default_factory=list)  # (wall end, s, outcome, id)
    errors: Counter[str] = field(default_factory=Counter)
    declared_dead: int = 0
    watching: asyncio.Event = field(default_factory=asyncio.Event)
    beating: asyncio.Event = field(default_factory=asyncio.Event)


SHARDLESS_POLL_S = 1.0  # a learner without a shard asks for its plan this often


class _Generator:
    def __init__(self, job: GenJob, conn: Connection) -> None:
        self.job, self.s, self.conn = job, job.s, conn
        self.learners = [_Learner(i, f"load{i}") for i in range(job.first, job.first + job.count)]
        self.rng = random.Random(job.s.seed * 1_000_003 + job.first)
        self.stopping = asyncio.Event()
        self.draining = asyncio.Event()
        self.applied: dict[int, list[str]] = {}  # version -> submission ids it applied (from the headers)
        self.fingerprint = ""
        self.tokens = 0
        self.numel = 0
        self.payload: tuple[common_pb2.PayloadSpec, bytes] | None = None
        self.codec = "int8"
        self.epoch = 0

    def _channels(self, address: str) -> list[grpc.aio.Channel]:
        n = max(1, math.ceil(self.job.count / self.s.learners_per_channel))
        opts = [
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
            ("grpc.use_local_subchannel_pool", 1),  # a connection of its own per channel
            ("grpc.enable_retries", 0),
            ("grpc.http2.max_frame_size", (16 << 20) - 1),
        ]
        return [grpc.aio.insecure_channel(address, options=opts) for _ in range(n)]

    async def _recv(self) -> str:
        msg: str = await asyncio.to_thread(self.conn.recv)
        return msg

    async def run(self) -> None:
        self.cchans = self._channels(self.job.coordinator)
        self.hchans = self._channels(self.job.healthd)
        self.cstubs = [coordinator_pb2_grpc.CoordinatorStub(c) for c in self.cchans]
        self.hstubs = [healthd_pb2_grpc.HealthDaemonStub(c) for c in self.hchans]
        tasks: list[asyncio.Task[None]] = []
        try:
            sem = asyncio.Semaphore(self.s.register_concurrency)
            deadline = time.monotonic() + self.s.ready_timeout_s
            # the first learner alone: its reply names the task (fingerprint, tokens per step) and the codec
            await self._register(self.learners[0], sem, tasks)
            registering = [asyncio.create_task(self._register(ln, sem, tasks)) for ln in self.learners[1:]]
            while time.monotonic() < deadline and not all(self._ready(ln) or ln.lost for ln in self.learners):
                await asyncio.sleep(0.1)
            for t in registering:  # what has not registered by now counts as not registered
                t.cancel()
            await asyncio.gather(*registering, return_exceptions=True)
            ready = [ln for ln in self.learners if self._ready(ln)]
            self.conn.send(
                (
                    "ready",
                    {
                        "registered": sum(bool(ln.worker_id) for ln in self.learners),
                        "ready": len(ready),
                        "probe_worker_id": ready[0].worker_id if ready else "",
                    },
                )
            )
            if await self._recv() != "go":
                return
            self._encode_payload()
            submitters = [asyncio.create_task(self._submit_loop(ln)) for ln in self.learners]
            if await self._recv() != "drain":
                return
            self.draining.set()
            await asyncio.wait(submitters, timeout=self.s.call_timeout_s * 2 + 1)
            for t in submitters:
                t.cancel()
            if await self._recv() != "stop":
                return
        finally:
            self.stopping.set()
            self.draining.set()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for c in [*self.cchans, *self.hchans]:
                await c.close(grace=None)
        self.conn.send(("results", self._results()))

    def _ready(self, ln: _Learner) -> bool:
        return ln.watching.is_set() and ln.beating.is_set()

    def _cstub(self, ln: _Learner) -> coordinator_pb2_grpc.CoordinatorStub:
        return self.cstubs[(ln.idx - self.job.first) // self.s.learners_per_channel]

    async def _register(self, ln: _Learner, sem: asyncio.Semaphore, tasks: list[asyncio.Task[None]]) -> None:
        req = pb.RegisterRequest(
            worker_name=ln.name,
            model_fingerprint=self.fingerprint,
            throughput=common_pb2.Throughput(tokens_per_s=1000.0, step_time_s=0.25, device_kind="fake"),
        )
        try:
            async with sem:
                t0 = time.perf_counter()
                reply = await self._cstub(ln).Register(req, timeout=self.s.call_timeout_s)
                ln.register_s = time.perf_counter() - t0
        except grpc.aio.AioRpcError as e:
            ln.errors[f"Register {e.code().name}"] += 1
            ln.lost = "not registered"
            return
        except asyncio.CancelledError:
            ln.errors["Register unfinished when the connect phase ended"] += 1
            ln.lost = "not registered"
            raise
        ln.worker_id = reply.worker_id
        if not self.fingerprint:
            self._adopt(reply)
        tasks.append(asyncio.create_task(self._watch(ln)))
        tasks.append(asyncio.create_task(self._heartbeats(ln)))

    def _adopt(self, reply: pb.RegisterResponse) -> None:
        from diloco.rpc.vocab import CODECS
        from diloco.task.factory import TaskConfig

        task = TaskConfig.from_json(reply.task_json)
        self.fingerprint = reply.task_fingerprint
        self.tokens = task.inner.batch_size * task.model.seq_len
        self.codec = CODECS.from_proto(reply.codec)
        self.epoch = reply.coordinator_epoch

    def _encode_payload(self) -> None:
        import torch

        from diloco.core.codecs import get_codec
        from diloco.rpc.payload import meta_to_proto

        if self.numel <= 0:
            return
        data, meta = get_codec(self.codec).encode(torch.full((self.numel,), 1e-5))
        self.payload = meta_to_proto(meta), bytes(data)

    async def _watch(self, ln: _Learner) -> None:
        stub = self._cstub(ln)
        while not self.stopping.is_set():
            call = stub.WatchParameters(
                pb.WatchParametersRequest(worker_id=ln.worker_id, follow=True), timeout=self.job.stream_s
            )
            version, left = -1, 0
            try:
                async for msg in call:
                    if msg.WhichOneof("kind") == "header":
                        h = msg.header
                        version, left = h.version, h.payload.encoded_bytes
                        self.numel = self.numel or h.payload.numel
                        self.applied.setdefault(h.version, list(h.applied_submission_ids))
                    else:
                        left -= len(msg.data)
                    if left <= 0 and version >= 0:
                        ln.received.append((version, time.time()))
                        ln.version = version
                        ln.watching.set()
                        version = -1
            except grpc.aio.AioRpcError as e:
                ln.errors[f"WatchParameters {e.code().name}"] += 1
                if e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                    ln.lost = f"watch: {e.code().name}"
                    return
            finally:
                call.cancel()
            if self.stopping.is_set():
                return
            ln.errors["WatchParameters reopened"] += 1
            await asyncio.sleep(1.0)

    async def _heartbeats(self, ln: _Learner) -> None:
        stub = self.hstubs[(ln.idx - self.job.first) // self.s.learners_per_channel]
        interval = self.s.heartbeat_interval_s
        await asyncio.sleep(self.rng.uniform(0, interval))  # spread the fleet's beats over the interval
        while not self.stopping.is_set():
            call = stub.Heartbeat(timeout=self.job.stream_s)
            sent: dict[int, tuple[float, float]] = {}

            async def write(call: Any = call, sent: dict[int, tuple[float, float]] = sent) -> None:
                seq = 0
                while True:
                    seq += 1
                    sent[seq] = (time.time(), time.perf_counter())
                    await call.write(
                        healthd_pb2.HeartbeatRequest(
                            node_id=ln.worker_id,
                            role=healthd_pb2.NODE_ROLE_WORKER,
                            sequence=seq,
                            throughput=common_pb2.Throughput(tokens_per_s=1000.0, step_time_s=0.25, device_kind="fake"),
                            version=max(0, ln.version),
                        )
                    )
                    await asyncio.sleep(interval)

            writer = asyncio.create_task(write())
            try:
                while True:
                    resp = await call.read()
                    if resp is grpc.aio.EOF:  # type: ignore[attr-defined]
                        break
                    t = sent.pop(resp.sequence, None)
                    if t is not None:
                        ln.beats.append((t[0], time.perf_counter() - t[1]))
                        ln.beating.set()
                    if resp.state == healthd_pb2.NODE_STATE_DEAD:
                        ln.declared_dead += 1
            except grpc.aio.AioRpcError as e:
                ln.errors[f"Heartbeat {e.code().name}"] += 1
            finally:
                writer.cancel()
                call.cancel()
                await asyncio.gather(writer, return_exceptions=True)
            if self.stopping.is_set():
                return
            ln.errors["Heartbeat reopened"] += 1
            await asyncio.sleep(1.0)

    async def _pause(self, seconds: float) -> bool:
        """Sleep `seconds` unless the drain starts first; True if submissions should go on."""
        try:
            await asyncio.wait_for(self.draining.wait(), timeout=seconds)
        except TimeoutError:
            return True
        return False

    async def _submit_loop(self, ln: _Learner) -> None:
        S = self.s.submit_interval_s
        go = await self._pause(self.rng.uniform(0, S))
        n = 0
        while go and ln.worker_id and not ln.lost and self.payload is not None:
            if await self._submit(ln, f"{ln.name}-s{n}"):
                n += 1
                go = await self._pause(S * self.rng.uniform(2 / 3, 4 / 3))
            else:  # no shard yet (a hand-off waits for the owner's next submission): poll, as a real learner does
                go = await self._pause(min(S, SHARDLESS_POLL_S))

    async def _submit(self, ln: _Learner, sid: str) -> bool:
        """One submission (GetWorkPlan, then the upload); False when the plan holds no shard."""
        assert self.payload is not None
        stub = self._cstub(ln)
        t0 = time.perf_counter()
        try:
            got = await stub.GetWorkPlan(pb.GetWorkPlanRequest(worker_id=ln.worker_id), timeout=self.s.call_timeout_s)
        except grpc.aio.AioRpcError as e:
            ln.plans.append((time.time(), time.perf_counter() - t0, e.code().name))
            ln.errors[f"GetWorkPlan {e.code().name}"] += 1
            if e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                ln.lost = f"plan: {e.code().name}"
            return True
        ln.plans.append((time.time(), time.perf_counter() - t0, "OK"))
        if not got.plan.shards:
            ln.submits.append((time.time(), 0.0, "no shard", sid))
            return False
        lease = got.plan.shards[0]
        spec, data = self.payload
        header = pb.SubmissionHeader(
            worker_id=ln.worker_id,
            coordinator_epoch=self.epoch,
            submission_id=sid,
            base_version=got.version,
            tokens=self.tokens,
            steps=1,
            ranges=[
                common_pb2.ShardRange(
                    shard_id=lease.shard_id, epoch=lease.epoch, start=lease.cursor, end=lease.cursor + self.tokens
                )
            ],
            payload=spec,
            plan_seq=got.plan.plan_seq,
        )
        msgs = [pb.SubmitPseudoGradientRequest(header=header)]
        msgs += [pb.SubmitPseudoGradientRequest(data=bytes(data[i : i + CHUNK])) for i in range(0, len(data), CHUNK)]
        t1 = time.perf_counter()
        try:
            reply = await stub.SubmitPseudoGradient(iter(msgs), timeout=self.s.call_timeout_s)
            outcome = pb.SubmissionOutcome.Name(reply.outcome).removeprefix("SUBMISSION_OUTCOME_")
        except grpc.aio.AioRpcError as e:
            outcome = e.code().name
            ln.errors[f"SubmitPseudoGradient {outcome}"] += 1
        ln.submits.append((time.time(), time.perf_counter() - t1, outcome, sid))
        return True

    def _results(self) -> dict[str, Any]:
        errors: Counter[str] = Counter()
        for ln in self.learners:
            errors.update(ln.errors)
        return {
            "learners": [
                {
                    "worker_id": ln.worker_id,
                    "lost": ln.lost,
                    "register_s": ln.register_s,
                    "received": ln.received,
                    "beats": ln.beats,
                    "plans": ln.plans,
                    "submits": ln.submits,
                    "declared_dead": ln.declared_dead,
                }
                for ln in self.learners
            ],
            "applied": self.applied,
            "errors": dict(errors),
        }


def _generate(job: GenJob, conn: Connection) -> None:
    """Child process: run `job`'s learners until the parent says stop (or goes away)."""
    tune_gc()  # the services' collector settings: the harness's own pauses must not read as service latency
    with contextlib.suppress(EOFError, BrokenPipeError, KeyboardInterrupt):
        asyncio.run(_Generator(job, conn).run())


# --- this process: services, prober, sampler ------------------------------------------------------------------


class _Prober:
    """Threads calling GetStatus and GetWorkPlan (as one learner), each due every `interval_s`; records
    (kind, wall time due, seconds from due to the answer, "OK" or the status code)."""

    def __init__(self, address: str, worker_id: str, interval_s: float, timeout_s: float) -> None:
        self.chan = channel(address)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.chan)
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.stop = threading.Event()
        self.calls: list[tuple[str, float, float, str]] = []
        self.next_due: dict[str, float] = {}  # wall time the next call of each kind is due
        self.threads = [threading.Thread(target=self._run, args=("GetStatus",), daemon=True)]
        if worker_id:
            self.threads.append(threading.Thread(target=self._run, args=("GetWorkPlan", worker_id), daemon=True))
        for t in self.threads:
            t.start()

    def _run(self, kind: str, worker_id: str = "") -> None:
        due = time.perf_counter()
        offset = time.time() - due
        while not self.stop.is_set():
            self.next_due[kind] = due + offset
            wait = due - time.perf_counter()
            if wait > 0 and self.stop.wait(wait):
                break
            try:
                if kind == "GetStatus":
                    self.stub.GetStatus(pb.GetStatusRequest(), timeout=self.timeout_s)
                else:
                    self.stub.GetWorkPlan(pb.GetWorkPlanRequest(worker_id=worker_id), timeout=self.timeout_s)
                code = "OK"
            except grpc.RpcError as e:
                code = e.code().name if isinstance(e, grpc.Call) else "ERROR"
            self.calls.append((kind, due + offset, time.perf_counter() - due, code))
            due += self.interval_s
            self.next_due[kind] = due + offset

    def close(self) -> list[tuple[str, float, float, str]]:
        """Stop; the calls. The calls that were due but never made, because the one before had not come back
        yet, are there too (code NOT_SENT): each would have waited at least until now, so that is its latency."""
        self.stop.set()
        end = time.time()
        for t in self.threads:
            t.join(self.timeout_s + 5)
        self.chan.close()
        for kind, due in self.next_due.items():
            while due < end:
                self.calls.append((kind, due, end - due, "NOT_SENT"))
                due += self.interval_s
        return self.calls


class _Sampler:
    """A thread reading RSS and threads of the services every `every_s`: (wall time, {name: status})."""

    def __init__(self, pids: dict[str, int], every_s: float = 0.5) -> None:
        self.pids = pids
        self.samples: list[tuple[float, dict[str, dict[str, int]]]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)
        self.thread.start()

    def _run(self, every_s: float) -> None:
        while not self.stop.wait(every_s):
            self.samples.append((time.time(), {n: proc_status(p) for n, p in self.pids.items()}))

    def peak(self, name: str, key: str, since: float, until: float) -> int | None:
        xs = [s[name].get(key) for t, s in self.samples if since <= t <= until and s[name].get(key) is not None]
        return max((x for x in xs if x is not None), default=None)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


def _snapshot(pids: dict[str, int]) -> dict[str, dict[str, float]]:
    return {n: {**proc_status(p), "cpu_s": cpu_s(p)} for n, p in pids.items()}


def _wall(timestamp: str) -> float | None:
    try:
        return datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()
    except (ValueError, AttributeError):
        return None


def _published(cluster: LocalCluster) -> dict[int, float]:
    """version -> wall time of its `round.closed` log line."""
    out: dict[int, float] = {}
    for line in LogFollower(cluster.run_dir / "coordinator.log").read():
        f = line.fields
        if f.get("event") == "round.closed" and isinstance(f.get("version"), int):
            t = _wall(str(f.get("timestamp", "")))
            if t is not None:
                out[f["version"]] = t
    return out


def _cluster_config(n: int, s: LoadSettings, run_dir: Path) -> ClusterConfig:
    return ClusterConfig(
        workers=0,
        mode="decoupled",
        min_quorum=s.quorum(n),
        codec="int8",
        outer_steps=0,
        checkpoint_every=1_000_000,
        heartbeat_interval_s=s.heartbeat_interval_s,
        dead_after_s=s.dead_after_s,
        run_dir=run_dir,
        # the tiny task with a shard per learner (a corpus big enough for 1,000 shards of a few batches each)
        task_args=(*TINY_TASK_ARGS, "--shards", str(max(8, n)), "--max-bytes", str(max(400_000, 2_000 * n))),
        coordinator_args=("--bulk-port", "-1", "--eval-every", "0"),
        insecure=True,
    )


def _recv(conn: Connection, timeout_s: float) -> Any:
    if not conn.poll(max(0.0, timeout_s)):
        raise TimeoutError(f"no answer from a load generator within {timeout_s:.0f} s")
    return conn.recv()


def run_one(n: int, s: LoadSettings, log: Log, budget_s: float) -> dict[str, Any]:
    """One N: services, learners, measurements. Never raises for a failing service: its errors are the result."""
    deadline = time.monotonic() + budget_s
    out: dict[str, Any] = {"learners": n, "quorum": s.quorum(n), "error": ""}
    ctx = mp.get_context("spawn")
    gens: list[tuple[Any, Connection]] = []
    prober: _Prober | None = None
    sampler: _Sampler | None = None
    with tempfile.TemporaryDirectory(prefix="diloco-bench-load-") as tmp:
        cluster = LocalCluster(_cluster_config(n, s, Path(tmp)))
        try:
            cluster.start(timeout_s=120.0)
            pids = {name: cluster.procs[name].popen.pid for name in ("coordinator", "healthd")}
            out["pids"] = dict(pids)
            time.sleep(min(2.0, s.settle_s))  # the services settle before the baseline
            base = _snapshot(pids)
            sampler = _Sampler(pids)
            t_connect = time.time()
            stream_s = max(1.0, deadline - time.monotonic() + 30)
            for first in range(0, n, s.learners_per_process):
                job = GenJob(
                    cluster.coordinator_address,
                    cluster.healthd_address,
                    first,
                    min(s.learners_per_process, n - first),
                    s,
                    stream_s,
                )
                here, there = ctx.Pipe()
                proc = ctx.Process(target=_generate, args=(job, there), daemon=True)
                proc.start()
                gens.append((proc, here))
            out["generator_pids"] = [p.pid for p, _ in gens]
            watched = {**pids, **{f"generator{i}": p.pid for i, (p, _) in enumerate(gens)}}
            ready_info = [_recv(c, s.ready_timeout_s + 60)[1] for _, c in gens]
            t_ready = time.time()
            out["connect_s"] = t_ready - t_connect
            out["registered"] = sum(r["registered"] for r in ready_info)
            out["ready"] = sum(r["ready"] for r in ready_info)
            log(f"  N={n}: {out['registered']} registered, {out['ready']} ready in {out['connect_s']:.1f} s")
            probe_id = next((r["probe_worker_id"] for r in ready_info if r["probe_worker_id"]), "")
            prober = _Prober(cluster.coordinator_address, probe_id, s.probe_interval_ms / 1e3, s.call_timeout_s)
            idle0, t_idle = _snapshot(watched), time.time()
            time.sleep(s.settle_s)  # the idle measurement window
            idle = _snapshot(watched)
            t_go = time.time()
            for _, c in gens:
                c.send("go")
            time.sleep(max(0.0, min(s.active_s, deadline - time.monotonic() - 60)))  # the active window
            active = _snapshot(watched)
            t_drain = time.time()
            for _, c in gens:
                c.send("drain")
            time.sleep(s.deliver_within_s)  # the drain: what was published reaches every watcher
            t_stop = time.time()
            calls = prober.close()
            prober = None
            for _, c in gens:
                c.send("stop")
            results = [_recv(c, 60)[1] for _, c in gens]
            sampler.close()
            published = _published(cluster)
            out.update(_analyse(n, s, results, calls, published, (t_ready, t_go, t_drain, t_stop)))
            out.update(_resources(out["ready"], base, (idle0, idle, active), sampler, (t_idle, t_go, t_drain)))
        except Exception as e:  # a run that broke is a result too: say what broke
            out["error"] = f"{type(e).__name__}: {e}"[:2000]
            log(f"  N={n}: {out['error']}")
        finally:
            if prober is not None:
                prober.close()
            if sampler is not None:
                sampler.close()
            for proc, c in gens:
                with contextlib.suppress(OSError, ValueError):
                    c.send("stop")
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
                    proc.join(10)
            cluster.stop(grace_s=10.0)
            out["reaped"] = all(p.popen.poll() is not None for p in cluster.procs.values()) and not any(
                p.is_alive() for p, _ in gens
            )
    return out


def _in(t: float, window: tuple[float, float]) -> bool:
    return window[0] <= t <= window[1]


def _analyse(
    n: int,
    s: LoadSettings,
    results: list[dict[str, Any]],
    calls: list[tuple[str, float, float, str]],
    published: dict[int, float],
    times: tuple[float, float, float, float],
) -> dict[str, Any]:
    t_ready, t_go, t_drain, t_stop = times
    active = (t_go, t_drain)
    learners = [ln for r in results for ln in r["learners"]]
    applied: dict[int, list[str]] = {}
    errors: Counter[str] = Counter()
    for r in results:
        applied.update(r["applied"])
        errors.update(r["errors"])
    lat: dict[str, Any] = {}
    for kind in ("GetStatus", "GetWorkPlan"):
        mine = [(d, x, c) for k, d, x, c in calls if k == kind and _in(d, active)]
        lat[kind] = latency([x for _, x, _ in mine], sum(c != "OK" for _, _, c in mine))
        idle = [x for k, d, x, c in calls if k == kind and _in(d, (t_ready, t_go))]
        lat[kind]["idle_p99_ms"] = percentile([x * 1e3 for x in idle], 0.99)
    beats = [x for ln in learners for t, x in ln["beats"] if _in(t, active)]
    lat["Heartbeat"] = latency(beats, sum(v for k, v in errors.items() if k.startswith("Heartbeat ")))
    plans = [(x, c) for ln in learners for t, x, c in ln["plans"] if _in(t, active)]
    lat["GetWorkPlan (learners)"] = latency([x for x, _ in plans], sum(c != "OK" for _, c in plans))
    subs = [(x, o) for ln in learners for t, x, o, _ in ln["submits"] if o != "no shard"]
    ok = ("ACCEPTED", "APPLIED")
    lat["SubmitPseudoGradient"] = latency([x for x, o in subs if o in ok], sum(o not in ok for _, o in subs))
    registers = [ln["register_s"] for ln in learners if not math.isnan(ln["register_s"])]
    lat["Register"] = latency(registers, n - len(registers))

    # delivery: every published version of the window to every one of the N learners (a later one covers it)
    versions = sorted(v for v, p in published.items() if v > 0 and t_go <= p <= t_stop - s.deliver_within_s)
    delivery: list[float] = []
    late = missing = 0
    receipts = [sorted(ln["received"], key=lambda r: r[1]) for ln in learners]
    receipts += [[] for _ in range(n - len(learners))]
    for got in receipts:
        best_after = [0] * len(got)  # highest version held by receipt i
        high = -1
        for i, (v, _) in enumerate(got):
            high = max(high, v)
            best_after[i] = high
        for v in versions:
            i = bisect.bisect_left(best_after, v)
            if i == len(got):
                missing += 1
                continue
            d = max(0.0, got[i][1] - published[v])
            delivery.append(d)
            late += d > s.deliver_within_s
    # round close: from the reply to the last submission a round applied to its publication
    ends: dict[str, float] = {sid: t for ln in learners for t, _, o, sid in ln["submits"] if o in ok}
    close: list[float] = []
    for v in versions:
        last = [ends[sid] for sid in applied.get(v, []) if sid in ends]
        if last:
            close.append(max(0.0, published[v] - max(last)))
    in_window = sorted(p for v, p in published.items() if v > 0 and _in(p, active))
    outcomes = Counter(o for _, o in subs)
    return {
        "latency": lat,
        "versions": len(versions),
        "rounds_in_window": len(in_window),
        "round_interval_s": statistics.median(b - a for a, b in itertools.pairwise(in_window))
        if len(in_window) > 1
        else math.nan,
        "round_close": latency(close),
        "delivery": {
            "pairs": len(versions) * n,
            "within": len(versions) * n - late - missing,
            "late": late,
            "missing": missing,
            **{k: v for k, v in latency(delivery).items() if k != "errors"},
        },
        "every_version": bool(versions) and late == 0 and missing == 0,
        "submissions": dict(outcomes),
        "lost": dict(Counter(ln["lost"] for ln in learners if ln["lost"])),
        "declared_dead": sum(ln["declared_dead"] > 0 for ln in learners),  # learners healthd called dead
        "errors": dict(errors),
    }


def _resources(
    connected: int,
    base: dict[str, dict[str, float]],
    snaps: tuple[dict[str, dict[str, float]], ...],
    sampler: _Sampler,
    times: tuple[float, float, float],
) -> dict[str, Any]:
    idle0, idle, active = snaps
    t_idle, t_go, t_drain = times
    out: dict[str, Any] = {}
    for name in idle:
        cpu = {
            "idle_pct": 100 * (idle[name]["cpu_s"] - idle0[name]["cpu_s"]) / max(1e-9, t_go - t_idle),
            "active_pct": 100 * (active[name]["cpu_s"] - idle[name]["cpu_s"]) / max(1e-9, t_drain - t_go),
            "active_s": active[name]["cpu_s"] - idle[name]["cpu_s"],
        }
        if name not in base:  # a load generator: its CPU only
            out[name] = {"cpu": cpu}
            continue
        rss0, rss1 = base[name].get("VmRSS", math.nan), idle[name].get("VmRSS", math.nan)
        th0, th1 = base[name].get("Threads", math.nan), idle[name].get("Threads", math.nan)
        out[name] = {
            "rss_kb": {
                "base": rss0,
                "idle": rss1,
                "peak_active": sampler.peak(name, "VmRSS", t_go, t_drain),
                "per_learner": (rss1 - rss0) / connected if connected else math.nan,  # per learner connected
            },
            "threads": {"base": th0, "idle": th1, "peak_active": sampler.peak(name, "Threads", t_go, t_drain)},
            "cpu": cpu,
        }
    return {"resources": out}


def run(s: LoadSettings, log: Log) -> dict[str, Any]:
    """Every N of `s.learners` in turn inside `s.budget_s`; the runs, the settings and the checks."""
    started = time.monotonic()
    runs: list[dict[str, Any]] = []
    for n in s.learners:
        left = s.budget_s - (time.monotonic() - started)
        need = s.ready_timeout_s + s.settle_s + s.active_s + s.deliver_within_s + 60
        if left < need:
            runs.append({"learners": n, "quorum": s.quorum(n), "error": f"skipped: {left:.0f} s of the budget left"})
            log(f"  N={n}: skipped, {left:.0f} s of the budget left")
            continue
        log(f"  N={n}: {s.quorum(n)} submissions close a round; one per learner every ~{s.submit_interval_s:g} s")
        with _service_gc():  # the prober's thread lives in this process
            runs.append(run_one(n, s, log, left))
    return {"settings": asdict(s), "runs": runs, "checks": checks(s, runs)}


@contextlib.contextmanager
def _service_gc() -> Iterator[None]:
    """This process collects garbage as the services do (`tune_gc`) for the duration, then as before."""
    before = gc.get_threshold()
    tune_gc()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def checks(s: LoadSettings, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The targets of issue #11, at the largest N measured (the issue's figure is N = 1,000)."""
    done = [r for r in runs if "latency" in r]
    if not done:
        return [{"name": "load benchmark ran", "target": "a run", "measured": "no run finished", "pass": False}]
    r = max(done, key=lambda r: r["learners"])
    at = f"N = {r['learners']:,}" + ("" if r["learners"] >= 1000 else " (the issue's target is for N = 1,000)")
    d, st, res = r["delivery"], r["latency"]["GetStatus"], r["resources"]
    out = [
        {
            "name": f"every watcher receives every version, {at}",
            "target": f"each of the {r['learners']:,} learners holds every version published in the window (or a "
            f"newer one) within {s.deliver_within_s:g} s",
            "measured": (
                f"{d['within']:,} of {d['pairs']:,} (watcher, version) pairs in time, {d['late']:,} late, "
                f"{d['missing']:,} missing"
                if d["pairs"]
                else "no version was published in the window"
            )
            + f"; {r['registered']:,} of {r['learners']:,} learners registered",
            "pass": r["every_version"] and r["registered"] == r["learners"],
        },
        {
            "name": f"GetStatus p99 latency, {at}, submissions running",
            "target": f"<= {TARGET_STATUS_P99_MS:g} ms",
            "measured": f"p99 {_fmt(st['p99_ms'])} ms (p50 {_fmt(st['p50_ms'])}, max {_fmt(st['max_ms'])}; "
            f"{st['errors']} of {st['calls']} calls failed)",
            "pass": None if math.isnan(st["p99_ms"]) else st["p99_ms"] <= TARGET_STATUS_P99_MS and st["errors"] == 0,
        },
    ]
    short = r["ready"] < r["learners"]  # a figure over fewer learners than N does not meet a target at N
    for name in ("coordinator", "healthd"):
        kb = res[name]["rss_kb"]["per_learner"]
        out.append(
            {
                "name": f"{name} RSS growth per idle learner, {at}",
                "target": f"<= {TARGET_RSS_KB_PER_LEARNER:g} KB",
                "measured": f"{_fmt(kb)} KB ({res[name]['rss_kb']['base'] / 1024:.0f} MB with none, "
                f"{res[name]['rss_kb']['idle'] / 1024:.0f} MB with {r['ready']:,} connected"
                + (f"; only {r['ready']:,} of {r['learners']:,} connected)" if short else ")"),
                "pass": None if math.isnan(kb) else kb <= TARGET_RSS_KB_PER_LEARNER and not short,
            }
        )
    grew = {name: res[name]["threads"]["idle"] - res[name]["threads"]["base"] for name in ("coordinator", "healthd")}
    connected = f" ({r['ready']:,} of {r['learners']:,} learners connected)" if short else ""
    out.append(
        {
            "name": f"no thread count proportional to N, {at}",
            "target": f"each service adds <= {THREAD_SLACK} threads with the N learners connected",
            "measured": ", ".join(
                f"{name} {res[name]['threads']['base']:.0f} -> {res[name]['threads']['idle']:.0f}" for name in grew
            )
            + connected,
            "pass": all(g <= THREAD_SLACK for g in grew.values()) and not short,
        }
    )
    return out


def section(ctx: Context) -> dict[str, Any]:
    return run(QUICK if ctx.quick else FULL, ctx.log)


def _pp(lat: dict[str, Any]) -> str:
    """p50 / p99 in ms, with the failed calls."""
    text = f"{_fmt(lat['p50_ms'])} / {_fmt(lat['p99_ms'])}"
    return text + (f" ({lat['errors']} failed)" if lat.get("errors") else "")


def _command(s: dict[str, Any]) -> str:
    """The standalone command that runs these settings: the flags of every setting that differs from FULL."""
    args = [f"--learners {','.join(map(str, s['learners']))}"]
    for name, default in asdict(FULL).items():
        if name not in ("learners", "seed") and name in s and s[name] != default:
            args.append(f"--{name.replace('_', '-')} {s[name]:g}")
    return "python -m diloco.bench.bench_load " + " ".join(args)


def markdown(result: dict[str, Any]) -> str:
    s, runs = result["settings"], result["runs"]
    done = [r for r in runs if "latency" in r]
    intro = (
        f"Command: `{_command(s)}`. For each N a fresh healthd and coordinator (`LocalCluster`: child processes on "
        "loopback, plaintext, the tiny task with one data shard per learner, decoupled rounds closing at "
        f"K = {s['quorum_fraction']:g} x N submissions) and load generators: N fake learners as `grpc.aio` "
        f"coroutines, {s['learners_per_channel']} per channel, up to {s['learners_per_process']:,} per process. "
        "Each learner registers, holds a parameter watch (reading every chunk) and a heartbeat stream "
        f"(one beat every {s['heartbeat_interval_s']:g} s; healthd declares a node dead after "
        f"{s['dead_after_s']:g} s of silence), and submits a small int8 pseudo-gradient about every "
        f"{s['submit_interval_s']:g} s (uniformly 2/3 to 4/3 of it, the first at a random offset). RSS and threads "
        f"are read with no learner and after {s['settle_s']:g} s with the N connected and idle (KB per learner: "
        "the growth over the learners that got *ready*: registered, holding version 0, acknowledged by healthd); "
        "then "
        f"{s['active_s']:g} s of submissions, during which another thread calls GetStatus and GetWorkPlan every "
        f"{s['probe_interval_ms']:g} ms each (latency from when a call was due); then {s['deliver_within_s']:g} s "
        "of drain. Every call has a deadline of "
        f"{s['call_timeout_s']:g} s; a failed call counts with the time it took. The generators and the prober "
        "collect garbage with the services' settings (`tune_gc`). A version is *published* at its "
        "`round.closed` log line; *every watcher receives every version* means each of the N learners holds it "
        f"(or a newer one) within {s['deliver_within_s']:g} s. *Round close*: from the reply to the last submission "
        "a round applied to its publication (grace window, merge, outer step, encoding)."
    )
    lat_rows = [
        [
            f"{r['learners']:,}",
            f"{r['registered']:,} / {r['ready']:,} in {r['connect_s']:.1f} s",
            _pp(r["latency"]["GetStatus"]),
            _pp(r["latency"]["GetWorkPlan"]),
            _pp(r["latency"]["Heartbeat"]),
            _pp(r["latency"]["SubmitPseudoGradient"]),
            _pp(r["latency"]["Register"]),
        ]
        for r in done
    ]
    round_rows = []
    for r in done:
        d = r["delivery"]
        subs = ", ".join(f"{k.lower()} {v}" for k, v in sorted(r["submissions"].items())) or "none"
        round_rows.append(
            [
                f"{r['learners']:,}",
                f"{r['rounds_in_window']} ({_fmt(r['round_interval_s'], '.2f')} s apart)",
                f"{_fmt(r['round_close']['p50_ms'] / 1e3, '.2f')} / {_fmt(r['round_close']['p99_ms'] / 1e3, '.2f')}",
                f"{_fmt(d['p50_ms'])} / {_fmt(d['p99_ms'])} / {_fmt(d['max_ms'])}",
                f"{d['within']:,} of {d['pairs']:,}" + (f" ({d['missing']:,} missing)" if d["missing"] else ""),
                subs,
                str(r["declared_dead"]),
            ]
        )
    res_rows = []
    for r in done:
        row = [f"{r['learners']:,}"]
        for name in ("coordinator", "healthd"):
            x = r["resources"][name]
            rss = x["rss_kb"]
            row += [
                f"{rss['base'] / 1024:.0f} → {rss['idle'] / 1024:.0f} ({_fmt(rss['per_learner'])})",
                f"{x['threads']['base']:.0f} → {x['threads']['idle']:.0f} ({_fmt(x['threads']['peak_active'], '.0f')})",
                f"{x['cpu']['idle_pct']:.0f} / {x['cpu']['active_pct']:.0f}",
            ]
        gens = [v["cpu"] for k, v in r["resources"].items() if k.startswith("generator")]
        row.append(f"{sum(g['active_pct'] for g in gens):.0f}")
        res_rows.append(row)
    parts = [
        intro,
        table(
            [
                "N",
                "registered / ready",
                "GetStatus p50 / p99 (ms)",
                "GetWorkPlan",
                "heartbeat RTT",
                "SubmitPseudoGradient",
                "Register",
            ],
            lat_rows,
        ),
        table(
            [
                "N",
                "rounds in window",
                "round close p50 / p99 (s)",
                "delivery p50 / p99 / max (ms)",
                "(watcher, version) pairs in time",
                "submissions",
                "learners declared dead",
            ],
            round_rows,
        ),
        table(
            [
                "N",
                "coordinator RSS MB (KB per learner)",
                "coordinator threads (peak)",
                "coordinator CPU % idle / active",
                "healthd RSS MB (KB per learner)",
                "healthd threads (peak)",
                "healthd CPU % idle / active",
                "generators CPU %",
            ],
            res_rows,
        ),
    ]
    broken = [r for r in runs if r.get("error")]
    if broken:
        parts.append("\n".join(f"- N = {r['learners']:,}: {r['error']}" for r in broken))
    errs = [r for r in done if r["errors"]]
    if errs:
        parts.append(
            "Errors the learners saw (status codes by call):\n\n"
            + "\n".join(
                f"- N = {r['learners']:,}: " + ", ".join(f"{k} x{v}" for k, v in sorted(r["errors"].items()))
                for r in errs
            )
        )
    return "\n\n".join(parts)


def _flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--learners", default="", help="comma-separated N (default: the profile's, 100,300,1000 in full)")
    quick_flag(p)
    for name in (
        "active_s",
        "submit_interval_s",
        "heartbeat_interval_s",
        "dead_after_s",
        "settle_s",
        "deliver_within_s",
        "probe_interval_ms",
        "quorum_fraction",
        "budget_s",
        "ready_timeout_s",
    ):
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=None)
    for name in ("learners_per_channel", "learners_per_process", "register_concurrency"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)


def _settings(a: argparse.Namespace) -> LoadSettings:
    """The profile's settings with the flags given (`ConfigError` names what is wrong)."""
    base = QUICK if a.quick else FULL
    try:
        learners = tuple(int(x) for x in a.learners.split(",") if x.strip()) or base.learners
    except ValueError as e:
        raise ConfigError(f"--learners: {e}") from None
    over = {k: v for k, v in vars(a).items() if k in asdict(base) and k != "learners" and v is not None}
    return replace(base, learners=learners, **over)


def main(argv: Sequence[str] | None = None) -> int:
    return standalone(__doc__, _flags, lambda a, log: run(_settings(a), log), markdown, argv)


if __name__ == "__main__":
    sys.exit(main())
