"""Upload throughput of one pseudo-gradient through the real coordinator, against raw loopback TCP.

Starts `python -m services.coordinator` as a separate process with a GPT of about `--params` parameters,
registers one learner over gRPC and, per repeat, uploads a random pseudo-gradient through
`SubmitPseudoGradient` exactly as the worker does (`services/worker/uploader.py`: a `SubmissionHeader`,
then ~1 MiB `data` messages), once encoded fp32 and once int8. Beside it, in the same run, the limit: a raw TCP
socket on 127.0.0.1 sending the same fp32 bytes (`sendall` in 1 MiB pieces; the receiver, a thread of this
process, `recv_into` a preallocated, touched buffer and acks the last byte).

Timings, best of `--repeats`:
- RPC: from the first request message (the header) to the response, measured by the client. The coordinator
  replies after the upload is decoded *and* accepted, and with one learner and `--min-quorum 1` every accepted
  submission closes a round, so this includes the merge and the outer step.
- upload: the coordinator's own `upload_seconds` metric (from opening the upload at its header to the payload
  fully decoded and crc-checked, before accept), read from its Prometheus endpoint.
- accept: from the end of that upload time to the coordinator's `submission.accepted` log line (its wall-clock
  timestamp): accept, merge and the outer step.
- diagnostic sink rows: the same RPC against a sink process built on the services' own gRPC wiring
  (`GrpcService`) that only reads the messages, or also decodes them as the coordinator does: the transport's
  own limit, and the cost of decoding in the handler.
GB/s is payload bytes / seconds; `x TCP` is that over the raw TCP rate.

Memory: the coordinator's `VmHWM` is reset (`/proc/<pid>/clear_refs` = 5) before every upload and read after
it; its `VmRSS` is sampled every few ms. Reported: peak RSS over the RSS before the upload, during the upload
phase (samples up to the end of the server's upload time) and during the whole RPC (VmHWM), and what stayed.

A breakdown runs the stages in this process, one thread, no network, each as production runs it: building the
request messages (client), parsing them (server), crc32 (zlib-ng), the streaming decode into a reused buffer (as
the coordinator does), then the steps of accept and round close (the guard's norm pass, `MergeAccumulator`, the
default outer optimizer) and the real `CoordinatorCore.accept`. It also checks whether each codec's streaming
decoder is freed by reference counting alone (a reference cycle keeps its fp32 buffer alive until the cyclic
garbage collector runs).
Figures are noisy on a shared machine; ratios matter.

    python -m diloco.bench.bench_upload --params 100000000 [--repeats 2] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
import torch
from zlib_ng.zlib_ng import crc32  # the payload crc, as diloco.core.codecs computes it

from diloco.bench.section import Context, console_table, parser, standalone, table
from diloco.cluster import wait_serving
from diloco.core.codecs import EncodedMeta, get_codec, iter_chunks
from diloco.core.coordinator import CoordinatorCore, Submission
from diloco.core.ledger import ShardRange
from diloco.core.merge import EncodedDelta, MergeAccumulator, Segment
from diloco.core.outer import OuterConfig, build_outer
from diloco.errors import ConfigError
from diloco.rpc.bulk import bulk_upload
from diloco.rpc.payload import CHUNK_BYTES, UploadReceiver, chunks, meta_from_proto, meta_to_proto
from diloco.rpc.server import GrpcService, channel
from diloco.task.model import GPT, ModelConfig
from diloco.task.params import ParamSpec, num_params, param_specs
from diloco.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from services.coordinator.config import CoordinatorServiceConfig

VOCAB = 256
SEQ_LEN = 64
HEAD_DIM = 64
TARGET_X_TCP = 0.6  # the goal: an fp32 upload into the coordinator at >= 0.6x raw loopback TCP
PATHS = ("grpc", "bulk")  # SubmitPseudoGradient, and the bulk upload port beside it
TOKENS_PER_SUBMISSION = SEQ_LEN  # one step of batch size 1
PAGE = os.sysconf("SC_PAGE_SIZE")


# --- the model ------------------------------------------------------------------------------------------------
def gpt_numel(d_model: int, n_layers: int, seq_len: int = SEQ_LEN, vocab: int = VOCAB) -> int:
    """Parameters of `diloco.task.model.GPT` (tied head): embeddings, 12d^2 + 13d per block, the last LayerNorm."""
    return (vocab + seq_len) * d_model + n_layers * (12 * d_model * d_model + 13 * d_model) + 2 * d_model


def pick_model(params: int) -> ModelConfig:
    """The GPT (head size 64, about 128 channels per layer) whose size is closest to `params`."""
    best: tuple[float, int, int] | None = None
    for layers in range(1, 65):
        for d in range(HEAD_DIM, 16385, HEAD_DIM):
            n = gpt_numel(d, layers)
            score = abs(math.log(n / params)) + 0.02 * abs(math.log2(d / layers / 128))
            if best is None or score < best[0]:
                best = (score, d, layers)
    assert best is not None
    _, d, layers = best
    return ModelConfig(vocab_size=VOCAB, seq_len=SEQ_LEN, d_model=d, n_layers=layers, n_heads=d // HEAD_DIM)


# --- the coordinator process ----------------------------------------------------------------------------------
class Coordinator:
    """`python -m services.coordinator` in its own process, logging to a file; `close()` stops and reaps it. `extra`
    flags come last, so they override the ones set here."""

    def __init__(
        self, model: ModelConfig, log_dir: Path, *, max_bytes: int, shards: int, extra: Sequence[str] = ()
    ) -> None:
        self.log_path = log_dir / "coordinator.log"
        argv = [
            sys.executable,
            "-m",
            "services.coordinator",
            "--host",
            "127.0.0.1",
            "--insecure",  # plaintext on loopback, like the raw TCP baseline
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--target-outer-steps",
            "0",
            "--mode",
            "decoupled",
            "--min-quorum",
            "1",
            "--expected-workers",
            "1",
            "--checkpoint-dir",
            "",
            "--eval-every",
            "1000000000",
            "--eval-tokens",
            str(SEQ_LEN),
            "--max-bytes",
            str(max_bytes),
            "--shards",
            str(shards),
            "--d-model",
            str(model.d_model),
            "--layers",
            str(model.n_layers),
            "--heads",
            str(model.n_heads),
            "--seq-len",
            str(model.seq_len),
            "--batch-size",  # one sequence per step: a submission of one step holds TOKENS_PER_SUBMISSION tokens
            "1",
            *extra,
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}  # flags only, no surprises
        self._log_file = self.log_path.open("wb")
        self.proc = subprocess.Popen(argv, stdout=self._log_file, stderr=subprocess.STDOUT, env=env)
        self.pid = self.proc.pid
        self.port = 0
        self.metrics_port = -1

    def events(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
        return out

    def tail(self, lines: int = 25) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def wait_event(self, name: str, timeout_s: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for ev in self.events():
                if ev.get("event") == name:
                    return ev
            if self.proc.poll() is not None:
                raise RuntimeError(f"the coordinator exited with {self.proc.returncode}:\n{self.tail()}")
            time.sleep(0.05)
        return None

    def start(self, timeout_s: float) -> None:
        ev = self.wait_event("coordinator.started", timeout_s)
        if ev is None:
            raise TimeoutError(f"the coordinator did not start within {timeout_s} s:\n{self.tail()}")
        self.port, self.metrics_port = int(ev["port"]), int(ev["metrics_port"])
        self.wait_serving(timeout_s)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_serving(self, timeout_s: float) -> None:
        """Wait for grpc.health.v1 SERVING, giving up early if the coordinator exits."""

        def check_alive() -> None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the coordinator exited with {self.proc.returncode}:\n{self.tail()}")

        try:
            wait_serving(self.address, timeout_s, check_alive)
        except TimeoutError as e:
            raise TimeoutError(f"{e}:\n{self.tail()}") from e

    def accepted_at(self, submission_id: str) -> float | None:
        """Unix time of the `submission.accepted` log line of a submission (None when not logged)."""
        for ev in self.events():
            if ev.get("event") == "submission.accepted" and ev.get("submission_id") == submission_id:
                stamp = str(ev.get("timestamp", "")).replace("Z", "+00:00")
                return datetime.fromisoformat(stamp).timestamp() if stamp else None
        return None

    def upload_seconds_sum(self) -> float:
        """`diloco_coordinator_upload_seconds_sum` from its Prometheus endpoint."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
        for line in text.splitlines():
            if line.startswith("diloco_coordinator_upload_seconds_sum "):
                return float(line.split()[1])
        raise RuntimeError("the coordinator's metrics have no diloco_coordinator_upload_seconds_sum")

    def close(self) -> int:
        """SIGTERM, then SIGKILL after 15 s; always reaped. Returns the exit code."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
            return self.proc.wait()
        finally:
            self._log_file.close()


# --- memory of a process --------------------------------------------------------------------------------------
def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * PAGE


def hwm_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmHWM")


def reset_hwm(pid: int) -> bool:
    """Reset the peak RSS (VmHWM) to the current RSS; False where the kernel does not allow it."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class RssSampler:
    """Samples a process's RSS every `interval_s` in a thread, as (monotonic time, bytes)."""

    def __init__(self, pid: int, interval_s: float = 0.002) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), rss_bytes(self.pid)))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def peak(self, until: float = math.inf) -> int:
        return max((rss for t, rss in self.samples if t <= until), default=0)


# --- raw TCP, the limit ---------------------------------------------------------------------------------------
def raw_tcp(payload: memoryview, buf: bytearray, chunk_bytes: int = CHUNK_BYTES) -> float:
    """Seconds to move `payload` over a loopback TCP connection: from the first `sendall` to the receiver's
    one-byte ack of the last byte. The receiver is a thread that `recv_into`s `buf` (preallocated, touched)."""
    total = len(payload)
    view = memoryview(buf)[:total]
    errors: list[BaseException] = []
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]

        def receive() -> None:
            try:
                conn, _ = srv.accept()
                with conn:
                    got = 0
                    while got < total:
                        n = conn.recv_into(view[got:])
                        if n == 0:
                            raise ConnectionError(f"sender closed after {got} of {total} bytes")
                        got += n
                    conn.sendall(b"k")
            except BaseException as e:
                errors.append(e)

        receiver = threading.Thread(target=receive, name="tcp-receiver")
        receiver.start()
        try:
            with socket.create_connection(("127.0.0.1", port)) as s:
                t0 = time.perf_counter()
                for piece in iter_chunks(payload, chunk_bytes):
                    s.sendall(piece)
                if s.recv(1) != b"k":
                    raise ConnectionError("the receiver did not ack")
                seconds = time.perf_counter() - t0
        finally:
            receiver.join()
    if errors:
        raise errors[0]
    return seconds


# --- streaming one payload, as the worker does ----------------------------------------------------------------
@dataclass(frozen=True)
class Stream:
    response: coordinator_pb2.SubmitPseudoGradientResponse
    first: float  # perf_counter when gRPC took the header from the iterator
    first_unix: float  # the same instant on the wall clock (the coordinator's log timestamps)
    sent: float  # ... when it took the last data message
    done: float  # ... when the response arrived


def send_stream(
    stub: coordinator_pb2_grpc.CoordinatorStub,
    header: coordinator_pb2.SubmissionHeader,
    payload: bytes | bytearray | memoryview,
    metadata: Sequence[tuple[str, str]] = (),
) -> Stream:
    """One `SubmitPseudoGradient` call built exactly as the worker's `_upload` builds it."""
    marks: dict[str, float] = {}

    def requests() -> Iterator[coordinator_pb2.SubmitPseudoGradientRequest]:
        marks["first"], marks["first_unix"] = time.perf_counter(), time.time()
        yield coordinator_pb2.SubmitPseudoGradientRequest(header=header)
        for c in chunks(payload, 0):
            yield coordinator_pb2.SubmitPseudoGradientRequest(data=bytes(c))
        marks["sent"] = time.perf_counter()

    resp = stub.SubmitPseudoGradient(requests(), timeout=600, metadata=tuple(metadata))
    done = time.perf_counter()
    return Stream(resp, marks["first"], marks["first_unix"], marks.get("sent", done), done)


# --- uploads through the coordinator --------------------------------------------------------------------------
@dataclass
class Learner:
    """A learner registered over RPC: what a submission header needs."""

    stub: coordinator_pb2_grpc.CoordinatorStub
    worker_id: str
    epoch: int
    specs: list[ParamSpec]
    bulk_address: str  # the coordinator's bulk upload path ("" when it offers none)


@dataclass(frozen=True)
class UploadResult:
    path: str  # "grpc" (SubmitPseudoGradient) or "bulk" (the bulk upload port)
    codec: str
    repeat: int
    payload_bytes: int
    rpc_s: float  # client: first message to response
    send_s: float  # client: first message until gRPC took the last one from the iterator
    upload_s: float  # server: header to payload decoded (its upload_seconds metric)
    accept_s: float | None  # server: payload decoded to its `submission.accepted` log line (accept + round close)
    version: int
    rss_before: int
    rss_after: int
    upload_peak: int  # sampled RSS peak up to the end of the server's upload time
    rpc_peak: int  # VmHWM after the RPC (the sampled peak where VmHWM cannot be reset)
    hwm_exact: bool

    def row(self, numel: int) -> dict[str, Any]:
        return {
            "path": self.path,
            "codec": self.codec,
            "repeat": self.repeat,
            "payload_bytes": self.payload_bytes,
            "rpc_s": self.rpc_s,
            "send_s": self.send_s,
            "upload_s": self.upload_s,
            "accept_apply_s": max(0.0, self.rpc_s - self.upload_s),
            "accept_s": self.accept_s,
            "reply_s": None if self.accept_s is None else self.rpc_s - self.upload_s - self.accept_s,
            "rpc_gb_per_s": self.payload_bytes / self.rpc_s / 1e9,
            "upload_gb_per_s": self.payload_bytes / self.upload_s / 1e9 if self.upload_s > 0 else None,
            "version": self.version,
            "rss_before_bytes": self.rss_before,
            "upload_peak_increase_bytes": self.upload_peak - self.rss_before,
            "rpc_peak_increase_bytes": self.rpc_peak - self.rss_before,
            "retained_bytes": self.rss_after - self.rss_before,
            "fp32_buffer_bytes": 4 * numel,
            "hwm_exact": self.hwm_exact,
        }


def register(stub: coordinator_pb2_grpc.CoordinatorStub, specs: list[ParamSpec], name: str = "bench-upload") -> Learner:
    resp = stub.Register(
        coordinator_pb2.RegisterRequest(
            worker_name=name,
            throughput=common_pb2.Throughput(tokens_per_s=1.0, step_time_s=1.0, device_kind="cpu"),
            model_fingerprint="",
        ),
        timeout=30,
    )
    bulk = f"127.0.0.1:{resp.bulk_port}" if resp.bulk_port else ""
    return Learner(stub, resp.worker_id, resp.coordinator_epoch, specs, bulk)


def submission_header(learner: Learner, meta: EncodedMeta) -> coordinator_pb2.SubmissionHeader:
    """A real submission: the first leased shard from its accepted cursor, against the current version."""
    plan_resp = learner.stub.GetWorkPlan(coordinator_pb2.GetWorkPlanRequest(worker_id=learner.worker_id), timeout=30)
    plan = plan_resp.plan
    if not plan.shards:
        raise RuntimeError("the coordinator leased no shard to the benchmark learner")
    lease = plan.shards[0]
    return coordinator_pb2.SubmissionHeader(
        worker_id=learner.worker_id,
        coordinator_epoch=learner.epoch,
        submission_id=uuid.uuid4().hex,
        base_version=plan_resp.version,
        tokens=TOKENS_PER_SUBMISSION,
        steps=1,
        ranges=[
            common_pb2.ShardRange(
                shard_id=lease.shard_id,
                epoch=lease.epoch,
                start=lease.cursor,
                end=lease.cursor + TOKENS_PER_SUBMISSION,
            )
        ],
        payload=meta_to_proto(meta, learner.specs),
        resume_offset=0,
        plan_seq=plan.plan_seq,
    )


def send_bulk(
    learner: Learner, header: coordinator_pb2.SubmissionHeader, payload: bytes | bytearray | memoryview
) -> Stream:
    """The same submission over the coordinator's bulk upload port, as the worker sends it (`_bulk_upload`)."""
    first, first_unix = time.perf_counter(), time.time()
    resp = bulk_upload(
        learner.bulk_address,
        b"",
        coordinator_pb2.SubmitPseudoGradientRequest(header=header),
        memoryview(payload),
        timeout_s=600,
    )
    done = time.perf_counter()
    return Stream(resp, first, first_unix, done, done)


def upload(
    learner: Learner,
    coord: Coordinator,
    path: str,
    codec: str,
    repeat: int,
    payload: bytes | bytearray | memoryview,
    meta: EncodedMeta,
    interval_s: float = 0.002,
) -> UploadResult:
    header = submission_header(learner, meta)
    before_sum = coord.upload_seconds_sum()
    rss_before = rss_bytes(coord.pid)
    hwm_exact = reset_hwm(coord.pid)
    with RssSampler(coord.pid, interval_s) as sampler:
        st = send_stream(learner.stub, header, payload) if path == "grpc" else send_bulk(learner, header, payload)
    hwm = hwm_bytes(coord.pid) if hwm_exact else 0
    rss_after = rss_bytes(coord.pid)
    resp = st.response
    if resp.outcome not in (coordinator_pb2.SUBMISSION_OUTCOME_ACCEPTED, coordinator_pb2.SUBMISSION_OUTCOME_APPLIED):
        raise RuntimeError(f"{codec} upload was not accepted: {resp}")
    if resp.version != header.base_version + 1:
        raise RuntimeError(f"expected the upload to close round {header.base_version + 1}, got version {resp.version}")
    upload_s = coord.upload_seconds_sum() - before_sum
    accepted_unix = coord.accepted_at(header.submission_id)
    return UploadResult(
        path=path,
        codec=codec,
        repeat=repeat,
        payload_bytes=len(payload),
        rpc_s=st.done - st.first,
        send_s=st.sent - st.first,
        upload_s=upload_s,
        accept_s=None if accepted_unix is None else accepted_unix - (st.first_unix + upload_s),
        version=resp.version,
        rss_before=rss_before,
        rss_after=rss_after,
        upload_peak=max(rss_before, sampler.peak(until=st.first + upload_s)),
        rpc_peak=max(hwm, sampler.peak()) if hwm_exact else max(rss_before, sampler.peak()),
        hwm_exact=hwm_exact,
    )


# --- a diagnostic sink: the same RPC on the same server wiring, without the coordinator -------------------------
DECODE_KEY = "x-bench-decode"


def serve_sink() -> int:
    """The sink process: serve `SubmitPseudoGradient` with the services' gRPC wiring (`GrpcService`, same options and
    thread pool). It reads the header, then every data message; with metadata x-bench-decode=1 it also decodes
    them as the coordinator does (`UploadReceiver`: the bytes kept, each chunk decoded into the sums of squares).
    Prints its port, serves until stdin closes."""
    torch.set_num_threads(1)

    def submit(
        requests: Iterator[coordinator_pb2.SubmitPseudoGradientRequest], context: grpc.ServicerContext
    ) -> coordinator_pb2.SubmitPseudoGradientResponse:
        decode = dict(context.invocation_metadata()).get(DECODE_KEY) == "1"
        first = next(requests)
        receiver = None
        if decode:
            meta = meta_from_proto(first.header.payload)
            receiver = UploadReceiver(meta, meta.numel, [Segment(0, meta.numel)])
        for msg in requests:
            if receiver is not None:
                receiver.feed(msg.data)
        if receiver is not None:
            receiver.finish()
        return coordinator_pb2.SubmitPseudoGradientResponse()

    handler = grpc.method_handlers_generic_handler(
        "diloco.v1.Coordinator",
        {
            "SubmitPseudoGradient": grpc.stream_unary_rpc_method_handler(
                submit,
                request_deserializer=coordinator_pb2.SubmitPseudoGradientRequest.FromString,
                response_serializer=coordinator_pb2.SubmitPseudoGradientResponse.SerializeToString,
            )
        },
    )
    service = GrpcService("127.0.0.1", 0, ["diloco.v1.Coordinator"], sync_threads=8)
    service.add(lambda server: server.add_generic_rpc_handlers((handler,)))
    port = service.start()
    print(port, flush=True)
    sys.stdin.read()  # until the parent closes our stdin (or dies)
    service.stop(1.0)
    return 0


class Sink:
    """The sink server (`serve_sink`) in its own process; `close()` stops and reaps it."""

    def __init__(self, timeout_s: float) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from diloco.bench.bench_upload import serve_sink; raise SystemExit(serve_sink())"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline().decode().strip() if ready else ""  # b"" (EOF) if it died first
        if not line.isdigit():
            self.close()
            raise RuntimeError(f"the sink server did not start (said {line!r}, exit code {self.proc.returncode})")
        self.address = f"127.0.0.1:{int(line)}"

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def sink_upload(
    stub: coordinator_pb2_grpc.CoordinatorStub,
    payload: bytes | bytearray | memoryview,
    meta: EncodedMeta,
    specs: list[ParamSpec],
    decode: bool,
) -> float:
    header = coordinator_pb2.SubmissionHeader(
        worker_id="bench", submission_id=uuid.uuid4().hex, tokens=1, steps=1, payload=meta_to_proto(meta, specs)
    )
    st = send_stream(stub, header, payload, [(DECODE_KEY, "1" if decode else "0")])
    return st.done - st.first


# --- where the time goes (in this process, one thread, no network) ---------------------------------------------
def _best(repeats: int, fn: Callable[[], object], setup: Callable[[], object] = lambda: None) -> float:
    """The best time of `fn` over `repeats` runs, each after an untimed `setup`."""
    best = math.inf
    for _ in range(repeats):
        setup()
        gc.collect()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def breakdown(
    payloads: dict[str, tuple[bytes | bytearray | memoryview, EncodedMeta]], numel: int, repeats: int
) -> list[dict[str, Any]]:
    """Per-byte stages of the upload, then the stages of accept + round close that follow it (the real
    `MergeAccumulator` and outer optimizer on `numel` elements, as `CoordinatorCore.accept`/`_apply` call them).

    Only what production runs: the payload crc is zlib-ng's (as in `diloco.core.codecs`), the coordinator keeps
    the bytes and decodes them on arrival into the merge segments' sums of squares (`UploadReceiver`: the guard's
    norm), the merge decodes them again into the merge buffer (`MergeAccumulator.add` of an `EncodedDelta`), and
    the merge result is computed in place."""
    fp32, _ = payloads["fp32"]
    n_chunks = -(-len(fp32) // CHUNK_BYTES)
    one = coordinator_pb2.SubmitPseudoGradientRequest(data=bytes(fp32[:CHUNK_BYTES])).SerializeToString()
    parse = coordinator_pb2.SubmitPseudoGradientRequest.FromString

    def serialize() -> None:
        for c in chunks(fp32, 0):
            coordinator_pb2.SubmitPseudoGradientRequest(data=bytes(c)).SerializeToString()

    def parse_all() -> None:
        for _ in range(n_chunks):
            parse(one)

    def crc() -> None:
        value = 0
        for c in chunks(fp32, 0):
            value = crc32(c, value)

    segments = [Segment(0, numel)]
    held: dict[str, EncodedDelta] = {}

    def receive(name: str, data: bytes | bytearray | memoryview, meta: EncodedMeta) -> Callable[[], None]:
        def run() -> None:
            receiver = UploadReceiver(meta, numel, segments)
            for c in chunks(data, 0):
                receiver.feed(c)
            held[name] = receiver.finish()

        return run

    rows: list[tuple[str, str, int, float]] = [
        ("upload: client builds + serializes request messages", "fp32", len(fp32), _best(repeats, serialize)),
        ("upload: server parses request messages (upb)", "fp32", len(fp32), _best(repeats, parse_all)),
        ("upload: crc32, zlib-ng (inside decode)", "fp32", len(fp32), _best(repeats, crc)),
    ]
    fold = MergeAccumulator(numel, "mean")
    for name, (data, meta) in payloads.items():
        rows.append(
            (
                f"upload: receive {name}: decode into the sums of squares, copy the bytes in (gRPC; the bulk port "
                "receives them in place)",
                name,
                len(data),
                _best(repeats, receive(name, data, meta)),
            )
        )

        def fold_held(name: str = name) -> None:
            fold.reset()
            fold.add(held[name], TOKENS_PER_SUBMISSION)

        rows.append(
            (f"round: fold {name} (decoded again into the merge buffer)", name, len(data), _best(repeats, fold_held))
        )
    reused = torch.empty(numel, dtype=torch.float32)

    # accept + round close, the real classes; the momentum buffer already exists (steady state)
    delta = reused
    delta.normal_(generator=torch.Generator().manual_seed(2)).mul_(1e-3)
    params = torch.zeros(numel, dtype=torch.float32)
    acc = MergeAccumulator(numel, "mean")
    svc = CoordinatorServiceConfig()
    outer = build_outer(OuterConfig(svc.outer, svc.outer_lr, svc.outer_momentum))  # the service's default
    outer.step(params, delta)
    acc.add(delta, TOKENS_PER_SUBMISSION)
    merged = [acc.result()]

    def add() -> None:
        acc.reset()
        acc.add(delta, TOKENS_PER_SUBMISSION)

    def result() -> None:
        merged[:] = [acc.result()]

    nb = 4 * numel
    name = type(outer).__name__
    rows += [
        (
            "accept: vector_norm(delta) (the guard: finite + norm)",
            "fp32",
            nb,
            _best(repeats, lambda: torch.linalg.vector_norm(delta)),
        ),
        ("round: MergeAccumulator.reset + add", "fp32", nb, _best(repeats, add)),
        ("round: MergeAccumulator.result (in place)", "fp32", nb, _best(repeats, result, setup=add)),
        ("round: vector_norm(merged)", "fp32", nb, _best(repeats, lambda: torch.linalg.vector_norm(merged[0]))),
        (f"round: {name}.step (momentum exists)", "fp32", nb, _best(repeats, lambda: outer.step(params, merged[0]))),
        ("accept + round close: CoordinatorCore.accept", "fp32", nb, _core_accept_s(delta, repeats)),
    ]
    return [{"stage": s, "codec": c, "bytes": b, "seconds": t, "gb_per_s": b / t / 1e9} for s, c, b, t in rows]


def _core_accept_s(delta: torch.Tensor, repeats: int) -> float:
    """Best time of the real `CoordinatorCore.accept` with the service's defaults, one learner and
    `--min-quorum 1` (so it closes the round), after a first round has created the momentum buffer."""
    core = CoordinatorCore(
        CoordinatorServiceConfig(min_quorum=1, expected_workers=1).core_config(),
        torch.zeros(delta.numel(), dtype=torch.float32),
        [1 << 20] * 4,
    )
    worker_id = core.register("bench", 0.0, speed=1.0).worker_id
    best = math.inf
    for i in range(repeats + 1):
        plan = core.plan(worker_id)
        lease = plan.shards[0]
        tokens = core.cfg.tokens_per_step  # one inner step of the default task
        rng = ShardRange(lease.shard_id, lease.epoch, lease.cursor, lease.cursor + tokens)
        sub = Submission(worker_id, f"s{i}", core.version, tokens, 1, (rng,), plan.plan_seq)
        gc.collect()
        t0 = time.perf_counter()
        result = core.accept(sub, delta, float(i))
        seconds = time.perf_counter() - t0
        if result.applied is None:
            raise RuntimeError("CoordinatorCore.accept did not close the round")
        if i:
            best = min(best, seconds)
    return best


def decoder_freed_by_refcount(codec: str) -> bool:
    """Whether a finished streaming decoder (and the fp32 buffer it holds) is freed as soon as it is dropped, or
    only by the cyclic garbage collector (a reference cycle)."""
    was = gc.isenabled()
    gc.disable()
    try:
        c = get_codec(codec)
        data, meta = c.encode(torch.ones(1024))
        dec = c.decoder(meta)
        dec.feed(data)
        dec.finish()
        ref = weakref.ref(dec)
        del dec
        return ref() is None
    finally:
        if was:
            gc.enable()
        gc.collect()


# --- output ---------------------------------------------------------------------------------------------------
def _table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]], caption: str = "") -> str:
    return console_table(title, columns, rows, caption, width=170)


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else fmt.format(x)


def report_text(doc: dict[str, Any]) -> str:
    """The module's own report: its tables and targets, for the terminal."""
    m, tcp = doc["model"], doc["tcp"]
    out = [
        f"model: GPT d_model={m['d_model']} layers={m['n_layers']} heads={m['n_heads']} seq_len={m['seq_len']} "
        f"vocab={m['vocab_size']}: {m['numel']:,} parameters (asked for {m['params_asked']:,}); "
        f"{m['fp32_bytes'] / 1e6:,.1f} MB fp32; {doc['chunk_bytes'] >> 10} KiB chunks; best of {doc['repeats']}"
    ]
    rows = [["raw TCP (limit)", _mb(tcp["bytes"]), f"{tcp['seconds']:.3f}", f"{tcp['gb_per_s']:.2f}", "1.00"]]
    rows[0] += ["-"] * 5
    for g in [*doc["grpc"], *doc.get("bulk", [])]:
        rows.append(
            [
                f"{'gRPC' if g['path'] == 'grpc' else 'bulk port'} {g['codec']} upload",
                _mb(g["payload_bytes"]),
                f"{g['rpc_s']:.3f}",
                f"{g['rpc_gb_per_s']:.2f}",
                f"{g['rpc_x_tcp']:.2f}",
                f"{g['upload_s']:.3f}",
                f"{g['upload_gb_per_s']:.2f}",
                f"{g['upload_x_tcp']:.2f}",
                _f(g["accept_s_min"], "{:.3f}"),
                f"{g['fp32_equiv_gb_per_s']:.2f}",
            ]
        )
    for d in doc["sink"]:
        rows.append(
            [
                f"(diagnostic) {d['name']}",
                _mb(d["payload_bytes"]),
                f"{d['seconds']:.3f}",
                f"{d['gb_per_s']:.2f}",
                f"{d['x_tcp']:.2f}",
                "-",
                "-",
                "-",
                "-",
                "-",
            ]
        )
    out.append(
        _table(
            "Upload throughput (payload bytes / seconds)",
            [
                "path",
                "bytes",
                "RPC s",
                "GB/s",
                "x TCP",
                "upload s",
                "upload GB/s",
                "upload x TCP",
                "accept s",
                "model GB/s",
            ],
            rows,
            "RPC: client, first message to response; for the coordinator it includes decode, accept, merge and the "
            "outer step. upload: the coordinator's upload_seconds (header to payload decoded, before accept). accept: "
            "payload decoded to its submission.accepted log line (accept, merge, outer step). "
            "model GB/s: fp32 model bytes / RPC s. sink: the same RPC on the services' gRPC wiring in another "
            "process that only reads the messages (or also decodes them like the coordinator).",
        )
    )
    mem_rows = [
        [
            f"{r['codec']} {r['path']} #{r['repeat']}",
            _mb(r["payload_bytes"]),
            _mb(r["fp32_buffer_bytes"]),
            _mb(r["rss_before_bytes"]),
            _mb(r["upload_peak_increase_bytes"]),
            f"{r['upload_peak_increase_bytes'] / r['payload_bytes']:.2f}",
            _mb(r["rpc_peak_increase_bytes"]),
            f"{r['rpc_peak_increase_bytes'] / r['payload_bytes']:.2f}",
            f"{r['rpc_peak_increase_bytes'] / r['fp32_buffer_bytes']:.2f}",
            _mb(r["retained_bytes"]),
        ]
        for r in doc["uploads"]
    ]
    out.append(
        _table(
            "Coordinator memory per upload (peak RSS over the RSS just before it)",
            [
                "upload",
                "payload",
                "fp32 buffer",
                "RSS before",
                "upload peak +",
                "/ payload",
                "RPC peak +",
                "/ payload",
                "/ fp32 buffer",
                "retained",
            ],
            mem_rows,
            f"upload peak: RSS sampled every {doc['rss_interval_ms']:g} ms up to the end of the server's upload time. "
            "RPC peak: VmHWM (reset before each upload) read after the response, i.e. including accept, merge and "
            "the outer step. "
            "retained: RSS after the response minus RSS before."
            + ("" if doc["hwm_exact"] else " VmHWM could not be reset here: sampled peaks instead."),
        )
    )
    if doc["breakdown"]:
        out.append(
            _table(
                "Where the time goes (this process, one thread, no network; best of repeats)",
                ["stage", "bytes", "s", "GB/s"],
                [
                    [b["stage"], _mb(b["bytes"]), f"{b['seconds']:.3f}", f"{b['gb_per_s']:.2f}"]
                    for b in doc["breakdown"]
                ],
            )
        )
    freed = ", ".join(
        f"{c}: {'yes' if ok else 'NO (reference cycle)'}" for c, ok in doc["decoder_freed_by_refcount"].items()
    )
    out.append(f"streaming decoder (and its fp32 buffer) freed as soon as it is dropped: {freed}")
    t = doc["target"]
    out.append(
        f"target gRPC fp32 >= {t['x_tcp']:.1f}x raw TCP: whole RPC {t['rpc_x_tcp']:.2f}x -> "
        f"{'MET' if t['rpc_met'] else 'NOT MET'}; upload phase alone {t['upload_x_tcp']:.2f}x -> "
        f"{'MET' if t['upload_met'] else 'NOT MET'}"
    )
    if t.get("bulk_upload_x_tcp") is not None:
        out.append(
            f"target bulk-port fp32 >= {t['x_tcp']:.1f}x raw TCP: whole upload {t['bulk_rpc_x_tcp']:.2f}x; upload "
            f"phase alone {t['bulk_upload_x_tcp']:.2f}x -> {'MET' if t['bulk_upload_met'] else 'NOT MET'}"
        )
    return "\n".join(out)


# --- main -----------------------------------------------------------------------------------------------------
def pick_or_override(args: argparse.Namespace) -> ModelConfig:
    cfg = pick_model(args.params)
    if not (args.d_model or args.layers):
        return cfg
    d = args.d_model or cfg.d_model
    layers = args.layers or cfg.n_layers
    return ModelConfig(vocab_size=VOCAB, seq_len=SEQ_LEN, d_model=d, n_layers=layers, n_heads=max(1, d // HEAD_DIM))


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.params < 1 or args.repeats < 1:
        raise ConfigError("--params and --repeats must be >= 1")
    torch.set_num_threads(1)  # like the services: one torch thread each on small machines
    model_cfg = pick_or_override(args)
    numel = gpt_numel(model_cfg.d_model, model_cfg.n_layers, model_cfg.seq_len, model_cfg.vocab_size)
    codecs = list(dict.fromkeys(c.strip() for c in args.codecs.split(",") if c.strip()))
    if "fp32" not in codecs:
        raise ConfigError("--codecs must include fp32 (the reference payload, also sent over raw TCP)")
    tcp_s: list[float] = []
    results: list[UploadResult] = []
    sink_s: dict[tuple[str, bool], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-upload-") as tmp:
        spill = ("--spill-dir", tmp, "--spill-above", args.spill_above)
        coord = Coordinator(model_cfg, Path(tmp), max_bytes=args.max_bytes, shards=args.shards, extra=spill)
        sink: Sink | None = None
        try:
            # build the same model here for its tensor layout while the coordinator builds its own
            model = GPT(model_cfg, seed=0)
            specs = param_specs(model)
            if num_params(model) != numel:
                raise RuntimeError(f"GPT has {num_params(model)} parameters, the formula says {numel}")
            del model
            grad = torch.randn(numel, generator=torch.Generator().manual_seed(1)).mul_(1e-3)
            payloads = {c: get_codec(c).encode(grad) for c in codecs}
            del grad
            fp32 = payloads["fp32"][0]
            tcp_buf = bytearray(fp32)  # the receiver's buffer: preallocated and touched, outside the timing
            if args.sink:
                sink = Sink(args.start_timeout_s)
            coord.start(args.start_timeout_s)
            # the coordinator evaluates its initial parameters once at start: let that finish first
            evaluated = coord.wait_event("eval.done", args.start_timeout_s) is not None
            with channel(coord.address) as ch, channel(sink.address if sink else coord.address) as sink_ch:
                learner = register(coordinator_pb2_grpc.CoordinatorStub(ch), specs)
                sink_stub = coordinator_pb2_grpc.CoordinatorStub(sink_ch)
                for rep in range(1, args.repeats + 1):  # interleaved, so every path sees the same machine
                    gc.collect()
                    tcp_s.append(raw_tcp(memoryview(fp32), tcp_buf))
                    for c in codecs:
                        data, meta = payloads[c]
                        gc.collect()
                        for path in PATHS if learner.bulk_address else ("grpc",):
                            gc.collect()
                            interval_s = args.rss_interval_ms / 1e3
                            results.append(upload(learner, coord, path, c, rep, data, meta, interval_s))
                    if sink is not None:
                        for decode in (False, True):
                            for c in codecs if decode else ["fp32"]:
                                data, meta = payloads[c]
                                gc.collect()
                                seconds = sink_upload(sink_stub, data, meta, specs, decode)
                                sink_s.setdefault((c, decode), []).append(seconds)
            del tcp_buf
            coordinator_log_tail = coord.tail(5)
        finally:
            if sink is not None:
                sink.close()
            code = coord.close()
    parts = breakdown(payloads, numel, args.repeats) if args.breakdown else []

    tcp_best = min(tcp_s)
    tcp_rate = len(fp32) / tcp_best
    rows: dict[str, list[dict[str, Any]]] = {path: [] for path in PATHS}
    for path, c in ((p, c) for p in PATHS for c in codecs):
        mine = [r for r in results if r.codec == c and r.path == path]
        if not mine:
            continue
        nbytes = mine[0].payload_bytes
        rpc_s = min(r.rpc_s for r in mine)
        up_s = min(r.upload_s for r in mine)
        rows[path].append(
            {
                "path": path,
                "codec": c,
                "payload_bytes": nbytes,
                "rpc_s": rpc_s,
                "rpc_gb_per_s": nbytes / rpc_s / 1e9,
                "rpc_x_tcp": nbytes / rpc_s / tcp_rate,
                "upload_s": up_s,
                "upload_gb_per_s": nbytes / up_s / 1e9,
                "upload_x_tcp": nbytes / up_s / tcp_rate,
                "accept_apply_s_min": min(r.rpc_s - r.upload_s for r in mine),
                "accept_s_min": min((r.accept_s for r in mine if r.accept_s is not None), default=None),
                "send_s": min(r.send_s for r in mine),
                "fp32_equiv_gb_per_s": 4 * numel / rpc_s / 1e9,
            }
        )
    sink_rows = []
    for (c, decode), secs in sink_s.items():
        nbytes = len(payloads[c][0])
        best = min(secs)
        sink_rows.append(
            {
                "name": f"gRPC sink + decode {c}" if decode else f"gRPC sink, no decode ({c} bytes)",
                "codec": c,
                "decode": decode,
                "payload_bytes": nbytes,
                "seconds": best,
                "all_seconds": secs,
                "gb_per_s": nbytes / best / 1e9,
                "x_tcp": nbytes / best / tcp_rate,
            }
        )
    grpc_rows = rows["grpc"]
    fp32_row = grpc_rows[codecs.index("fp32")]
    bulk_fp32 = next((r for r in rows["bulk"] if r["codec"] == "fp32"), None)
    return {
        "env": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "grpc": grpc.__version__,
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
        },
        "model": {
            **{k: getattr(model_cfg, k) for k in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads")},
            "numel": numel,
            "params_asked": args.params,
            "fp32_bytes": 4 * numel,
        },
        "repeats": args.repeats,
        "spill_above": args.spill_above,
        "rss_interval_ms": args.rss_interval_ms,
        "chunk_bytes": CHUNK_BYTES,
        "tcp": {"bytes": len(fp32), "seconds": tcp_best, "gb_per_s": tcp_rate / 1e9, "all_seconds": tcp_s},
        "grpc": grpc_rows,
        "bulk": rows["bulk"],
        "sink": sink_rows,
        "uploads": [r.row(numel) for r in results],
        "hwm_exact": all(r.hwm_exact for r in results),
        "breakdown": parts,
        "decoder_freed_by_refcount": {c: decoder_freed_by_refcount(c) for c in codecs},
        "target": {
            "x_tcp": TARGET_X_TCP,
            "rpc_x_tcp": fp32_row["rpc_x_tcp"],
            "rpc_met": fp32_row["rpc_x_tcp"] >= TARGET_X_TCP,
            "upload_x_tcp": fp32_row["upload_x_tcp"],
            "upload_met": fp32_row["upload_x_tcp"] >= TARGET_X_TCP,
            "bulk_rpc_x_tcp": bulk_fp32["rpc_x_tcp"] if bulk_fp32 else None,
            "bulk_upload_x_tcp": bulk_fp32["upload_x_tcp"] if bulk_fp32 else None,
            "bulk_upload_met": bulk_fp32 is not None and bulk_fp32["upload_x_tcp"] >= TARGET_X_TCP,
        },
        "coordinator": {"initial_eval_seen": evaluated, "exit_code": code, "log_tail": coordinator_log_tail},
    }


def _flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", type=int, default=100_000_000, help="about this many model parameters")
    parser.add_argument("--repeats", type=int, default=2, help="best of N (memory: every upload is listed)")
    parser.add_argument("--codecs", default="fp32,int8", help="comma-separated; fp32 is the reference")
    parser.add_argument("--d-model", type=int, default=0, help="override the picked model width")
    parser.add_argument("--layers", type=int, default=0, help="override the picked number of layers")
    parser.add_argument("--max-bytes", type=int, default=400_000, help="corpus size of the coordinator")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--start-timeout-s", type=float, default=600.0)
    parser.add_argument("--rss-interval-ms", type=float, default=2.0, help="how often the coordinator's RSS is read")
    parser.add_argument("--no-breakdown", dest="breakdown", action="store_false", help="skip the in-process stages")
    parser.add_argument("--no-sink", dest="sink", action="store_false", help="skip the diagnostic gRPC sink rows")
    parser.add_argument(
        "--spill-above",
        default="never",
        help="the coordinator's --spill-above: never (uploads held in memory: the transport alone), or a size "
        "(uploads above it received into a file, as the service's default 64M does with this model's)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    return standalone(__doc__, _flags, lambda args, log: run(args), report_text, argv)


# --- the suite's `upload` section -------------------------------------------------------------------------------
FULL_ARGS = ("--params", "100000000", "--repeats", "3")
QUICK_ARGS = ("--params", "200000", "--repeats", "1")
# the same fp32 upload with the coordinator's default spill rule (64 MiB: a 100M model's uploads go to a file)
SPILLED_ARGS = ("--codecs", "fp32", "--no-breakdown", "--no-sink", "--spill-above", "64M")


def section(ctx: Context) -> dict[str, Any]:
    argv = QUICK_ARGS if ctx.quick else FULL_ARGS
    ctx.log(f"  python -m diloco.bench.bench_upload {' '.join(argv)}")
    doc = run(parser(__doc__, _flags).parse_args(argv))
    doc["argv"] = list(argv)
    doc["coordinator"].pop("log_tail", None)
    if not ctx.quick:
        spilled_argv = (*argv, *SPILLED_ARGS)
        ctx.log(f"  python -m diloco.bench.bench_upload {' '.join(spilled_argv)}")
        spilled = run(parser(__doc__, _flags).parse_args(spilled_argv))
        doc["spilled"] = {"argv": list(spilled_argv), "tcp": spilled["tcp"], "bulk": spilled["bulk"]}
    t = doc["target"]
    doc["checks"] = [
        {
            "name": "fp32 upload through the bulk port vs raw loopback TCP",
            "target": f">= {t['x_tcp']:.1f}x",
            "measured": f"{t['bulk_upload_x_tcp']:.2f}x" if t["bulk_upload_x_tcp"] is not None else "not run",
            "pass": bool(t["bulk_upload_met"]),
        }
    ]
    return doc


def _upload_rows(doc: dict[str, Any]) -> list[list[str]]:
    tcp = doc["tcp"]
    rows = [
        [
            "raw TCP socket on loopback (limit: `sendall` into `recv_into` a preallocated buffer)",
            f"{tcp['bytes'] / 1e6:,.1f} MB",
            f"{tcp['gb_per_s']:.2f} GB/s",
            "1.00",
            "",
        ]
    ]
    for g in [*doc.get("bulk", []), *doc["grpc"]]:
        path = "bulk upload port" if g["path"] == "bulk" else "gRPC `SubmitPseudoGradient`"
        rows.append(
            [
                f"{path}, {g['codec']}",
                f"{g['payload_bytes'] / 1e6:,.1f} MB",
                f"{g['upload_gb_per_s']:.2f} GB/s",
                f"{g['upload_x_tcp']:.2f}",
                f"{g['rpc_s']:.2f} s",
            ]
        )
    for d in doc["sink"]:
        rows.append(
            [
                f"(diagnostic) {d['name']}",
                f"{d['payload_bytes'] / 1e6:,.1f} MB",
                f"{d['gb_per_s']:.2f} GB/s",
                f"{d['x_tcp']:.2f}",
                "",
            ]
        )
    return rows


def summary(doc: dict[str, Any]) -> str:
    """The headline table (the repository README shows it)."""
    return table(["path", "bytes", "upload", "ratio to raw TCP", "whole call"], _upload_rows(doc))


def markdown(doc: dict[str, Any]) -> str:
    m = doc["model"]
    peak = max((u["rpc_peak_increase_bytes"] / u["fp32_buffer_bytes"] for u in doc["uploads"]), default=math.nan)
    parts = [
        f"Command: `python -m diloco.bench.bench_upload {' '.join(doc['argv'])}`. A GPT of {m['numel']:,} "
        f"parameters ({m['fp32_bytes'] / 1e6:,.0f} MB fp32); the coordinator in its own process, plaintext on "
        f"loopback like the baseline; best of {doc['repeats']}, uploads interleaved with the raw TCP baseline. "
        '"Upload" is from the first byte to the payload decoded and crc-checked in the coordinator; the whole '
        "call also includes accepting it, the merge and the outer step of the round it closes.",
        summary(doc),
        f"Coordinator memory: the largest rise of its peak RSS during one whole call was {peak:.2f}x the fp32 "
        "payload (every upload is in `results.json`).",
    ]
    if doc.get("spill_above", "never") == "never" and doc.get("spilled"):
        sp = doc["spilled"]
        bulk = next((b for b in sp["bulk"] if b["codec"] == "fp32"), None)
        if bulk is not None:
            parts.append(
                "These uploads are held in memory (`--spill-above never`): the transport alone. At the service's "
                "default (`--spill-above 64M`) a payload this size is received into a file instead, so the "
                "coordinator's memory does not grow with the uploads it holds at once. In the same run "
                f"(`{' '.join(sp['argv'])}`) the fp32 bulk upload then took {bulk['upload_s']:.2f} s, "
                f"{bulk['upload_x_tcp']:.2f}x raw TCP ({sp['tcp']['gb_per_s']:.2f} GB/s in that run), and its "
                f"accept {bulk['accept_s_min']:.2f} s (the fold reads the file back): a link slower than "
                f"{bulk['upload_gb_per_s']:.1f} GB/s, not the file, bounds such an upload here."
            )
    if doc["breakdown"]:
        parts += [
            "Where the time goes (this process, one thread, no network; best of the repeats), each stage as "
            "production runs it:",
            table(
                ["stage", "bytes", "s", "GB/s"],
                [
                    [b["stage"], f"{b['bytes'] / 1e6:,.1f} MB", f"{b['seconds']:.3f}", f"{b['gb_per_s']:.2f}"]
                    for b in doc["breakdown"]
                ],
            ),
        ]
    return "\n\n".join(parts)


if __name__ == "__main__":
    sys.exit(main())
