"""The coordinator's end of the bulk upload path (`diloco.rpc.bulk`): the same upload as `SubmitPseudoGradient`
(header checks, idempotent submission ids, resumable byte offsets, chunk-by-chunk decoding, accept) on the
coordinator's `CoordinatorState`, with the payload read from a plain byte stream instead of gRPC messages. The
token is checked as the gRPC interceptor checks it for `SubmitPseudoGradient`."""

from __future__ import annotations

from diloco.errors import PermissionDenied, Unauthenticated
from diloco.rpc import auth
from diloco.rpc.bulk import BulkSink
from diloco.task.params import ParamSpec
from diloco.v1 import coordinator_pb2
from services.coordinator.servicer import open_submission, submit_response
from services.coordinator.state import CoordinatorState, UploadStream

SUBMIT_METHOD = f"/{auth.COORDINATOR_SERVICE}/SubmitPseudoGradient"


class _UploadSink:
    """One bulk connection feeding one upload: the `UploadStream` the gRPC path uses, answering in protos."""

    def __init__(self, stream: UploadStream, epoch: int) -> None:
        self.stream, self.epoch = stream, epoch
        self.expected_bytes = stream.expected_bytes

    def storage(self) -> memoryview | None:
        return self.stream.storage()  # the payload is received into the upload's own buffer

    def feed(self, data: memoryview) -> None:
        self.stream.feed(data)

    def interrupted(self) -> None:
        self.stream.interrupted()

    def close(self) -> None:
        self.stream.close()

    def finish(self) -> coordinator_pb2.SubmitPseudoGradientResponse:
        return submit_response(self.stream.finish(), self.epoch)


class BulkUploads:
    """`diloco.rpc.bulk.BulkHandler` for the coordinator. `tokens` None: no token required (plaintext on loopback,
    as the gRPC side)."""

    def __init__(self, state: CoordinatorState, specs: list[ParamSpec], tokens: auth.Tokens | None) -> None:
        self.state = state
        self.specs = specs
        self.tokens = tokens

    def open(
        self, token: bytes, request: coordinator_pb2.SubmitPseudoGradientRequest, identity: str | None
    ) -> BulkSink | coordinator_pb2.SubmitPseudoGradientResponse:
        if self.tokens is not None:
            denied = auth.check(self.tokens, SUBMIT_METHOD, token.decode("utf-8", "replace") or None)
            if denied is not None:
                kind = Unauthenticated if denied.code.name == "UNAUTHENTICATED" else PermissionDenied
                raise kind(denied.message)
        opened = open_submission(self.state, request, self.specs, identity)
        if isinstance(opened, coordinator_pb2.SubmitPseudoGradientResponse):
            return opened  # a duplicate: the earlier outcome, nothing changes
        return _UploadSink(opened, self.state.epoch)
