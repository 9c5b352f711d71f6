"""A learner as a process group: an island of N ranks started by `torchrun` (issue #12).

Rank 0 (the leader) runs the `Worker` loop as a single-process learner does: it alone talks to the coordinator
and healthd, and the learner core decides on it alone. Every torch action the loop carries out is sent to the
other ranks (followers) first, inside the group, so every rank does it together:

- `SESSION` (a registration): the task JSON and the coordinator's task fingerprint; every rank (re)builds
  the task, checks its fingerprint, and wraps the replica in DistributedDataParallel (its constructor broadcasts
  rank 0's parameters);
- `TRAIN` (one inner step): the shard and cursor. The task's `inner.batch_size` B is the island's global batch:
  every rank reads the same batch of the shard layout at the cursor (`Corpus.batch(shard, cursor, B, T)`) and
  trains on its own slice of B/N rows; DDP averages the gradients, so the step is one step over the B rows, the
  cursor moves by B·T exactly as for a one-process learner and the ledger sees one learner reading the ranges it
  reports, each token by one rank only;
- `PARAMS` (after a `Load` or `Rebase` on rank 0): rank 0's parameters and its step count (the learning-rate
  schedule), broadcast from rank 0; the pseudo-gradient and error feedback live on rank 0 only (every rank holds
  the same parameters after each DDP step, so rank 0's replica is the island's);
- `STOP`: the leader's exit status; followers return it.

Sharded mode (`--shard-model true`, for models that do not fit one device): every rank wraps its replica with
FSDP2 (`fully_shard`: each transformer block, i.e. each element of a `ModuleList`, then the whole model) instead
of DDP, so each rank holds 1/N of the parameters, gradients and AdamW state; `TRAIN` is unchanged (the step is one
step over the global batch, FSDP averaging the gradients). The flat vectors of the outer loop (Θ_base,
θ_at_submit, the pseudo-gradient, error feedback) are used on rank 0 alone, in its host memory (each rank builds
the whole model in host memory before sharding it, so host memory must hold the model once per rank). The
trainer reads and writes its parameters through `ShardedParams`, whose every read is a gather of the full
parameters onto rank 0's host and every write a scatter from rank 0 into every rank's shards, a parameter at a
time (`gather_flat`, `scatter_flat_`): collectives, so the leader announces each one first and the followers join
it. Each names a range of whole parameters `[a, b)`: the whole model, or one streaming fragment's tensors.

- `GATHER`: every rank takes part in gathering the parameters onto rank 0 (before a pseudo-gradient, a rebase);
- `SCATTER`: rank 0's new parameters into every rank's shards (a load, a rebase);
- `PARAMS` then carries only the step count.

A session builds the trainer on every rank at once, and its first read of the parameters is a gather all ranks
make unannounced. Digests (`--island-checksums`) are then of each rank's own shards. `--shard-model` needs an
island: with `--nproc-per-node 1` and no torchrun around it the worker refuses it (exit status 2); under
torchrun a group of one rank is allowed (FSDP over one rank: correct, and no smaller than the model).

Followers never open a channel. A follower ignores SIGTERM/SIGINT (torchrun sends them to every rank): the
leader drains and then sends `STOP`. When the leader dies, the followers' next collective fails and torchrun
ends (or restarts, `--max-restarts`) the group.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import gc
import hashlib
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Protocol

import structlog
import torch
import torch.distributed as dist

from diloco.errors import ConfigError
from diloco.task.inner import InnerTrainer
from diloco.task.params import flatten_params, gather_flat, load_flat_, local_shards, num_params, scatter_flat_

# A collective waits this long for the other ranks: the leader may sit in a coordinator outage (retrying for as
# long as it takes) while the followers wait for its next command, so the wait is long; a dead rank is noticed at
# once anyway (its sockets close).
COLLECTIVE_TIMEOUT = datetime.timedelta(days=7)
_PR_SET_PDEATHSIG = 1  # prctl(2)


class Op(IntEnum):
    SESSION = 1
    TRAIN = 2
    PARAMS = 3
    STOP = 4
    GATHER = 5  # sharded islands: every rank gathers the parameters [a, b) onto rank 0
    SCATTER = 6  # sharded islands: rank 0's parameters [a, b) into every rank's shards


@dataclass(frozen=True)
class Rank:
    """Where this process sits in its island, from torchrun's environment."""

    rank: int
    world: int
    local_rank: int

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Rank | None:
        """None without torchrun (no `RANK`/`WORLD_SIZE`): a one-process learner, exactly as before islands."""
        if "RANK" not in env or "WORLD_SIZE" not in env:
            return None
        try:
            rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
            local = int(env.get("LOCAL_RANK", env["RANK"]))
        except ValueError as e:
            raise ConfigError(f"RANK, WORLD_SIZE and LOCAL_RANK must be integers (torchrun sets them): {e}") from e
        if not (world >= 1 and 0 <= rank < world and local >= 0):
            raise ConfigError(f"RANK={rank} WORLD_SIZE={world} LOCAL_RANK={local}: expected 0 <= RANK < WORLD_SIZE")
        return cls(rank, world, local)


def die_with_parent() -> None:
    """End this process when its parent ends: torchrun starts each rank in a session of its own, so when it is
    killed (SIGKILL) nothing else would end the ranks, and a killed island must not train on (Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return  # best effort
    if os.getppid() != parent:  # the parent ended before the request took effect
        os._exit(1)


def launch(argv: Sequence[str], env: Mapping[str, str]) -> int:
    """Run torchrun (`argv`) as a child and return its exit status. SIGTERM and SIGINT go to the ranks, not to
    torchrun: rank 0 drains (hands its work back, deregisters), every rank exits 0, and so does torchrun (a
    signalled torchrun exits 1 however its ranks ended). torchrun dies with this process (SIGKILL included)."""
    proc = subprocess.Popen(list(argv), env=dict(env), preexec_fn=die_with_parent)  # no threads here yet

    def forward(sig: int, _frame: object) -> None:
        for pid in children(proc.pid) or [proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    return proc.wait()


def children(pid: int) -> list[int]:
    """The child processes of `pid` (Linux: /proc; elsewhere none)."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                found.extend(int(c) for c in (task / "children").read_text().split())
    return found


def resolve_device(setting: str, local_rank: int | None) -> torch.device:
    """`--device` on this process: auto ("" too) is LOCAL_RANK's GPU when CUDA is available, else the CPU; `cuda`
    in an island is LOCAL_RANK's GPU. Raises `ConfigError` naming the flag when the device is not there."""
    if setting in ("", "auto"):
        if not torch.cuda.is_available():
            return torch.device("cpu")
        setting = "cuda"
    if setting == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"--device {setting}: CUDA is not available on this machine (use --device cpu or auto)")
    count = torch.cuda.device_count()
    if setting == "cuda":
        index = local_rank if local_rank is not None else torch.cuda.current_device()
        if index >= count:
            raise ConfigError(
                f"--nproc-per-node: local rank {index} has no GPU ({count} CUDA device(s) present); "
                "start at most one rank per GPU"
            )
        return torch.device("cuda", index)
    device = torch.device(setting)
    if device.index is not None and device.index >= count:
        raise ConfigError(f"--device {setting}: only {count} CUDA device(s) present")
    if local_rank is not None:
        raise ConfigError(f"--device {setting}: an island places one rank per GPU; use --device cuda or auto")
    return device


def device_kind(device: torch.device, world: int) -> str:
    """What heartbeats and registration report: the device ("cpu", "cuda:NVIDIA H200") and, for an island, its
    size ("cpu x2")."""
    kind = f"cuda:{torch.cuda.get_device_name(device)}" if device.type == "cuda" else device.type
    return kind if world == 1 else f"{kind} x{world}"


def checksum(model: torch.nn.Module) -> str:
    """A short digest of the model's parameters held by this rank (all of them, or its shards in a sharded island):
    the island's consistency check in the logs."""
    digest = hashlib.sha256()
    for p in local_shards(model):
        digest.update(p.detach().to(torch.float32).cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def shard_model(model: torch.nn.Module, device: torch.device, world: int) -> None:
    """Shard `model` across the island with FSDP2, in place: each element of every `ModuleList` (a transformer's
    blocks) is a unit of its own, gathered for its forward and backward only, and the rest (embeddings, tied
    output head, final norm) is the root unit. The parameters move to `device` as shards (1/`world` each)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    blocks: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():  # parents before children: the outermost lists' elements
        if isinstance(module, torch.nn.ModuleList) and not any(name.startswith(f"{b}.") for b, _ in blocks):
            blocks.extend((f"{name}.{i}", block) for i, block in enumerate(module))
    for _, block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


class ShardedParams:
    """A sharded island's parameters as the trainer's flat vectors (`diloco.task.inner.ParamIO`): `read` gathers
    them onto rank 0's host (the other ranks get an empty vector), `write` loads rank 0's vector into every rank's
    shards. Both are collectives: once `live`, the leader announces each (`GATHER`, `SCATTER`) so the followers
    join it in `Island.follow`; before that (while every rank builds its trainer in a session) they are not."""

    def __init__(self, island: Island, model: torch.nn.Module) -> None:
        self.island, self.model = island, model
        self.live = False

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def flat_view(self) -> None:  # the parameters are shards on every rank's device, never one local vector
        return None

    def read(self) -> torch.Tensor:
        return self.read_range(0, num_params(self.model))

    def write(self, flat: torch.Tensor) -> None:
        self.write_range(0, num_params(self.model), flat)

    def read_range(self, lo: int, hi: int) -> torch.Tensor:
        if self.live and self.island.leader:
            self.island._header(Op.GATHER, lo, hi)
        return gather_flat(self.model, lo, hi)

    def write_range(self, lo: int, hi: int, values: torch.Tensor) -> None:
        if self.live and self.island.leader:
            self.island._header(Op.SCATTER, lo, hi)
        scatter_flat_(self.model, values, lo, hi)


class Island:
    """This process's membership of its island. Construct on every rank (joins the process group)."""

    def __init__(
        self, rank: Rank, device: torch.device, log: structlog.stdlib.BoundLogger, *, sharded: bool = False
    ) -> None:
        self.rank, self.world = rank.rank, rank.world
        self.device = device
        self.sharded = sharded  # FSDP2 instead of DDP (`--shard-model`)
        self.log = log.bind(rank=rank.rank, world=rank.world)
        self.checksums = False  # log the parameters' digest on every rank at each PARAMS (tests, debugging)
        die_with_parent()
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group(backend=backend, timeout=COLLECTIVE_TIMEOUT)
        self.log.info("island.joined", backend=backend, device=str(device), pid=os.getpid(), sharded=sharded)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def rows(self, batch_size: int) -> slice:
        """This rank's rows of the island's global batch of `batch_size` rows."""
        per = batch_size // self.world
        return slice(self.rank * per, (self.rank + 1) * per)

    def check_batch(self, batch_size: int) -> None:
        if batch_size % self.world != 0:
            raise ConfigError(
                f"the task's inner.batch_size {batch_size} is the island's global batch and must be a multiple of "
                f"its {self.world} ranks (--nproc-per-node); change one of them"
            )

    def close(self) -> None:
        """Leave the group. Call after the replica let go of its model (`Replica.close`): a DistributedDataParallel
        module holds the group, and a gloo group still alive when the interpreter exits is torn down in its
        finalization, where it aborts the process (SIGABRT, "terminate called without an active exception")."""
        gc.collect()  # the model's last references may sit in reference cycles
        if dist.is_initialized():
            dist.destroy_process_group()

    # --- the wire inside the group ----------------------------------------------------------------------------
    def _header(self, op: Op = Op.STOP, a: int = 0, b: int = 0) -> tuple[Op, int, int]:
        t = torch.tensor([int(op), a, b], dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=0)
        values = t.tolist()
        return Op(values[0]), int(values[1]), int(values[2])

    def _params(self, model: torch.nn.Module, steps_done: int, before: str = "") -> int:
        """Rank 0's parameters onto every rank; returns rank 0's step count. `before`: the digest of the
        parameters before the leader adopted new ones (the followers' own, unchanged until this broadcast). A
        sharded island wrote them already (`SCATTER`): nothing is broadcast."""
        if self.checksums and not self.leader:
            before = checksum(model)
        if not self.sharded:
            flat = flatten_params(model).detach().to(self.device).contiguous()
            dist.broadcast(flat, src=0)
            if not self.leader:
                load_flat_(model, flat)
        if self.checksums:
            self.log.info("island.params", before=before, after=checksum(model), steps_done=steps_done)
        return steps_done

    # --- the leader's side ------------------------------------------------------------------------------------
    def session(self, task_json: str, fingerprint: str) -> None:
        self._header(Op.SESSION)
        dist.broadcast_object_list([task_json, fingerprint], src=0)

    def train(self, shard_id: int, cursor: int) -> None:
        self._header(Op.TRAIN, shard_id, cursor)

    def params(self, model: torch.nn.Module, steps_done: int, before: str) -> None:
        """After rank 0 adopted new parameters (`before`: `digest(model)` taken just before that)."""
        self._header(Op.PARAMS, steps_done)
        self._params(model, steps_done, before)

    def digest(self, model: torch.nn.Module) -> str:
        return checksum(model) if self.checksums else ""

    def stop(self, code: int) -> None:
        self._header(Op.STOP, code)

    # --- the followers' side ----------------------------------------------------------------------------------
    def follow(self, replica: Follower) -> int:
        """Carry out the leader's commands until it says stop; returns its exit status."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)  # the leader drains, then says STOP
        try:
            return self._follow(replica)
        finally:
            replica.close()

    def _follow(self, replica: Follower) -> int:
        while True:
            op, a, b = self._header()
            if op is Op.SESSION:
                got: list[object] = [None, None]
                dist.broadcast_object_list(got, src=0)
                try:
                    replica.start_session(str(got[0]), str(got[1]))
                except ConfigError as e:  # the leader meets the same error, deregisters and sends STOP
                    self.log.error("island.session_refused", detail=str(e))
            elif op is Op.TRAIN:
                replica.step_at(a, b)
            elif op is Op.PARAMS:
                trainer = replica.trainer
                assert trainer is not None
                trainer.steps_done = self._params(trainer.model, a)
            elif op is Op.GATHER:
                assert replica.trainer is not None
                replica.trainer.io.read_range(a, b)  # rank 0 gets them
            elif op is Op.SCATTER:
                assert replica.trainer is not None
                replica.trainer.io.write_range(a, b, torch.zeros(0))  # rank 0's are loaded
            else:
                self.log.info("island.stopped", code=a, pid=os.getpid())
                return a


class Follower(Protocol):
    """What `Island.follow` drives (the worker's `Replica`)."""

    trainer: InnerTrainer | None

    def start_session(self, task_json: str, fingerprint: str = "") -> None: ...

    def step_at(self, shard_id: int, cursor: int) -> int: ...

    def close(self) -> None: ...
