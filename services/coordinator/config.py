"""Coordinator configuration: flags with `DILOCO_*` environment fallbacks, read here and nowhere else.

Every flag `--some-name` falls back to the environment variable `DILOCO_SOME_NAME` (e.g. `--mode` and
`DILOCO_MODE`, `--checkpoint-dir` and `DILOCO_CHECKPOINT_DIR`), then to the default below. A flag given on the
command line wins over the environment.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from diloco.core.broadcast import BROADCAST_CODECS, DEFAULT_BROADCAST_CODEC
from diloco.core.codecs import CODEC_NAMES, codec_class
from diloco.core.coordinator import CoordinatorConfig
from diloco.core.energy import POLICY_NAMES, Policy, PolicyConfig, parse_policy
from diloco.core.fragments import check_fragments
from diloco.core.guard import GuardConfig, adamw_move_bound
from diloco.core.merge import MERGE_NAMES
from diloco.core.outer import OUTER_NAMES, OuterConfig
from diloco.core.parallel import check_threads
from diloco.core.replication import WHEN_NO_STANDBY, WhenNoStandby
from diloco.core.rounds import MODES, RoundConfig
from diloco.errors import ConfigError
from diloco.flags import NEVER, Flag, byte_size, config_from_flags, parse_bool, spill_size
from diloco.flags import build_parser as build_flag_parser
from diloco.rpc import security
from diloco.rpc.admission import AdmissionLimits
from diloco.rpc.payload import SPILL_ABOVE
from diloco.rpc.security import SecurityConfig
from diloco.task.data import DataConfig, check_eval_tokens
from diloco.task.factory import TaskConfig, task_from_flags
from diloco.task.inner import InnerConfig
from diloco.task.model import ModelConfig

if TYPE_CHECKING:  # diloco.ha.etcd (requests, etcd3gw) is imported only by a coordinator given --etcd
    from diloco.ha.etcd import EtcdConfig

LOG_LEVELS = ("debug", "info", "warning", "error")
CRASH_FAULT = re.compile(r"(applied|accepted)@([0-9]{1,9})")  # --fault-crash-before-answer
PROVIDER_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")  # package.module:function
MAX_REPLICATION_LOG_BYTES = 1 << 40  # --replication-log-bytes at most (1 TiB)


def default_task() -> TaskConfig:
    """The task the flags describe when none is given: a small byte-level GPT on the standard library."""
    return TaskConfig(
        model=ModelConfig(seq_len=64, d_model=64, n_layers=2, n_heads=4),
        data=DataConfig(num_shards=16, max_bytes=2_000_000),
        inner=InnerConfig(batch_size=8),
    )


@dataclass(frozen=True)
class CrashFault:
    """A fault for tests (`--fault-crash-before-answer applied@V` or `accepted@V`): the coordinator kills itself
    (SIGKILL, a crash) instead of answering the first upload that its own call applied in round V or later
    (`applied`), or accepted into round V or later while that round is still open (`accepted`). What a crash can
    leave behind, made deterministic: the submission is in the round log (or only in the dead leader's memory) and
    its learner never got the answer."""

    applied: bool
    round: int

    @classmethod
    def parse(cls, value: str) -> CrashFault | None:
        if not value:
            return None
        m = CRASH_FAULT.fullmatch(value)
        if m is None or int(m.group(2)) < 1:
            raise ConfigError(
                f"fault_crash_before_answer must be applied@VERSION or accepted@VERSION (VERSION >= 1) or '', got "
                f"{value!r} (flag --fault-crash-before-answer)"
            )
        return cls(m.group(1) == "applied", int(m.group(2)))

    def matches(self, applied: bool, round_: int) -> bool:
        return applied == self.applied and round_ >= self.round


@dataclass(frozen=True)
class CoordinatorServiceConfig:
    """Everything the coordinator service needs; validated at construction (`ConfigError` names the field)."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port
    metrics_port: int = -1  # -1: no metrics endpoint; 0: a free port
    bulk_port: int = 0  # the bulk upload path (raw TCP/TLS beside gRPC); 0: a free port; -1: off
    checkpoint_dir: str = ""  # "": no checkpoints
    checkpoint_every: int = 5  # rounds between automatic checkpoints
    keep_checkpoints: int = 3
    mode: str = "decoupled"
    min_quorum: int = 2
    grace_max_s: float = 2.0
    max_staleness: int = 4
    local_steps: int = 30
    min_local_steps: int = 5
    fixed_local_steps: bool = False  # True: every learner runs `local_steps` (no dynamic H_m)
    scale_partial_rounds: bool = True  # a decoupled round without every learner takes a partial step
    # streaming fragments (docs/fragments.md): P contiguous fragments, each synchronised on its own every H steps;
    # 1: the whole model every H steps (no fragments)
    fragments: int = 1
    codec: str = "int8"
    broadcast_codec: str = DEFAULT_BROADCAST_CODEC  # to learners: fp32 snapshots, or deltas with error feedback
    broadcast_history: int = 8  # encoded broadcast deltas kept; a learner further behind gets a full snapshot
    outer: str = "nesterov"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    merge: str = "mean"
    expected_workers: int = 0
    target_outer_steps: int = 0  # 0: train until stopped
    healthd_address: str = ""
    eval_every: int = 1  # rounds between validation evaluations; 0: never
    eval_tokens: int = 32_768  # validation tokens per evaluation; 0: the whole split
    seed: int = 0
    task: TaskConfig = field(default_factory=default_task)
    max_upload_bytes: int = 0  # 0: derived from the model (its fp32 size + 1%)
    confirm_timeout_s: float = 10.0  # with healthd: a learner never heard of this long after registering is dead
    unheard_after_s: float = 3.0  # with healthd reporting others: an unconfirmed learner is dead this soon
    upload_ttl_s: float = 120.0  # interrupted uploads are kept this long for a resume
    max_partial_uploads: int = 32  # uploads held in all (streaming or kept for a resume); each holds a model buffer
    max_uploads_per_worker: int = 2  # uploads one learner may have held at once
    spill_dir: str = ""  # where uploads and kept broadcast deltas above `spill_above` bytes are held in files
    spill_above: int = SPILL_ABOVE  # bytes; 0: every one in a file; NEVER (-1): all in memory
    outlier_factor: float = 10.0  # refuse a pseudo-gradient whose norm per step is above this x the median; 0: off
    outlier_window: int = 32  # accepted norms the median is taken over
    outlier_min_samples: int = 3  # accepted norms before any outlier judgement
    quarantine_strikes: int = 3  # refusals in a row after which a quarantined learner's shards move away
    max_workers: int = 4096  # live learners at most; one more Register gets RESOURCE_EXHAUSTED
    max_departed: int = 1024  # records of departed learners kept for ListWorkers (the most recent departures)
    shutdown_grace_s: float = 5.0
    max_calls: int = 8192  # gRPC calls running at once (open streams included); more: RESOURCE_EXHAUSTED
    max_calls_per_client: int = 64  # the same for one connection
    work_threads: int = 4  # threads that decode uploads and write checkpoints, off the event loop
    threads: int = 1  # threads of each model-sized pass: torch's and the codecs' (`diloco.core.parallel`)
    # energy-, carbon- and cost-aware placement (issue #15; diloco.core.energy, services/coordinator/energy.py)
    placement: str = "speed"  # speed | energy | carbon | cost
    carbon_trace: str = ""  # CSV zone,time_s,gco2_per_kwh; "" none
    carbon_trace_origin_unix_s: float = 0.0  # the unix time the trace's time 0 stands for; 0: the coordinator's start
    carbon_threshold: float = 0.0  # gCO2/kWh above which a zone is dirty; 0: the dirtiest zone at each moment
    deadline_s: float = 0.0  # the job should end this long after the coordinator started; 0: no deadline
    carbon_provider: str = ""  # 'package.module:function' called as function(zone, unix_s) -> gCO2/kWh; "" none
    carbon_provider_timeout_s: float = 5.0  # a call running longer is abandoned (the last good value stays)
    carbon_refresh_s: float = 60.0  # how often the provider is asked for each zone's intensity
    replication_log: int = 0  # round-log entries kept for hot standbys (diloco.v1.Replication); 0: none served
    replication_log_bytes: int = 0  # and at most this many bytes of them (the newest always); 0: a snapshot's size
    sync_replicas: int = 0  # publish a version to learners only once this many standbys hold it (a bounded wait)
    replica_ack_timeout_s: float = 5.0  # the longest a round waits for standby acks before publishing anyway
    # with too few standbys acknowledging: publish degraded (availability) or hold the version back (durability)
    when_no_standby: str = WhenNoStandby.PUBLISH.value
    follow: str = ""  # HOST:PORT of the leading coordinator: run as its hot standby (services.coordinator.standby)
    replica_id: str = ""  # the standby's name; "": standby-<hostname>
    etcd: str = ""  # http(s)://HOST:PORT[,...] of etcd's members: campaign there (services/coordinator/ha.py)
    etcd_private_network: bool = False  # plain HTTP (or https, no client cert nor user) off loopback: a private network
    etcd_ca_file: str = ""  # https: the CA that signed etcd's certificate (PEM)
    etcd_cert_file: str = ""  # https: this replica's client certificate for etcd (PEM; with etcd_key_file)
    etcd_key_file: str = ""  # https: its private key (PEM)
    etcd_user: str = ""  # etcd with authentication enabled: this replica's etcd user (with etcd_password_file)
    etcd_password_file: str = ""  # the file holding that user's password (read at start; never the password itself)
    fault_crash_before_answer: str = ""  # fault tests only: `CrashFault` ("": never)
    log_level: str = "info"
    security: SecurityConfig = field(default_factory=SecurityConfig)  # in-process default: plaintext, loopback

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ConfigError(f"host must be a non-empty address, got {self.host!r}")
        _int_in("port", self.port, 0, 65535)
        _int_in("metrics_port", self.metrics_port, -1, 65535)
        if not isinstance(self.checkpoint_dir, str):
            raise ConfigError(f"checkpoint_dir must be a path or '' (no checkpoints), got {self.checkpoint_dir!r}")
        _int_in("checkpoint_every", self.checkpoint_every, 1)
        _int_in("keep_checkpoints", self.keep_checkpoints, 1)
        _choice("mode", self.mode, MODES)
        _choice("codec", self.codec, CODEC_NAMES)
        _choice("broadcast_codec", self.broadcast_codec, BROADCAST_CODECS)
        _int_in("broadcast_history", self.broadcast_history, 1, 256)
        _choice("outer", self.outer, OUTER_NAMES)
        _choice("merge", self.merge, MERGE_NAMES)
        _choice("log_level", self.log_level, LOG_LEVELS)
        _int_in("min_quorum", self.min_quorum, 1)
        _float_min("grace_max_s", self.grace_max_s, 0.0)
        _int_in("max_staleness", self.max_staleness, 0)
        _int_in("local_steps", self.local_steps, 1)
        _int_in("min_local_steps", self.min_local_steps, 1, self.local_steps)
        _int_in("expected_workers", self.expected_workers, 0)
        _int_in("target_outer_steps", self.target_outer_steps, 0)
        _int_in("eval_every", self.eval_every, 0)
        _int_in("seed", self.seed, 0)
        _int_in("bulk_port", self.bulk_port, -1, 65535)
        _int_in("max_upload_bytes", self.max_upload_bytes, 0)
        _float_min("upload_ttl_s", self.upload_ttl_s, 0.0, open_=True)
        _float_min("confirm_timeout_s", self.confirm_timeout_s, 0.0)
        _float_min("unheard_after_s", self.unheard_after_s, 0.0)
        _int_in("max_partial_uploads", self.max_partial_uploads, 1)
        _int_in("spill_above", self.spill_above, NEVER)
        _int_in("max_uploads_per_worker", self.max_uploads_per_worker, 1, self.max_partial_uploads)
        _float_min("outlier_factor", self.outlier_factor, 0.0)
        _int_in("outlier_window", self.outlier_window, 1)
        _int_in("outlier_min_samples", self.outlier_min_samples, 1, self.outlier_window)
        _int_in("quarantine_strikes", self.quarantine_strikes, 1)
        _int_in("max_workers", self.max_workers, max(1, self.expected_workers))
        _int_in("max_departed", self.max_departed, 0)
        _float_min("shutdown_grace_s", self.shutdown_grace_s, 0.0)
        _int_in("max_calls", self.max_calls, 16, 1_000_000)
        _int_in("max_calls_per_client", self.max_calls_per_client, 4, self.max_calls)
        _int_in("work_threads", self.work_threads, 1, 256)
        check_threads(self.threads, "threads (--threads)")
        _choice("placement", self.placement, POLICY_NAMES)
        _float_min("carbon_trace_origin_unix_s", self.carbon_trace_origin_unix_s, 0.0)
        _float_min("carbon_threshold", self.carbon_threshold, 0.0)
        _float_min("deadline_s", self.deadline_s, 0.0)
        _float_min("carbon_provider_timeout_s", self.carbon_provider_timeout_s, 0.0, open_=True)
        _float_min("carbon_refresh_s", self.carbon_refresh_s, 0.0, open_=True)
        if self.carbon_provider and not PROVIDER_SPEC.fullmatch(self.carbon_provider):
            raise ConfigError(
                f"carbon_provider must be 'package.module:function', got {self.carbon_provider!r} (flag "
                "--carbon-provider)"
            )
        if self.placement == Policy.CARBON.value and not (self.carbon_trace or self.carbon_provider):
            raise ConfigError(
                "placement carbon weighs zones' carbon intensity: give --carbon-trace FILE or --carbon-provider "
                "package.module:function"
            )
        _int_in("replication_log", self.replication_log, 0, 1024)
        self._check_replication_log_bytes()
        _int_in("sync_replicas", self.sync_replicas, 0, 64)
        if self.sync_replicas and not self.replication_log:
            raise ConfigError(
                "sync_replicas needs the replication service: set replication_log (--replication-log) >= 1"
            )
        _float_min("replica_ack_timeout_s", self.replica_ack_timeout_s, 0.0, open_=True)
        _choice("when_no_standby", self.when_no_standby, WHEN_NO_STANDBY)
        if self.when_no_standby == WhenNoStandby.WAIT.value and not self.sync_replicas:
            raise ConfigError(
                "when_no_standby wait holds each version until --sync-replicas standbys acknowledged it: set "
                "sync_replicas (--sync-replicas) >= 1, or use --when-no-standby publish"
            )
        if not isinstance(self.follow, str) or (self.follow and ":" not in self.follow):
            raise ConfigError(f"follow must be HOST:PORT of the leading coordinator or '', got {self.follow!r}")
        if not isinstance(self.replica_id, str) or len(self.replica_id) > 256 or not self.replica_id.isprintable():
            raise ConfigError(f"replica_id must be at most 256 printable characters, got {self.replica_id!r}")
        if not isinstance(self.etcd_private_network, bool):
            raise ConfigError(f"etcd_private_network must be true or false, got {self.etcd_private_network!r}")
        self.etcd_config()
        self.crash_fault()
        self._check_fragments()
        if self.etcd:
            if self.follow:
                raise ConfigError("etcd and follow exclude each other: with --etcd, etcd says whom to follow")
            if not self.checkpoint_dir:
                raise ConfigError("etcd needs checkpoint_dir (--checkpoint-dir): a promoted standby resumes from it")
            if not self.replication_log:
                raise ConfigError("etcd needs replication_log >= 1 (--replication-log): standbys follow the leader")
        if not isinstance(self.healthd_address, str):
            raise ConfigError(f"healthd_address must be HOST:PORT or '', got {self.healthd_address!r}")
        if not isinstance(self.task, TaskConfig):
            raise ConfigError(f"task must be a TaskConfig, got {type(self.task).__name__}")
        check_eval_tokens(self.eval_tokens, self.task.model.seq_len)
        if self.expected_workers > self.task.data.num_shards:
            raise ConfigError(
                f"expected_workers ({self.expected_workers}) must be <= the number of shards "
                f"({self.task.data.num_shards}); raise --shards"
            )
        self.core_config()  # the core's own checks (outer lr/momentum, quorum against expected workers)
        self.security.check_server(self.host)  # last: field errors first, then TLS or loopback plaintext

    def _check_replication_log_bytes(self) -> None:
        v = self.replication_log_bytes
        if not (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_REPLICATION_LOG_BYTES):
            raise ConfigError(
                f"replication_log_bytes (--replication-log-bytes) must be a byte count in [1, "
                f"{MAX_REPLICATION_LOG_BYTES}] (1T), or 0 for the bytes of a snapshot, got {v!r}"
            )
        if v and not self.replication_log:
            raise ConfigError(
                "replication_log_bytes (--replication-log-bytes) caps the round log: set replication_log "
                "(--replication-log) >= 1"
            )

    def _check_fragments(self) -> None:
        """P >= 1 and <= H (`check_fragments`; against the model's tensors once it is built: the server). Replicas
        (--replication-log, --follow, --etcd) run them too: the round log carries each round's fragment steps."""
        check_fragments(self.fragments, self.local_steps)

    def etcd_config(self) -> EtcdConfig | None:
        """How to reach etcd (None: no `etcd`): its members in the order tried, over http or https (with the CA and
        client certificate files, read and checked here), as an etcd user or not (the password file, read and checked
        here). `ConfigError` naming the flag unless the endpoints parse (`parse_etcd_endpoints`: off loopback only
        with https and a client certificate or a user, or a private network), https has its CA, the files are given
        only for https, and the user and the password file are given together and only with `etcd`."""
        for name in ("etcd_user", "etcd_password_file"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"{name} must be a string, got {getattr(self, name)!r}")
        client_cert, user = bool(self.etcd_cert_file), bool(self.etcd_user)
        scheme, endpoints = parse_etcd_endpoints(
            self.etcd, self.etcd_private_network, client_cert=client_cert, user=user
        )
        files = [f for f in ("ca", "cert", "key") if getattr(self, f"etcd_{f}_file")]
        if files and scheme != "https":
            flags = ", ".join(f"--etcd-{f}-file" for f in files)
            raise ConfigError(f"{flags}: for etcd over https; give --etcd https://HOST:PORT[,...] or leave them out")
        if (self.etcd_user or self.etcd_password_file) and not endpoints:
            raise ConfigError(
                "--etcd-user and --etcd-password-file are for etcd leadership; give --etcd too, or leave them out"
            )
        if user != bool(self.etcd_password_file):
            raise ConfigError(
                "--etcd-user is given without --etcd-password-file: give the file holding its password too"
                if user
                else "--etcd-password-file is given without --etcd-user: give the etcd user whose password it holds"
            )
        if not endpoints:
            return None
        from diloco.ha.etcd import EtcdAuth, EtcdConfig, EtcdTls  # the etcd client: only with --etcd

        tls = EtcdTls(self.etcd_ca_file, self.etcd_cert_file, self.etcd_key_file) if scheme == "https" else None
        auth = EtcdAuth(self.etcd_user, self.etcd_password_file) if user else None
        (host, port), *others = endpoints
        return EtcdConfig(host=host, port=port, others=tuple(others), tls=tls, auth=auth)

    def crash_fault(self) -> CrashFault | None:
        """The crash `fault_crash_before_answer` asks for (None: none)."""
        if not isinstance(self.fault_crash_before_answer, str):
            raise ConfigError(f"fault_crash_before_answer must be a string, got {self.fault_crash_before_answer!r}")
        return CrashFault.parse(self.fault_crash_before_answer)

    def core_config(self) -> CoordinatorConfig:
        """The pure core's configuration."""
        return CoordinatorConfig(
            rounds=RoundConfig(
                mode=self.mode,
                min_quorum=self.min_quorum,
                grace_max_s=self.grace_max_s,
                max_staleness=self.max_staleness,
            ),
            outer=OuterConfig(self.outer, self.outer_lr, self.outer_momentum),
            merge=self.merge,
            local_steps=self.local_steps,
            min_local_steps=self.min_local_steps,
            dynamic_local_steps=not self.fixed_local_steps and self.mode != "sync",
            scale_partial_rounds=self.scale_partial_rounds,
            expected_workers=self.expected_workers,
            target_outer_steps=self.target_outer_steps,
            confirm_timeout_s=self.confirm_timeout_s if self.healthd_address else 0.0,
            unheard_after_s=min(self.unheard_after_s, self.confirm_timeout_s) if self.healthd_address else 0.0,
            guard=self.guard_config(),
            tokens_per_step=self.task.inner.batch_size * self.task.model.seq_len,
            max_workers=self.max_workers,
            max_departed=self.max_departed,
        )

    def policy_config(self, started_unix_s: float) -> PolicyConfig:
        """The placement policy's settings for a coordinator started at `started_unix_s` (the policy's clock is
        the coordinator's unix time): at least the quorum stays active in `decoupled`."""
        return PolicyConfig(
            policy=parse_policy(self.placement),
            min_active=self.min_quorum if self.mode == "decoupled" else 1,
            deadline_s=started_unix_s + self.deadline_s if self.deadline_s else math.inf,
            carbon_threshold=self.carbon_threshold,
            started_s=started_unix_s,
        )

    def admission(self) -> AdmissionLimits:
        return AdmissionLimits(self.max_calls, self.max_calls_per_client)

    def guard_config(self) -> GuardConfig:
        """The robust merge. With it on (`outlier_factor > 0`), the ceiling comes from the task's AdamW settings;
        not for the sparse codecs (`topk`, `sparse`), whose error feedback holds back most of every update and may
        send it rounds later."""
        inner = self.task.inner
        ceiling = self.outlier_factor > 0 and not codec_class(self.codec).sparse
        return GuardConfig(
            outlier_factor=self.outlier_factor,
            window=self.outlier_window,
            min_samples=self.outlier_min_samples,
            quarantine_strikes=self.quarantine_strikes,
            step_move=inner.lr * adamw_move_bound(inner.betas) if ceiling else 0.0,
            step_decay=inner.lr * inner.weight_decay if ceiling else 0.0,
        )


def _int_in(name: str, value: object, lo: int, hi: int | None = None) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= lo and (hi is None or value <= hi)
    if not ok:
        allowed = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
        raise ConfigError(f"{name} must be {allowed}, got {value!r}")


def _float_min(name: str, value: object, lo: float, *, open_: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = value > lo if open_ else value >= lo  # type: ignore[operator]
    if not ok:
        raise ConfigError(f"{name} must be a finite number {'>' if open_ else '>='} {lo}, got {value!r}")


def _choice(name: str, value: object, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}: unknown value {value!r}; allowed: {', '.join(allowed)}")


# --- flags and environment ------------------------------------------------------------------------------------


# (flag, type, default, help); the env fallback of each is env_name(flag)
_SERVICE_FLAGS: list[Flag] = [
    ("--host", str, "127.0.0.1", "address to bind"),
    ("--port", int, 0, "gRPC port (0: a free port)"),
    ("--metrics-port", int, -1, "Prometheus port (-1: disabled, 0: a free port)"),
    ("--bulk-port", int, 0, "port of the bulk upload path beside gRPC (0: a free port, -1: off)"),
    ("--checkpoint-dir", str, "", "folder for checkpoints ('' : none)"),
    ("--checkpoint-every", int, 5, "rounds between checkpoints"),
    ("--keep-checkpoints", int, 3, "checkpoints to keep"),
    ("--mode", str, "decoupled", f"round policy: {', '.join(MODES)}"),
    ("--min-quorum", int, 2, "K: submissions a decoupled round needs"),
    ("--grace-max-s", float, 2.0, "longest grace window after the K-th arrival"),
    ("--max-staleness", int, 4, "refuse pseudo-gradients staler than this"),
    ("--local-steps", int, 30, "H: inner steps per round for the fastest learner"),
    ("--min-local-steps", int, 5, "H_min"),
    ("--fixed-local-steps", parse_bool, False, "same H for every learner (true/false)"),
    (
        "--scale-partial-rounds",
        parse_bool,
        True,
        "decoupled: a round closed without every learner steps in proportion to the inner steps it holds",
    ),
    (
        "--fragments",
        int,
        1,
        "streaming fragments: P contiguous fragments of the model, each synchronised on its own every H steps "
        "(one every ~H/P steps); 1: the whole model every H steps. 1 <= P <= H and the model's tensors",
    ),
    ("--codec", str, "int8", f"upload codec: {', '.join(CODEC_NAMES)}"),
    (
        "--broadcast-codec",
        str,
        DEFAULT_BROADCAST_CODEC,
        f"parameter broadcasts: {', '.join(BROADCAST_CODECS)} (fp32: full snapshots; else deltas of a shadow "
        "with error feedback, bit-identical on every learner)",
    ),
    ("--broadcast-history", int, 8, "broadcast deltas kept; a learner further behind gets a full snapshot"),
    ("--outer", str, "nesterov", f"outer optimizer: {', '.join(OUTER_NAMES)}"),
    ("--outer-lr", float, 0.7, "outer learning rate"),
    ("--outer-momentum", float, 0.9, "outer momentum"),
    ("--merge", str, "mean", f"merge: {', '.join(MERGE_NAMES)}"),
    ("--expected-workers", int, 0, "M at start (0: unknown)"),
    ("--target-outer-steps", int, 0, "stop applying rounds after this many (0: never)"),
    ("--healthd-address", str, "", "HOST:PORT of healthd, told to learners"),
    ("--eval-every", int, 1, "rounds between validation evaluations (0: never)"),
    ("--eval-tokens", int, 32_768, "validation tokens scored per evaluation (0: the whole split)"),
    ("--seed", int, 0, "seed of the initial parameters and of the training data order"),
    ("--max-upload-bytes", int, 0, "largest pseudo-gradient payload (0: fp32 model size + 1%%)"),
    (
        "--confirm-timeout-s",
        float,
        10.0,
        "with healthd: declare dead a learner not heard of this long after registering",
    ),
    (
        "--unheard-after-s",
        float,
        3.0,
        "with healthd: sooner, once healthd reported other learners this long after one registered, never it "
        "(0: off; keep it above healthd's heartbeat interval + 1 s; above --confirm-timeout-s it adds nothing)",
    ),
    ("--upload-ttl-s", float, 120.0, "how long an interrupted upload is kept for a resume"),
    ("--max-partial-uploads", int, 32, "uploads held at once in all, streaming or kept for a resume (memory bound)"),
    ("--max-uploads-per-worker", int, 2, "uploads one learner may hold at once; more get RESOURCE_EXHAUSTED"),
    (
        "--spill-dir",
        str,
        "",
        "where the uploads being received and the broadcast deltas kept for late learners that are bigger than "
        "--spill-above are held, in unlinked files ('': $TMPDIR, else /var/tmp)",
    ),
    (
        "--spill-above",
        spill_size,
        SPILL_ABOVE,
        "hold an upload or kept delta bigger than this (e.g. 64M) in a file in --spill-dir, not in memory, so "
        "memory does not grow with the uploads held at once (0: every one; never: all in memory)",
    ),
    (
        "--outlier-factor",
        float,
        10.0,
        "refuse and quarantine a pseudo-gradient whose norm per step exceeds this "
        "x the median of recent accepted ones, or what AdamW can produce (0: both off)",
    ),
    ("--outlier-window", int, 32, "accepted norms the outlier median is taken over"),
    ("--outlier-min-samples", int, 3, "accepted norms before the outlier check judges"),
    ("--quarantine-strikes", int, 3, "refusals in a row after which a quarantined learner's shards move away"),
    ("--max-workers", int, 4096, "live learners at most; one more Register gets RESOURCE_EXHAUSTED"),
    ("--max-departed", int, 1024, "records of departed learners kept for ListWorkers (oldest dropped first)"),
    ("--shutdown-grace-s", float, 5.0, "how long SIGTERM waits for in-flight calls"),
    ("--max-calls", int, 8192, "gRPC calls running at once, open streams included (more: RESOURCE_EXHAUSTED)"),
    ("--max-calls-per-client", int, 64, "gRPC calls one connection may run at once"),
    ("--work-threads", int, 4, "threads decoding uploads and writing checkpoints, off the event loop"),
    (
        "--threads",
        int,
        1,
        "threads of each model-sized pass (outer step, merge, broadcast encode): 1 where services share the "
        "cores (diloco local); a coordinator alone on a many-core host: about its cores",
    ),
    (
        "--placement",
        str,
        "speed",
        f"placement policy: {', '.join(POLICY_NAMES)} (speed: shards in proportion to speed; energy: pause learners "
        "far less efficient in joules per token; carbon: pause learners in dirty zones; cost: the cheapest set "
        "that meets --deadline-s)",
    ),
    ("--carbon-trace", str, "", "CSV of zone,time_s,gco2_per_kwh: the zones' carbon intensity over time"),
    (
        "--carbon-trace-origin-unix-s",
        float,
        0.0,
        "the unix time the trace's time_s 0 stands for (0: the coordinator's start)",
    ),
    (
        "--carbon-threshold",
        float,
        0.0,
        "gCO2/kWh above which a zone is dirty (0: the dirtiest zone at each moment, when another is greener)",
    ),
    ("--deadline-s", float, 0.0, "the job should end this many seconds after the coordinator starts (0: none)"),
    (
        "--carbon-provider",
        str,
        "",
        "live intensities: 'package.module:function', called off the event loop as function(zone, unix_s) -> "
        "gCO2/kWh; a call that fails, hangs or returns no finite value >= 0 is counted and the last good value stays",
    ),
    ("--carbon-provider-timeout-s", float, 5.0, "a carbon provider call running longer than this is abandoned"),
    ("--carbon-refresh-s", float, 60.0, "seconds between two rounds of carbon provider calls"),
    ("--log-level", str, "info", f"log level: {', '.join(LOG_LEVELS)}"),
    (
        "--replication-log",
        int,
        0,
        "round-log entries kept for hot standbys to catch up from (0: no replication service); each holds a "
        "model-sized fp32 update, so the leader's memory grows by K model sizes: keep K small for large models "
        "(--replication-log-bytes caps it)",
    ),
    (
        "--replication-log-bytes",
        byte_size,
        0,
        "the most bytes of entries the round log keeps (a byte count or a size like 2G; the newest entry always), "
        "dropping the oldest: a standby further behind gets a snapshot. 0: the bytes of a snapshot's tensors (Θ and "
        "the outer optimizer's state), which a standby needing more entries than that would cost more than",
    ),
    (
        "--sync-replicas",
        int,
        0,
        "publish a version to learners only once this many standbys hold it (needs --replication-log)",
    ),
    (
        "--replica-ack-timeout-s",
        float,
        5.0,
        "longest a round waits for standby acks; then it is published anyway (replication.degraded), unless "
        "--when-no-standby wait",
    ),
    (
        "--when-no-standby",
        str,
        WhenNoStandby.PUBLISH.value,
        "what a leader does with a version too few standbys acknowledged (--sync-replicas): publish (availability: "
        "publish it degraded after --replica-ack-timeout-s) or wait (durability: hold it back from learners, however "
        "long, until a standby acknowledges it; replication.holding / replication.released)",
    ),
    ("--follow", str, "", "HOST:PORT of the leading coordinator: run as its hot standby instead of serving"),
    ("--replica-id", str, "", "this replica's name ('': standby-<hostname>; with --etcd: coordinator-<host>-<port>)"),
    (
        "--etcd",
        str,
        "",
        "http(s)://HOST:PORT of etcd, or up to 5 members comma-separated (tried in turn when one does not answer): "
        "campaign for leadership; the winner serves, the others follow it as hot standbys and take over when its "
        "lease expires (needs --checkpoint-dir and --replication-log). http: loopback only (or "
        "--etcd-private-network); https: needs --etcd-ca-file, and off loopback a client certificate or --etcd-user",
    ),
    (
        "--etcd-private-network",
        parse_bool,
        False,
        "let --etcd name a host off loopback in plain HTTP (anyone on the path reads and writes, and reads "
        "--etcd-user's password), or over https with neither a client certificate nor --etcd-user (etcd cannot tell "
        "who writes) (true/false): only over a private network that nobody else joins (a compose or docker bridge "
        "network)",
    ),
    (
        "--etcd-ca-file",
        str,
        "",
        "etcd over https: the CA that signed etcd's certificate (PEM, e.g. TLS folder's ca.pem)",
    ),
    (
        "--etcd-cert-file",
        str,
        "",
        "etcd over https: this replica's client certificate (PEM, with --etcd-key-file), for an etcd started with "
        "--client-cert-auth (e.g. the TLS folder's coordinator.pem)",
    ),
    ("--etcd-key-file", str, "", "etcd over https: the client certificate's private key (PEM)"),
    (
        "--etcd-user",
        str,
        "",
        "etcd with authentication enabled (`auth enable`): this replica's etcd user, with --etcd-password-file; it "
        "needs readwrite on the keys with prefix /diloco/coordinator/leader",
    ),
    (
        "--etcd-password-file",
        str,
        "",
        "the file holding --etcd-user's password (one line; read and checked at start; the password is never taken "
        "on the command line nor logged)",
    ),
    (
        "--fault-crash-before-answer",
        str,
        "",
        "fault tests only: applied@V (or accepted@V): kill this process (SIGKILL) instead of answering the first "
        "upload whose own call applied round V or later (or that is accepted into round V or later, still open)",
    ),
]
_TASK_FLAGS: list[Flag] = [
    ("--task-json", str, "", "the whole task as JSON (TaskConfig.to_json); overrides the task flags below"),
    ("--data", str, "stdlib", "'stdlib', a text file or folder, a uint16 .bin or .npy token file, or .jsonl/.parquet"),
    ("--max-bytes", int, 2_000_000, "cap on corpus size in bytes (0: none)"),
    ("--shards", int, 16, "number of data shards"),
    ("--d-model", int, 64, "model width"),
    ("--layers", int, 2, "transformer layers"),
    ("--heads", int, 4, "attention heads"),
    ("--seq-len", int, 64, "sequence length"),
    ("--batch-size", int, 8, "inner batch size"),
    ("--inner-lr", float, 3e-3, "inner AdamW learning rate"),
    (
        "--grad-clip",
        float,
        1.0,
        "clip each inner step's gradients to this global norm (0: no clipping; then each parameter takes its AdamW "
        "step in backward as soon as its gradient is complete, and no model-sized gradient buffer is held)",
    ),
    ("--warmup-steps", int, 20, "inner warmup steps"),
    ("--total-steps", int, 2000, "inner steps of the cosine schedule"),
    ("--factory", str, "", "your own model/data: 'package.module:function'"),
    (
        "--model",
        str,
        "",
        "'' (the built-in GPT) or hf:<preset-or-path>: a Hugging Face causal LM from a preset (llama-tiny, ...), "
        "a folder with config.json (weights loaded when present) or a JSON config file",
    ),
    ("--tokenizer", str, "", "'' (bytes) or a local tokenizers JSON file (see `diloco data tokenize`)"),
]


MAX_ETCD_ENDPOINTS = 5  # etcd members a replica may be given (--etcd A,B,C): it moves on when one does not answer
_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
FORMS = "http(s)://HOST:PORT, or up to 5 of them comma-separated (members of one etcd cluster)"


def parse_etcd_endpoints(
    value: object, private_network: bool = False, client_cert: bool = False, user: bool = False
) -> tuple[str, tuple[tuple[str, int], ...]]:
    """'' -> ('', ()); 'SCHEME://HOST:PORT[,SCHEME://HOST:PORT...]' (one scheme, http or https, for every member; at
    most `MAX_ETCD_ENDPOINTS`, no repeats) -> (SCHEME, ((HOST, PORT), ...)); anything else is a ConfigError. A host
    off loopback needs https with a client certificate (`client_cert`) or an etcd user (`user`: a password, sent
    encrypted): either way etcd can tell who writes; or `private_network` (a network nobody else joins, e.g.
    compose's). A user over plain HTTP counts for nothing there: anyone on the path reads its password."""
    if not isinstance(value, str) or len(value) > 512 or not value.isprintable():
        raise ConfigError(f"etcd must be {FORMS}, at most 512 printable characters, got {value!r} (flag --etcd)")
    if not value:
        return "", ()
    parts = [p.strip() for p in value.split(",")]
    if len(parts) > MAX_ETCD_ENDPOINTS:
        raise ConfigError(f"etcd: {len(parts)} endpoints given; give {FORMS} (flag --etcd)")
    parsed = [_etcd_endpoint(p) for p in parts]
    schemes = {scheme for scheme, _ in parsed}
    if len(schemes) > 1:
        raise ConfigError(f"etcd: give every member with the same scheme, all http:// or all https://, got {value!r}")
    (scheme,) = schemes
    endpoints = tuple(endpoint for _, endpoint in parsed)
    if len(set(endpoints)) != len(endpoints):
        raise ConfigError(f"etcd: an endpoint is given twice in {value!r}; give each member once (flag --etcd)")
    open_ok = private_network or (scheme == "https" and (client_cert or user))
    for host, _ in endpoints:
        if not open_ok and host not in _LOOPBACK and not host.startswith("127."):
            if scheme == "https":
                how = "https without a client certificate or an etcd user (etcd cannot tell who writes)"
            elif user:
                how = "plain HTTP, even with --etcd-user (its password would travel in clear)"
            else:
                how = "plain HTTP (etcd cannot tell who writes)"
            raise ConfigError(
                f"etcd endpoint must be on loopback with {how}, got host {host!r} (flag --etcd); give https:// with "
                "--etcd-ca-file and either --etcd-cert-file and --etcd-key-file (etcd with --client-cert-auth) or "
                "--etcd-user and --etcd-password-file (etcd with auth enabled), or on a private network (containers) "
                "add --etcd-private-network true"
            )
    return scheme, endpoints


def _etcd_endpoint(text: str) -> tuple[str, tuple[str, int]]:
    m = re.fullmatch(r"(https?)://(\[::1\]|[A-Za-z0-9.\-]+):([0-9]{1,5})/?", text)
    if m is None:
        raise ConfigError(f"etcd endpoint must be http(s)://HOST:PORT, got {text[:80]!r}; give {FORMS} (flag --etcd)")
    scheme, host, port = m.group(1), m.group(2), int(m.group(3))
    if not 1 <= port <= 65535:
        raise ConfigError(f"etcd port must be in 1..65535, got {port} (flag --etcd)")
    return scheme, (host.strip("[]"), port)


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    p = build_flag_parser(
        "python -m services.coordinator",
        "Run the Decoupled DiLoCo coordinator.",
        [("service", _SERVICE_FLAGS), ("task", _TASK_FLAGS)],
        env,
    )
    security.add_flags(p, env, tls_name="coordinator", tokens=("join", "admin"))
    return p


def parse(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> CoordinatorServiceConfig:
    """Read the configuration from flags (`argv`, default `sys.argv[1:]`) with environment fallbacks (`env`,
    default `os.environ`). Raises `ConfigError` with a message naming the flag or field."""
    env = os.environ if env is None else env
    a = build_parser(env).parse_args(argv)
    return config_from_flags(CoordinatorServiceConfig, a, task=task_from_flags(a), security=security.from_args(a, env))
