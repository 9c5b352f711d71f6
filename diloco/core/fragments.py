"""Streaming fragments (Streaming DiLoCo, arXiv 2501.18512; ALGORITHM.md section 10). Pure: no gRPC, no clock.

The flat parameter vector is cut into P **fragments**: contiguous ranges cut at parameter-tensor boundaries,
balanced by numel (`FragmentLayout`, with a fingerprint both sides compare). Fragment p is synchronised at the
inner steps t > 0 with `t ≡ p·⌊H/P⌋ (mod H)` (`schedule_gap`), each time alone: a learner sends 1/P of the model
about P times as often, so the bytes on a link per unit time peak about P times lower, and the upload and the
broadcast of one fragment overlap the training of the next steps.

Protocol (core and simulator; the gRPC services adopt it later, see docs/fragments.md):

- A learner's submission names one fragment `p` and carries `Δ[p] = θ̂_base[p] − θ[p]` (1/P of the model), the
  ledger ranges, tokens and steps it trained **since its previous submission of any fragment**, and its base
  version (the newest global version it holds). The ledger therefore sees every token once, in order, whatever
  P; tokens applied count each token once (not once per fragment).
- `FragmentedCoordinator` composes one `CoordinatorCore` (registry, ledger, placement, round policy, guard,
  duplicate detection: all unchanged) with P merge accumulators, P outer optimisers (their own momentum) and P
  fragment step counts. A round closes by the same policy as before; it takes the outer step of every fragment
  with a submission in it, each from the token-weighted merge of that fragment's submissions, and leaves the
  others as they are. The global version still counts rounds; `fragment_versions[p]` is the version of the last
  round that stepped p, `fragment_steps[p]` how many rounds stepped it.
- Broadcasts are per fragment (`FragmentShadows`): a round sends the fragments it stepped, each a delta of its
  own shadow `Θ̂[p]` (downlink error feedback per fragment), never the fragments it left alone.
- The learner rebases only the fragments whose `fragment_versions` passed its base version:
  `θ[p] ← Θ̂_new[p] + (θ[p] − base[p])`, `base[p] ← Θ̂_new[p]`; the other fragments keep their local progress
  (including what is in flight in their own submission). After a submission of p, `base[p] ← θ[p]` only.
- Weights: a fragment's merge weight is the submission's tokens, the tokens of about H_m/P steps; learners
  submit every fragment at the same cadence, so these weights are proportional to the tokens behind each Δ[p].
- The norm guard (`diloco.core.guard`) keeps one window of norms per fragment: a fragment's per-step norm is
  judged against the median of that fragment's.
- P = 1 is not this module: the simulator and services use `CoordinatorCore` and whole-vector rebases exactly
  as before.

Refused (`InvalidArgument`, nothing changed): a fragment index out of range, a layout fingerprint other than the
coordinator's, a pseudo-gradient whose length is not the fragment's. Duplicates are refused by the core
(`AlreadyExists`), so nothing is applied twice.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from diloco.core.broadcast import BroadcastShadow, Delta
from diloco.core.coordinator import (
    AcceptResult,
    ClosedRound,
    CoordinatorConfig,
    CoordinatorCore,
    RoundApplied,
    Submission,
)
from diloco.core.guard import NormGuard
from diloco.core.merge import EncodedDelta, MergeAccumulator, Segment
from diloco.core.outer import OuterOptimizer, build_outer
from diloco.core.rounds import CloseReason, Pending
from diloco.errors import ConfigError, InvalidArgument

__all__ = [
    "FragmentLayout",
    "FragmentShadows",
    "FragmentedCoordinator",
    "check_fragments",
    "first_fragment",
    "layout_for",
    "schedule_gap",
    "step_fragment",
]


def check_fragments(fragments: object, local_steps: int, num_tensors: int | None = None) -> int:
    """Validate P: an integer >= 1, <= H (fragment offsets p·⌊H/P⌋ must differ) and, once the model is known,
    <= its number of parameter tensors (a fragment is whole tensors). Returns P; ConfigError says what to do."""
    if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1:
        raise ConfigError(f"fragments must be an integer >= 1 (1: no fragments), got {fragments!r}")
    if fragments > local_steps:
        raise ConfigError(
            f"fragments ({fragments}) must be <= H (local_steps = {local_steps}): fragment p syncs at inner steps "
            "p·⌊H/P⌋ mod H, which must differ; raise H or use fewer fragments"
        )
    if num_tensors is not None and fragments > num_tensors:
        raise ConfigError(
            f"fragments ({fragments}) must be <= the model's {num_tensors} parameter tensors: a fragment is whole "
            "tensors; use fewer fragments"
        )
    return fragments


def schedule_gap(fragment: int, fragments: int, local_steps: int) -> int:
    """Inner steps between the submission of the fragment before `fragment` and that of `fragment`: fragment p is
    due at steps ≡ p·⌊H/P⌋ (mod H), so the gaps are ⌊H/P⌋, and H − (P−1)·⌊H/P⌋ before fragment 0 (equal when P
    divides H). With P = 1 it is H. An H_m below P (a slow learner's) gives a gap of 1."""
    s = local_steps // fragments
    if s == 0:
        return 1
    return local_steps - (fragments - 1) * s if fragment == 0 else s


def first_fragment(fragment_versions: Sequence[int]) -> int:
    """The fragment a learner submits first after adopting parameters: the one after the most recently stepped
    fragment (the newest version, the highest index among equals), so a joiner falls in with the others' phase;
    1 (mod P) before any step, as fragment 0 is due at step H."""
    p = len(fragment_versions)
    if p <= 1 or len(set(fragment_versions)) == 1:
        return 1 % max(1, p)
    last = max(range(p), key=lambda i: (fragment_versions[i], i))
    return (last + 1) % p


@dataclass(frozen=True)
class FragmentLayout:
    """P contiguous ranges `[bounds[p], bounds[p+1])` of the flat vector, cut at tensor boundaries."""

    bounds: tuple[int, ...]  # P + 1 offsets, 0 first and numel last

    @classmethod
    def balanced(cls, tensor_numels: Sequence[int], fragments: int) -> FragmentLayout:
        """Cut after whole tensors, in order, so that each fragment's numel is as close as possible to numel/P:
        fragment p ends at the tensor boundary nearest (p+1)·numel/P, leaving at least one tensor for each
        fragment after it."""
        n = len(tensor_numels)
        if not 1 <= fragments <= n:
            raise ConfigError(f"fragments must be in [1, {n}] (the parameter tensors), got {fragments}")
        ends = [0]
        for size in tensor_numels:
            ends.append(ends[-1] + size)
        total = ends[-1]
        cuts = [0]
        for p in range(1, fragments):
            lo, hi = cuts[-1] + 1, n - (fragments - p)  # tensor indices the cut may follow
            target = p * total / fragments
            cuts.append(min(range(lo, hi + 1), key=lambda i: (abs(ends[i] - target), i)))
        cuts.append(n)
        return cls(tuple(ends[i] for i in cuts))

    @classmethod
    def of_segments(cls, segments: Sequence[Segment], fragments: int) -> FragmentLayout:
        return cls.balanced([s.numel for s in segments], fragments)

    def __post_init__(self) -> None:
        b = self.bounds
        if len(b) < 2 or b[0] != 0 or any(x >= y for x, y in itertools.pairwise(b)):
            raise ConfigError(f"fragment bounds must start at 0 and increase strictly, got {b}")

    @property
    def fragments(self) -> int:
        return len(self.bounds) - 1

    @property
    def numel(self) -> int:
        return self.bounds[-1]

    def range(self, p: int) -> tuple[int, int]:
        self.check_index(p)
        return self.bounds[p], self.bounds[p + 1]

    def size(self, p: int) -> int:
        lo, hi = self.range(p)
        return hi - lo

    def view(self, flat: torch.Tensor, p: int) -> torch.Tensor:
        """Fragment p of a flat vector: a view (writes go to `flat`)."""
        lo, hi = self.range(p)
        return flat[lo:hi]

    def segments(self, segments: Sequence[Segment], p: int) -> list[Segment]:
        """The merge segments of fragment p, re-based at 0 (RDA works per tensor inside a fragment)."""
        lo, hi = self.range(p)
        inside = [Segment(s.offset - lo, s.numel, s.embedding) for s in segments if lo <= s.offset < hi]
        if sum(s.numel for s in inside) != hi - lo:
            raise ConfigError(f"fragment {p} [{lo}, {hi}) does not fall on tensor boundaries")
        return inside

    @property
    def fingerprint(self) -> str:
        """A short stable hash of the bounds: learner and coordinator must agree on it."""
        return hashlib.sha256(",".join(map(str, self.bounds)).encode()).hexdigest()[:16]

    def check_index(self, p: object) -> int:
        if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < self.fragments:
            raise InvalidArgument(
                f"fragment index {p!r} is out of range: this layout has fragments 0..{self.fragments - 1}"
            )
        return p

    def check_fingerprint(self, fingerprint: str) -> None:
        if fingerprint != self.fingerprint:
            raise InvalidArgument(
                f"fragment layout {fingerprint!r} is not the coordinator's ({self.fingerprint}, {self.fragments} "
                "fragments): fetch the layout again and resync"
            )


def step_fragment(
    layout: FragmentLayout,
    params: torch.Tensor,
    outer: OuterOptimizer,
    p: int,
    delta: torch.Tensor,
    learners: int,
    *,
    scratch_delta: bool = False,
) -> None:
    """The outer step of fragment p: `outer` (p's own) told the live learners, then stepped on p's slice of
    `params` with `delta` (p's merged Δ). The one rule for the leader (`FragmentedCoordinator.step`) and a standby
    replaying its round log (`diloco.core.replication.Standby.apply`), so both get the same bits."""
    outer.set_num_learners(learners)
    outer.step(layout.view(params, p), delta, scratch_delta=scratch_delta)


def layout_for(fragments: int, local_steps: int, segments: Sequence[Segment]) -> FragmentLayout | None:
    """The layout a coordinator (leader or standby) with `--fragments P` cuts its model into (`segments`: one per
    parameter tensor), P checked (`check_fragments`); None for P = 1 (no fragments)."""
    if fragments <= 1:
        check_fragments(fragments, local_steps)
        return None
    return FragmentLayout.of_segments(segments, check_fragments(fragments, local_steps, len(segments)))


@dataclass(frozen=True)
class FragmentSubmission:
    """A submission of fragment `fragment` under layout `fingerprint` (the core's `Submission` otherwise)."""

    sub: Submission
    fragment: int
    fingerprint: str


class FragmentedCoordinator:
    """One `CoordinatorCore` for everything but the tensor work, which is per fragment (see the module docstring).

    The core's own merge buffer and outer optimiser are not used; `cfg.scale_partial_rounds` is applied here,
    per fragment. Drive it with `accept` and `poll` (at the core's `next_deadline()`); every other call
    (register, remove, plan, ...) goes to `core`."""

    def __init__(
        self,
        cfg: CoordinatorConfig,
        params: torch.Tensor,
        shard_lengths: Sequence[int],
        layout: FragmentLayout,
        segments: Sequence[Segment] | None = None,
    ) -> None:
        if layout.numel != params.numel():
            raise ConfigError(f"fragment layout covers {layout.numel} values; the model has {params.numel()}")
        # the core would judge partial rounds by whole-model steps: that rule is applied here, per fragment
        core = CoordinatorCore(replace(cfg, scale_partial_rounds=False), params, shard_lengths, segments)
        self.core = core
        self.layout = layout
        self.scale_partial = cfg.scale_partial_rounds
        segs = core.segments
        self.accs = [  # RDA works per tensor: each fragment's own tensors
            MergeAccumulator(layout.size(p), core.cfg.merge, layout.segments(segs, p) if segs else None)
            for p in range(layout.fragments)
        ]
        self.outers: list[OuterOptimizer] = [build_outer(core.cfg.outer) for _ in range(layout.fragments)]
        self.fragment_versions = [core.version] * layout.fragments
        self.fragment_steps = [0] * layout.fragments
        # the norm guard's median per fragment: fragments differ in size and layers, so their per-step norms do
        # (by 10x on the tiny test GPT: one median would refuse the larger fragment's as outliers)
        self.guards = [NormGuard(core.cfg.guard) for _ in range(layout.fragments)]
        self._fragment_of: dict[str, int] = {}  # pending submission id -> fragment
        # learner -> per fragment, the inner steps of its submissions since its last one of that fragment
        self._steps_since: dict[str, list[int]] = {}
        # the round log for standbys: called with (version, p, Δ[p], learners) just before fragment p's outer step
        # (Δ[p] is the merge buffer, reused: copy it)
        self.on_step: Callable[[int, int, torch.Tensor, int], None] | None = None

    @property
    def fragments(self) -> int:
        return self.layout.fragments

    def check(self, fs: FragmentSubmission, delta: torch.Tensor | EncodedDelta) -> float:
        """Everything about the fragment itself, before any state changes: index, layout, length. Returns the
        pseudo-gradient's norm per inner step (for the core's guard). `delta`: a tensor, or an upload held encoded
        (`EncodedDelta`, measured on arrival against the fragment's segments)."""
        p = self.layout.check_index(fs.fragment)
        self.layout.check_fingerprint(fs.fingerprint)
        numel = delta.meta.numel if isinstance(delta, EncodedDelta) else delta.numel()
        flat = isinstance(delta, EncodedDelta) or delta.dim() == 1
        if numel != self.layout.size(p) or not flat:
            raise InvalidArgument(
                f"pseudo-gradient of fragment {p} has {numel} elements; the fragment has {self.layout.size(p)}"
            )
        norm = delta.norm() if isinstance(delta, EncodedDelta) else float(torch.linalg.vector_norm(delta))
        return norm / max(1, self.steps_behind(fs))

    def steps_behind(self, fs: FragmentSubmission) -> int:
        """The inner steps behind `Δ_m[p]`: every step since the learner's previous submission of p (or since it
        adopted parameters), not only the `steps` since its previous submission of any fragment, which are about
        1/P of them. The guard's per-step norm divides by these (else every fragment would look P times larger, and
        a submission right after another, with few steps, an outlier)."""
        since = self._steps_since.get(fs.sub.worker_id)
        return fs.sub.steps + (since[fs.fragment] if since is not None else 0)

    def accept(self, fs: FragmentSubmission, delta: torch.Tensor, now: float) -> AcceptResult:
        """Validate, take (the core's bookkeeping: admission, ledger, pending), fold into the fragment's buffer,
        and close a round if the policy says so."""
        per_step = self.check(fs, delta)
        taken = self.take(fs, per_step, now)
        self.fold(fs.fragment, delta, fs.sub.tokens)
        applied = self.poll(now)
        return replace(taken, round=applied.version if applied else taken.round, applied=applied)

    def take(self, fs: FragmentSubmission, per_step: float, now: float) -> AcceptResult:
        """The bookkeeping of an acceptance (`CoordinatorCore.take`), given `check`'s norm, and which fragment the
        submission is of; the caller `fold`s it next, before the round can close (the service's split path)."""
        taken = self.core.take(fs.sub, per_step, now, self.guards[fs.fragment])
        self._fragment_of[fs.sub.submission_id] = fs.fragment
        if len(self._steps_since) > 2 * len(self.core.workers):  # records of departed learners go
            self._steps_since = {w: v for w, v in self._steps_since.items() if w in self.core.workers}
        since = self._steps_since.setdefault(fs.sub.worker_id, [0] * self.fragments)
        for q in range(self.fragments):
            since[q] = 0 if q == fs.fragment else since[q] + fs.sub.steps
        return taken

    def fold(self, fragment: int, delta: torch.Tensor | EncodedDelta, tokens: int) -> None:
        """Tensor work: add a taken pseudo-gradient of `fragment` to that fragment's merge buffer."""
        self.accs[fragment].add(delta, tokens)

    def segments_of(self, p: int) -> list[Segment]:
        """Fragment p's merge segments (what an upload of it is measured against on arrival)."""
        return self.accs[p].segments

    def poll(self, now: float) -> RoundApplied | None:
        closed = self.core.close(now)
        return self.step(closed) if closed else None

    def step(self, closed: ClosedRound) -> RoundApplied:
        """The outer step of every fragment with a submission in the round, each on its slice of `core.params`."""
        close = closed.close
        which = {s.submission_id: self._fragment_of.pop(s.submission_id) for s in close.submissions}
        stepped = sorted(set(which.values()))
        tokens, sq = 0, 0.0
        for p in stepped:
            acc = self.accs[p]
            delta = acc.result()
            tokens += acc.tokens
            scale = self._fraction(close.reason, close.submissions, which, p)
            if scale < 1.0:
                delta.mul_(scale)
            sq += float(torch.linalg.vector_norm(delta)) ** 2
            if self.on_step is not None:
                self.on_step(close.version, p, delta, closed.learners)
            step_fragment(self.layout, self.core.params, self.outers[p], p, delta, closed.learners, scratch_delta=True)
            acc.reset()
            self.fragment_versions[p] = close.version
            self.fragment_steps[p] += 1
        self.core.mark_stepped(close.version)
        return RoundApplied(
            close.version, close.submissions, tokens, close.max_staleness, math.sqrt(sq), close.reason, close.closed_at
        )

    def stepped_in(self, version: int) -> list[int]:
        """The fragments round `version` stepped (valid right after it, for the broadcast)."""
        return [p for p, v in enumerate(self.fragment_versions) if v == version]

    def _fraction(self, reason: CloseReason, subs: Sequence[Pending], which: Mapping[str, int], p: int) -> float:
        """`CoordinatorCore._round_fraction` for one fragment: its inner steps in the round over those plus the gap
        (H_m's share of one fragment) of every expected learner with no submission of p in it."""
        if not self.scale_partial or reason != CloseReason.QUORUM_GRACE:
            return 1.0
        mine = [s for s in subs if which[s.submission_id] == p]
        held = {s.worker_id for s in mine}
        steps_in = sum(s.steps for s in mine)
        missing = sum(
            schedule_gap(p, self.fragments, self.core.plan(w).local_steps)
            for w in self.core.policy.expected - held
            if w in self.core.workers
        )
        return 1.0 if steps_in <= 0 or missing <= 0 else steps_in / (steps_in + missing)

    # --- checkpoints ------------------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The core's snapshot plus the layout, each fragment's outer state, version and step count."""
        snap = self.core.snapshot()
        snap["fragments"] = {
            "bounds": list(self.layout.bounds),
            "fingerprint": self.layout.fingerprint,
            "outer": [dict(o.state_dict()) for o in self.outers],
            "versions": list(self.fragment_versions),
            "steps": list(self.fragment_steps),
            "guard_norms": [g.snapshot() for g in self.guards],
        }
        return snap

    def restore(self, snap: Mapping[str, Any], learners_at: float | None = None, *, adopt: bool = False) -> None:
        """Adopt a snapshot written with the same layout (InvalidArgument otherwise, nothing changed);
        `learners_at` and `adopt` as for `CoordinatorCore.restore` (a standby's state at a promotion keeps its
        learner table; the outer states' tensors are taken, not copied)."""
        frag = snap.get("fragments")
        if not isinstance(frag, Mapping):
            raise InvalidArgument("checkpoint has no fragment state: it was written without fragments (--fragments 1)")
        try:
            bounds = tuple(int(b) for b in frag["bounds"])
            outer = list(frag["outer"])
            versions, steps = [int(v) for v in frag["versions"]], [int(s) for s in frag["steps"]]
            guards = [[float(n) for n in g] for g in frag.get("guard_norms", [[]] * len(versions))]
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidArgument(f"checkpoint fragment state is malformed: {e}") from e
        if bounds != self.layout.bounds or frag.get("fingerprint") != self.layout.fingerprint:
            raise InvalidArgument(
                f"checkpoint fragment layout {frag.get('fingerprint')!r} is not this run's "
                f"({self.layout.fingerprint}); restart with the --fragments the checkpoint was written with"
            )
        if not len(outer) == len(versions) == len(steps) == len(guards) == self.fragments:
            raise InvalidArgument(f"checkpoint fragment state does not hold {self.fragments} fragments")
        self.core.restore(dict(snap), learners_at, adopt=adopt)
        for o, state in zip(self.outers, outer, strict=True):
            o.load_state_dict(state, clone=not adopt)
        self.fragment_versions, self.fragment_steps = versions, steps
        for g, norms in zip(self.guards, guards, strict=True):
            g.restore(norms)
        self._fragment_of = {}
        self._steps_since = {}
        for acc in self.accs:
            acc.reset()


class FragmentShadows:
    """One `BroadcastShadow` per fragment, each with its own sequence (its fragment step count), so a round
    broadcasts only the fragments it stepped, each as a delta of its own shadow `Θ̂[p]`."""

    def __init__(self, params: torch.Tensor, layout: FragmentLayout, codec: str) -> None:
        self.layout = layout
        self.shadows = [BroadcastShadow(layout.view(params, p), 0, codec) for p in range(layout.fragments)]

    def advance(self, params: torch.Tensor, p: int, step: int) -> Delta | None:
        """Fragment p reached its `step`-th outer step: move its shadow (`BroadcastShadow.advance`, then `record`)."""
        delta = self.shadows[p].advance(self.layout.view(params, p), step)
        self.shadows[p].record(delta)
        return delta

    @property
    def shadow(self) -> torch.Tensor:
        """`Θ̂` of the whole model (a new tensor)."""
        return torch.cat([s.shadow for s in self.shadows])
