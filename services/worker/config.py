"""Worker configuration: flags with `DILOCO_*` environment fallbacks, read here and nowhere else."""

from __future__ import annotations

import argparse
import math
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from diloco.core.leadership import coordinator_addresses
from diloco.core.parallel import check_threads
from diloco.errors import ConfigError, InvalidArgument
from diloco.flags import NEVER, Flag, config_from_flags, env_name, parse_bool, spill_size
from diloco.flags import build_parser as build_flag_parser
from diloco.rpc import auth, security
from diloco.rpc.limits import MAX_PRICE_PER_HOUR, MAX_WATTS, MAX_ZONE_CHARS
from diloco.rpc.payload import SPILL_ABOVE
from diloco.rpc.security import SecurityConfig
from services.worker.power import METER_MODES

UPLOAD_PATHS = ("auto", "grpc")
PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class WorkerConfig:
    coordinator: str  # host:port of the coordinator
    name: str = ""  # stable name; default hostname-pid
    healthd: str = ""  # host:port of healthd; "" = the one the coordinator names
    slowdown: float = 1.0  # >1 emulates older hardware (sleeps (slowdown-1) x step time)
    heartbeat_interval_s: float = 0.5
    rpc_timeout_s: float = 10.0
    upload_timeout_s: float = 300.0
    retry_total_s: float = 60.0  # how long one upload is retried before it is dropped (its steps are retrained)
    give_up_after_s: float = 0.0  # exit 1 when no coordinator call succeeded for this long (0: never)
    metrics_port: int = -1
    seed: int = -1  # the initial parameters' seed (-1: the coordinator's init seed, from Register)
    device: str = ""  # "" or auto = CUDA when present (an island rank: LOCAL_RANK's GPU), else CPU
    precision: str = "fp32"  # bf16: bf16 autocast of the forward pass (CUDA only)
    nproc_per_node: int = 1  # > 1: `diloco worker` starts torchrun with this many ranks (one island)
    max_restarts: int = 0  # torchrun's --max-restarts for the island `diloco worker` starts
    threads: int = 1  # threads of each model-sized pass: torch's and the codecs' (`diloco.core.parallel`)
    shard_model: bool = False  # an island shards the model over its ranks (FSDP2) instead of replicating it (DDP)
    activation_checkpointing: bool = False  # keep each layer's input only; recompute the rest in backward
    spill_dir: str = ""  # where the residual, θ_at_submit and Θ̂ are held in files when above `spill_above` bytes
    spill_above: int = SPILL_ABOVE  # bytes; 0: always in files; NEVER (-1): in memory
    island_checksums: bool = False  # every rank logs its parameters' digest at each broadcast (tests, debugging)
    upload_path: str = "auto"  # auto: the bulk upload path when the coordinator offers one, else gRPC; grpc: gRPC
    ef_decay: float = 0.0  # error feedback's residual decay β in (0, 1]; 0: the codec's default (`ErrorFeedback`)
    # energy-, carbon- and cost-aware placement (issue #15; services/worker/power.py)
    power_w: float = 0.0  # the declared draw while training (W); 0: none declared
    power_meter: str = "auto"  # auto | nvml | rapl | declared
    zone: str = ""  # the grid zone the learner draws from, as the coordinator's carbon trace names it
    price_per_hour: float = 0.0  # what the learner costs per hour while registered and not paused
    spot: bool = False  # spot (preemptible) capacity; False: on demand
    # FAULT INJECTION, for tests and chaos runs only: multiply every pseudo-gradient sent by this (1: off)
    fault_scale_updates: float = 1.0
    security: SecurityConfig = field(default_factory=SecurityConfig)  # in-process default: plaintext, loopback

    def __post_init__(self) -> None:
        try:
            coordinator_addresses(self.coordinator)
        except InvalidArgument as e:
            raise ConfigError(
                f"coordinator (flag --coordinator or env DILOCO_COORDINATOR): {e}; got {self.coordinator!r:.80}"
            ) from None
        if len(self.name) > 128 or not self.name.isprintable():
            raise ConfigError(f"name must be at most 128 printable characters, got {self.name!r}")
        if self.ef_decay != 0.0:
            _check_ef_decay(self.ef_decay)
        _bounded("--power-w", self.power_w, MAX_WATTS, "watts the learner draws while training; 0: not declared")
        _bounded("--price-per-hour", self.price_per_hour, MAX_PRICE_PER_HOUR, "the learner's price per hour")
        if self.power_meter not in METER_MODES:
            raise ConfigError(f"--power-meter: allowed {', '.join(METER_MODES)}; got {self.power_meter!r}")
        if len(self.zone) > MAX_ZONE_CHARS or not self.zone.isprintable() or self.zone != self.zone.strip():
            raise ConfigError(
                f"--zone must be at most {MAX_ZONE_CHARS} printable characters without surrounding spaces (a grid "
                f"zone such as DE or US-CAL-CISO), got {self.zone!r}"
            )
        if not (math.isfinite(self.slowdown) and self.slowdown >= 1.0):
            raise ConfigError(f"slowdown must be a finite number >= 1.0 (1 = full speed), got {self.slowdown}")
        for name in ("heartbeat_interval_s", "rpc_timeout_s", "upload_timeout_s", "retry_total_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a finite number > 0, got {value}")
        if not (math.isfinite(self.give_up_after_s) and self.give_up_after_s >= 0):
            raise ConfigError(f"give_up_after_s must be a finite number >= 0 (0: never), got {self.give_up_after_s}")
        if not -1 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be in [-1, 65535] (-1: off, 0: a free port), got {self.metrics_port}")
        if self.seed < -1:
            raise ConfigError(f"seed must be >= 0, or -1 for the coordinator's, got {self.seed}")
        if not (math.isfinite(self.fault_scale_updates) and self.fault_scale_updates > 0):
            raise ConfigError(f"fault_scale_updates must be finite and > 0 (1: off), got {self.fault_scale_updates}")
        if self.upload_path not in UPLOAD_PATHS:
            raise ConfigError(f"upload_path: allowed {', '.join(UPLOAD_PATHS)}; got {self.upload_path!r}")
        if self.device not in ("", "auto", "cpu", "cuda") and not (
            self.device.startswith("cuda:") and self.device[5:].isdigit()
        ):
            raise ConfigError(f"--device: allowed auto, cpu, cuda, cuda:N; got {self.device!r}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"--precision: allowed {', '.join(PRECISIONS)}; got {self.precision!r}")
        if self.precision == "bf16" and self.device == "cpu":
            raise ConfigError("--precision bf16 needs CUDA (bf16 autocast); use --precision fp32 with --device cpu")
        if not 1 <= self.nproc_per_node <= 1024:
            raise ConfigError(f"--nproc-per-node must be in [1, 1024], got {self.nproc_per_node}")
        check_threads(self.threads, "--threads")
        if self.spill_above < NEVER:
            raise ConfigError(f"--spill-above must be a byte count or 'never', got {self.spill_above}")
        if not 0 <= self.max_restarts <= 1000:
            raise ConfigError(f"--max-restarts must be in [0, 1000], got {self.max_restarts}")
        for address in (*self.coordinators, self.healthd):
            if address:
                self.security.check_client(address)
        if self.security.tls and not self.security.join_token:
            raise ConfigError(
                "a worker needs the join token: --join-token-file FILE or DILOCO_JOIN_TOKEN "
                "(`diloco certs` writes join.token)"
            )

    @property
    def coordinators(self) -> tuple[str, ...]:
        """The coordinator addresses (`coordinator` split at commas): replicas, the learner starts at the first."""
        return coordinator_addresses(self.coordinator)

    @property
    def display_name(self) -> str:
        """`name`; else the certificate's name when it is a learner's own (the coordinator lets a certificate act
        only as the learner it names, see `auth.act_as`); else hostname-pid."""
        if self.name:
            return self.name
        own = self.security.tls_name
        if own and own != auth.SHARED_WORKER_IDENTITY:
            return own
        return f"{socket.gethostname()}-{os.getpid()}"


def _check_ef_decay(decay: float) -> None:
    """--ef-decay by the codecs' rule (`check_ef_decay`, which `diloco local` and `diloco simulate` apply too)."""
    from diloco.core.codecs import CodecError, check_ef_decay  # imports torch: only for a worker given --ef-decay

    try:
        check_ef_decay(decay)
    except CodecError as e:
        raise ConfigError(f"--ef-decay: {e}; or 0 for the codec's default") from None


def _bounded(flag: str, value: object, hi: float, what: str) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and 0 <= value <= hi
    if not ok:
        raise ConfigError(f"{flag} must be a finite number in [0, {hi:g}] ({what}), got {value!r}")


_FLAGS: list[Flag] = [
    (
        "--coordinator",
        str,
        "",
        "the coordinator's HOST:PORT (required); replicas as A,B,...: on UNAVAILABLE the learner moves to the leader "
        "a refusal names, else to the next address",
    ),
    (
        "--name",
        str,
        "",
        "a stable name for this learner (default: the name of its own certificate, else hostname-pid); with a "
        "learner's own certificate it must be that certificate's name",
    ),
    ("--healthd", str, "", "healthd's HOST:PORT (default: the one the coordinator names)"),
    ("--slowdown", float, 1.0, "emulate older hardware: >= 1, sleeps (slowdown - 1) x the step time after each step"),
    ("--heartbeat-interval-s", float, 0.5, "time between heartbeats to healthd"),
    ("--rpc-timeout-s", float, 10.0, "deadline of every control RPC"),
    (
        "--retry-total-s",
        float,
        60.0,
        "how long one upload is retried (resumed) before it is dropped; its steps are then trained again",
    ),
    (
        "--give-up-after-s",
        float,
        0.0,
        "exit with status 1 when no call to the coordinator succeeded for this long (0: never; the learner then "
        "rides through any outage and exits only on SIGTERM/SIGINT or when the job finished)",
    ),
    ("--metrics-port", int, -1, "Prometheus metrics port (0: any free port, -1: off)"),
    (
        "--seed",
        int,
        -1,
        "seed of the learner's initial parameters (-1: the coordinator's); a fresh learner whose own version 0 has "
        "the coordinator's checksum downloads only the deltas since, else a full snapshot",
    ),
    (
        "--device",
        str,
        "",
        "auto, cpu, cuda or cuda:N (default auto: CUDA when present, in an island LOCAL_RANK's GPU; else CPU)",
    ),
    ("--precision", str, "fp32", "fp32, or bf16: bf16 autocast of the forward pass (CUDA only)"),
    (
        "--nproc-per-node",
        int,
        1,
        "run this learner as an island of N ranks (one per GPU, or N CPU processes): starts torchrun, which runs "
        "DistributedDataParallel (or FSDP2, --shard-model) over the ranks; rank 0 alone talks to the coordinator",
    ),
    ("--max-restarts", int, 0, "with --nproc-per-node: how often torchrun restarts the island when a rank dies"),
    (
        "--threads",
        int,
        1,
        "threads of each model-sized pass (inner steps on CPU, compression, rebase), per rank: 1 where processes "
        "share the cores (diloco local); a learner alone on a many-core host: about its cores (per rank: / ranks)",
    ),
    (
        "--shard-model",
        parse_bool,
        False,
        "true: the island shards the model, its gradients and optimizer state over its ranks (FSDP2 fully_shard) "
        "instead of replicating it (DistributedDataParallel), for models that do not fit one device; needs an "
        "island (--nproc-per-node >= 2, or torchrun)",
    ),
    (
        "--activation-checkpointing",
        parse_bool,
        False,
        "true: keep only each layer's input for backward and compute the rest again there (less memory for "
        "activations, each layer's forward run twice a step; the same gradients): for learners short of memory",
    ),
    (
        "--spill-dir",
        str,
        "",
        "where the error-feedback residual, θ_at_submit (the parameters a learner training on after a submission "
        "rebases from) and the broadcast parameters Θ̂, model-sized fp32 vectors, are held when bigger than "
        "--spill-above: unlinked files, the first two read and written a slab at a time (one-process learners with "
        "flat parameters on the CPU; the residual with int8/int4 uploads), Θ̂ mapped and dropped from memory "
        "between its uses ('': $TMPDIR, else /var/tmp)",
    ),
    (
        "--spill-above",
        spill_size,
        SPILL_ABOVE,
        "hold the residual, θ_at_submit and Θ̂ in files in --spill-dir when bigger than this (e.g. 64M; 0: always; "
        "never: in memory)",
    ),
    ("--island-checksums", parse_bool, False, "every island rank logs its parameters' digest at each broadcast"),
    (
        "--upload-path",
        str,
        "auto",
        "auto: pseudo-gradients over the coordinator's bulk upload port when it offers one, else gRPC; "
        "grpc: always SubmitPseudoGradient",
    ),
    (
        "--ef-decay",
        float,
        0.0,
        "error feedback's residual decay beta in (0, 1] (1: exact; lower forgets what was not sent faster); "
        "0: the codec's default (topk and sparse 0.5, the others 1)",
    ),
    (
        "--power-w",
        float,
        0.0,
        f"the power this learner draws while training, in watts (at most {MAX_WATTS:g}); reported when no "
        "counter can be read (see --power-meter); 0: none declared",
    ),
    (
        "--power-meter",
        str,
        "auto",
        "where the learner's watts come from: auto (NVML on CUDA, RAPL on CPU, else --power-w), nvml, rapl "
        "(exit 2 when they cannot be read), or declared (--power-w only)",
    ),
    ("--zone", str, "", "the grid zone this learner draws from, as the coordinator's --carbon-trace names it"),
    (
        "--price-per-hour",
        float,
        0.0,
        f"what this learner costs per hour while registered and not paused (at most {MAX_PRICE_PER_HOUR:g})",
    ),
    (
        "--fault-scale-updates",
        float,
        1.0,
        "FAULT INJECTION for tests and chaos runs: multiply every pseudo-gradient sent by this (1: off)",
    ),
]


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    p = build_flag_parser("diloco worker", "Run one learner.", [("worker", _FLAGS)], env)
    raw = env.get(env_name("--spot"))
    try:
        spot = False if raw is None else parse_bool(raw)
    except ValueError as e:
        raise ConfigError(f"environment {env_name('--spot')}={raw!r} is not valid for --spot: {e}") from e
    capacity = p.add_argument_group("capacity").add_mutually_exclusive_group()
    capacity.add_argument(
        "--spot",
        dest="spot",
        action="store_true",
        default=spot,
        help=f"the learner runs on spot (preemptible) capacity (env {env_name('--spot')}=true)",
    )
    capacity.add_argument(
        "--on-demand", dest="spot", action="store_false", help="the learner runs on on-demand capacity (the default)"
    )
    security.add_flags(p, env, tls_name="worker", tokens=("join",))
    return p


def parse(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> WorkerConfig:
    """Read the configuration from flags (`argv`, default `sys.argv[1:]`) with environment fallbacks (`env`,
    default `os.environ`). Raises `ConfigError` with a message naming the flag or field."""
    env = os.environ if env is None else env
    a = build_parser(env).parse_args(argv)
    return config_from_flags(WorkerConfig, a, security=security.from_args(a, env))
