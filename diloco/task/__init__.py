"""The training task: a small GPT (`model`), byte-level data in shards (`data`), the inner AdamW loop of
a learner (`inner`), flat parameter vectors (`params`) and the JSON task config with its plug-in hook
(`factory`). Pure torch + stdlib (+ numpy); no gRPC."""

from diloco.task.data import Corpus, DataConfig, EvalResult, decode, encode, evaluate
from diloco.task.factory import Task, TaskConfig, build_task
from diloco.task.inner import (
    InnerConfig,
    InnerTrainer,
    RoundResult,
    ShardRangeT,
    ShardWork,
    Throughput,
    lr_at,
)
from diloco.task.model import GPT, ModelConfig, model_fingerprint, pick_device
from diloco.task.params import ParamSpec, flatten_params, load_flat_, param_specs

__all__ = [
    "GPT",
    "Corpus",
    "DataConfig",
    "EvalResult",
    "InnerConfig",
    "InnerTrainer",
    "ModelConfig",
    "ParamSpec",
    "RoundResult",
    "ShardRangeT",
    "ShardWork",
    "Task",
    "TaskConfig",
    "Throughput",
    "build_task",
    "decode",
    "encode",
    "evaluate",
    "flatten_params",
    "load_flat_",
    "lr_at",
    "model_fingerprint",
    "param_specs",
    "pick_device",
]
