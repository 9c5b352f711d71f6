"""The learner's registration with the coordinator, and the translations between its protos and the learner
core's domain types (`WorkPlan`, `SubmissionDraft`). Enum values go through `diloco.rpc.vocab`: an unknown one
is an error (`InvalidArgument`), never a default."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from diloco.core.codecs import EncodedMeta
from diloco.core.coordinator import Lease, WorkPlan
from diloco.core.fragments import FragmentLayout
from diloco.core.learner import SubmissionDraft
from diloco.core.rounds import MODES as ROUND_MODES
from diloco.errors import ConfigError
from diloco.rpc.payload import meta_to_proto
from diloco.rpc.vocab import CODECS, MODES
from diloco.task.params import ParamSpec
from diloco.v1 import common_pb2, coordinator_pb2

assert set(MODES.names) == set(ROUND_MODES)


@dataclass(frozen=True)
class Registration:
    """What Register answered, in domain terms."""

    worker_id: str
    epoch: int
    version: int
    mode: str
    codec: str
    plan: WorkPlan
    task_json: str
    healthd_address: str
    bulk_port: int  # 0: upload over gRPC
    task_fingerprint: str  # the coordinator's (diloco.task.factory); "": an older coordinator, not checked
    init_seed: int  # the seed of the coordinator's version 0
    # streaming fragments (docs/fragments.md): the run's P (1: none), its layout's bounds and fingerprint
    fragments: int = 1
    fragment_bounds: tuple[int, ...] = ()
    fragment_layout: str = ""

    @classmethod
    def from_proto(cls, r: coordinator_pb2.RegisterResponse) -> Registration:
        """Raises `InvalidArgument` for a mode or codec this build does not know."""
        return cls(
            worker_id=r.worker_id,
            epoch=r.coordinator_epoch,
            version=r.version,
            mode=MODES.from_proto(r.mode),
            codec=CODECS.from_proto(r.codec),
            plan=plan_from_proto(r.plan, r.version),
            task_json=r.task_json,
            healthd_address=r.healthd_address,
            bulk_port=r.bulk_port,
            task_fingerprint=r.task_fingerprint,
            init_seed=r.init_seed,
            fragments=max(1, r.fragments),
            fragment_bounds=tuple(r.fragment_bounds),
            fragment_layout=r.fragment_layout,
        )

    def layout(self, specs: Sequence[ParamSpec], numel: int) -> FragmentLayout | None:
        """The coordinator's fragment layout (None: no fragments), checked against the model built here: its bounds
        cover the model and fall on tensor boundaries, and their fingerprint is the one named. `ConfigError`
        otherwise: this learner cannot cut its pseudo-gradients as the coordinator expects."""
        if self.fragments <= 1:
            return None
        layout = FragmentLayout(self.fragment_bounds)  # ConfigError for bounds that do not increase from 0
        cuts = {s.offset for s in specs} | {numel}
        if layout.fragments != self.fragments or layout.numel != numel or not set(layout.bounds) <= cuts:
            raise ConfigError(
                f"the coordinator's fragment layout {list(self.fragment_bounds)} ({self.fragments} fragments) does "
                f"not cut this model of {numel} parameters at tensor boundaries; check the task"
            )
        if layout.fingerprint != self.fragment_layout:
            raise ConfigError(
                f"the coordinator's fragment layout fingerprint {self.fragment_layout!r} is not that of its bounds "
                f"({layout.fingerprint}); check the coordinator's version"
            )
        return layout


@dataclass(frozen=True)
class Broadcast:
    """One version of the global parameters as the watch stream delivered it (the tensor travels beside it)."""

    worker_id: str  # the session that received it
    version: int
    epoch: int
    plan: WorkPlan | None
    applied: tuple[str, ...]
    finished: bool
    bulk_port: int | None = None  # the sending coordinator's bulk port (0: none); None: not a learner's header
    fragment_versions: tuple[int, ...] = ()  # streaming fragments: the version that last stepped each (() none)

    @classmethod
    def from_proto(cls, worker_id: str, h: coordinator_pb2.ParametersHeader) -> Broadcast:
        plan = plan_from_proto(h.plan, h.version) if h.HasField("plan") else None
        bulk_port = h.bulk_port if plan is not None else None
        applied = tuple(h.applied_submission_ids)
        versions = tuple(h.fragment_versions)
        return cls(worker_id, h.version, h.coordinator_epoch, plan, applied, h.finished, bulk_port, versions)


def plan_from_proto(p: common_pb2.WorkPlan, version: int) -> WorkPlan:
    return WorkPlan(tuple(Lease(s.shard_id, s.epoch, s.cursor) for s in p.shards), p.local_steps, p.plan_seq, version)


def header_of(
    draft: SubmissionDraft, meta: EncodedMeta, specs: Sequence[ParamSpec], layout: str = ""
) -> coordinator_pb2.SubmissionHeader:
    """`layout`: the fragment layout's fingerprint when the payload is fragment `draft.fragment` ("": whole)."""
    return coordinator_pb2.SubmissionHeader(
        worker_id=draft.worker_id,
        coordinator_epoch=draft.coordinator_epoch,
        submission_id=draft.submission_id,
        base_version=draft.base_version,
        tokens=draft.tokens,
        steps=draft.steps,
        ranges=[
            common_pb2.ShardRange(shard_id=r.shard_id, epoch=r.epoch, start=r.start, end=r.end) for r in draft.ranges
        ],
        payload=meta_to_proto(meta, specs),
        plan_seq=draft.plan_seq,
        fragment=draft.fragment if layout else 0,
        fragment_layout=layout,
    )


@dataclass(frozen=True)
class SessionLost:
    """Posted by a thread that learned the registration is gone (REREGISTER)."""

    worker_id: str
    reason: str
