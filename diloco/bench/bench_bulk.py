"""Bulk data plane (`diloco.rpc.bulk`) throughput on loopback, against raw TCP, in one run.

Rows (payload of `--mb` MiB of random bytes, best of `--repeats`, the modes interleaved so that noise hits all):
- raw TCP: `sendall` in 4 MiB pieces; the receiver (a thread of this process) `recv_into` a preallocated, touched
  buffer the size of the payload and acks the last byte. The physical limit of loopback here.
- raw TCP + sink: the same, receiving into a reused 4 MiB buffer and, in the same thread, copying each buffer into
  a preallocated torch tensor and computing zlib.crc32 (what fp32 decoding does).
- bulk, null sink: `bulk_upload` to a `BulkServer` whose sink does nothing: the framing's own cost.
- bulk (overlap / serial): `bulk_upload` to a `BulkServer` whose sink copies into a preallocated torch tensor and
  computes crc32; overlap receives the next buffer while the sink handles this one (two threads), serial does both
  in one thread.
GB/s is payload bytes / seconds measured by the client, connect to answer; `x TCP` is that over raw TCP. The
target is bulk (overlap) >= 0.6x raw TCP. CPU s/GB is this process's CPU time (client and server together, every
thread; best of N) per GB: less sensitive than wall time to other load on a shared machine. Figures are noisy on a
shared machine; ratios matter.

    python -m diloco.bench.bench_bulk [--mb 400] [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import socket
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import structlog
import torch

from diloco.bench.section import Log, standalone
from diloco.rpc.bulk import BUFFER_BYTES, SEND_PIECE_BYTES, BulkServer, BulkSink, bulk_upload
from diloco.v1 import coordinator_pb2

Response = coordinator_pb2.SubmitPseudoGradientResponse
TARGET_X_TCP = 0.6


# --- sinks ----------------------------------------------------------------------------------------------------
class CopyCrcSink:
    """Copies into a preallocated (touched) torch buffer and computes crc32, as fp32 decoding does."""

    def storage(self) -> None:
        return None  # received into the server's buffers, copied here

    def __init__(self, out: torch.Tensor, work: bool = True) -> None:
        self.out = out
        self.expected_bytes = out.numel()
        self.work = work
        self.pos = 0
        self.crc = 0

    def feed(self, data: memoryview) -> None:
        n = len(data)
        if self.work:
            self.out[self.pos : self.pos + n].copy_(torch.frombuffer(data, dtype=torch.uint8))
            self.crc = zlib.crc32(data, self.crc)
        self.pos += n

    def finish(self) -> Response:
        return Response(outcome=coordinator_pb2.SUBMISSION_OUTCOME_ACCEPTED, version=self.crc)

    def interrupted(self) -> None:
        pass

    def close(self) -> None:
        pass


class Handler:
    def __init__(self, out: torch.Tensor, work: bool) -> None:
        self.out = out
        self.work = work

    def open(
        self, token: bytes, request: coordinator_pb2.SubmitPseudoGradientRequest, identity: str | None
    ) -> BulkSink | Response:
        return CopyCrcSink(self.out, self.work)


# --- raw TCP --------------------------------------------------------------------------------------------------
def raw_tcp(payload: memoryview, sink: CopyCrcSink | None, buffer_bytes: int = BUFFER_BYTES) -> float:
    """Seconds to move `payload` over a raw loopback socket (connect to ack)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    whole = torch.ones(len(payload) if sink is None else 0, dtype=torch.uint8)  # touched: pages mapped

    def receive() -> None:
        conn, _ = listener.accept()
        with conn:
            got = 0
            if sink is None:
                view = memoryview(whole.numpy())  # type: ignore[arg-type]
                while got < len(payload):
                    k = conn.recv_into(view[got:])
                    if k == 0:
                        return
                    got += k
            else:
                view = memoryview(bytearray(buffer_bytes))
                while got < len(payload):
                    want = min(len(view), len(payload) - got)
                    filled = 0
                    while filled < want:
                        k = conn.recv_into(view[filled:want])
                        if k == 0:
                            return
                        filled += k
                    sink.feed(view[:filled])
                    got += filled
            conn.sendall(b"\0")

    t = threading.Thread(target=receive, daemon=True)
    t.start()
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as s:
        for pos in range(0, len(payload), SEND_PIECE_BYTES):
            s.sendall(payload[pos : pos + SEND_PIECE_BYTES])
        if s.recv(1) != b"\0":
            raise SystemExit("raw TCP: no ack")
    dt = time.perf_counter() - t0
    t.join()
    listener.close()
    return dt


# --- bulk -----------------------------------------------------------------------------------------------------
def bulk_runner(
    payload: memoryview, out: torch.Tensor, *, work: bool, overlap: bool, buffer_bytes: int
) -> Callable[[], float]:
    server = BulkServer("127.0.0.1", 0, Handler(out, work), overlap=overlap, buffer_bytes=buffer_bytes)
    port = server.start()
    request = coordinator_pb2.SubmitPseudoGradientRequest(
        header=coordinator_pb2.SubmissionHeader(submission_id="bench", worker_id="w")
    )
    want = zlib.crc32(payload) if work else 0

    def run() -> float:
        t0 = time.perf_counter()
        r = bulk_upload(f"127.0.0.1:{port}", b"", request, payload, timeout_s=600)
        dt = time.perf_counter() - t0
        if r.version != want:
            raise SystemExit("bulk: crc mismatch")
        return dt

    run.server = server  # type: ignore[attr-defined]
    return run


def _flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mb", type=int, default=400)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--buffer-kb", type=int, default=BUFFER_BYTES >> 10, help="the server's receive buffer size")
    p.add_argument("--torch-threads", type=int, default=1)


def measure(a: argparse.Namespace, log: Log) -> dict[str, Any]:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    torch.set_num_threads(a.torch_threads)
    size = a.mb << 20
    buf = a.buffer_kb << 10
    payload = memoryview(torch.randint(0, 256, (size,), dtype=torch.uint8).numpy().tobytes())
    out = torch.ones(size, dtype=torch.uint8)  # touched: mapped pages, like the coordinator's buffer pool
    crc_sink_out = torch.ones(size, dtype=torch.uint8)
    runners: dict[str, Callable[[], float]] = {
        "raw TCP": lambda: raw_tcp(payload, None),
        "raw TCP + sink": lambda: raw_tcp(payload, CopyCrcSink(crc_sink_out), buf),
        "bulk, null sink": bulk_runner(payload, out, work=False, overlap=True, buffer_bytes=buf),
        "bulk (overlap)": bulk_runner(payload, out, work=True, overlap=True, buffer_bytes=buf),
        "bulk (serial)": bulk_runner(payload, out, work=True, overlap=False, buffer_bytes=buf),
    }
    best = {k: math.inf for k in runners}
    cpu = {k: math.inf for k in runners}
    try:
        for _ in range(a.repeats):
            for name, run in runners.items():
                c0 = time.process_time()
                best[name] = min(best[name], run())
                cpu[name] = min(cpu[name], time.process_time() - c0)
    finally:
        for run in runners.values():
            server = getattr(run, "server", None)
            if server is not None:
                server.stop()
    tcp = size / best["raw TCP"] / 1e9
    rows = {
        k: {"gbps": size / v / 1e9, "x_tcp": size / v / 1e9 / tcp, "cpu_s_per_gb": cpu[k] / (size / 1e9)}
        for k, v in best.items()
    }
    return {"mb": a.mb, "repeats": a.repeats, "buffer_kb": a.buffer_kb, "cpus": os.cpu_count(), "rows": rows}


def text(r: dict[str, Any]) -> str:
    lines = [f"{r['mb']} MiB, best of {r['repeats']}, {r['cpus']} CPUs, {r['buffer_kb']} KiB receive buffers"]
    for k, x in r["rows"].items():
        lines.append(f"  {k:<18} {x['gbps']:6.2f} GB/s  {x['x_tcp']:5.2f}x TCP  {x['cpu_s_per_gb']:5.2f} CPU s/GB")
    ok = r["rows"]["bulk (overlap)"]["x_tcp"] >= TARGET_X_TCP
    lines.append(f"target bulk (overlap) >= {TARGET_X_TCP}x TCP: {'met' if ok else 'NOT met'}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    return standalone(__doc__, _flags, measure, text, argv)


if __name__ == "__main__":
    raise SystemExit(main())
