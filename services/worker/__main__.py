"""`python -m services.worker` / `diloco worker`: run one learner until training finishes or SIGTERM.

Under torchrun (`RANK`/`WORLD_SIZE` set) this process is one rank of an island (`island.py`): rank 0 runs the
worker loop, the others follow it. With `--nproc-per-node N > 1` and no torchrun around it, it runs torchrun
(`python -m torch.distributed.run --standalone --nproc-per-node N -m services.worker ...`), which starts the N
ranks with the same flags, and passes SIGTERM/SIGINT on to the ranks (`island.launch`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

import torch

from diloco import log as logging
from diloco.core import parallel
from diloco.errors import ConfigError
from diloco.heap import return_freed_memory
from diloco.rpc.payload import Spill
from diloco.signals import on_stop_signal
from services.worker.config import WorkerConfig, parse
from services.worker.island import Island, Rank, launch, resolve_device
from services.worker.metrics import Metrics
from services.worker.replica import Replica
from services.worker.worker import Worker, learner_device, open_power_meter


def torchrun_argv(cfg: WorkerConfig, argv: Sequence[str]) -> list[str]:
    """The torchrun command line that runs this learner as an island of `cfg.nproc_per_node` ranks."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(cfg.nproc_per_node),
        "--max-restarts",
        str(cfg.max_restarts),
        "-m",
        "services.worker",
        *argv,
    ]


def torchrun_env(env: Mapping[str, str]) -> dict[str, str]:
    """torchrun's environment: its rendezvous store is not shared with the ranks' process group, so a group
    started again (`--max-restarts`) never reads the addresses of the ranks before it (pytorch/pytorch#135712)."""
    return {**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def check_devices(cfg: WorkerConfig) -> None:
    """An island places one rank per GPU: refuse more ranks than GPUs (naming the flag)."""
    wants_cuda = cfg.device.startswith("cuda") or (cfg.device in ("", "auto") and torch.cuda.is_available())
    if wants_cuda:
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {cfg.device}: CUDA is not available on this machine (use --device cpu)")
        count = torch.cuda.device_count()
        if cfg.nproc_per_node > count:
            raise ConfigError(
                f"--nproc-per-node {cfg.nproc_per_node} is larger than the {count} CUDA device(s) present "
                "(one rank per GPU; use --device cpu for CPU ranks)"
            )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = parse(argv)
        rank = Rank.from_env(os.environ)
        if rank is None and cfg.shard_model and cfg.nproc_per_node == 1:
            raise ConfigError(
                "--shard-model shards the model over the ranks of an island: add --nproc-per-node N (N >= 2), "
                "or run the worker under torchrun; a one-process learner holds the whole model"
            )
        if rank is None and cfg.nproc_per_node > 1:
            check_devices(cfg)
            return launch(torchrun_argv(cfg, argv), torchrun_env(os.environ))
        device = resolve_device(cfg.device, rank.local_rank if rank else None) if rank else None
        if device is not None and cfg.precision == "bf16" and device.type != "cuda":
            raise ConfigError("--precision bf16 needs CUDA (bf16 autocast); use --precision fp32 on CPU")
        Spill.checked(cfg.spill_dir, cfg.spill_above)
        # the power meter the flags ask for (e.g. --power-meter nvml where NVML cannot be read): before anything
        # starts; an island's leader measures every rank's GPU on this host, its followers nothing
        power = None
        if rank is None:
            power = open_power_meter(cfg, learner_device(cfg))
        elif rank.rank == 0 and device is not None:
            power = open_power_meter(cfg, device, rank.world)
    except ConfigError as e:
        print(f"diloco worker: configuration error: {e}", file=sys.stderr)
        return 2
    parallel.set_threads(cfg.threads)  # torch's intra-op threads and the codecs' parts (default 1)
    return_freed_memory()  # the gradients freed after each step leave no resident pages behind (`diloco.heap`)
    logging.configure("worker")
    if rank is None or device is None:
        return run_worker(Worker(cfg, power=power))
    island = Island(rank, device, logging.get("worker", worker=cfg.display_name), sharded=cfg.shard_model)
    island.checksums = cfg.island_checksums
    try:
        if island.leader:
            return run_worker(Worker(cfg, island, power=power))
        return island.follow(Replica(cfg, device, Metrics(), island))
    finally:
        island.close()


def run_worker(worker: Worker) -> int:
    on_stop_signal(lambda _name: worker.stop(), "worker-stop")
    return worker.run()


if __name__ == "__main__":
    sys.exit(main())
