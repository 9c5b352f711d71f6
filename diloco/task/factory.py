"""The training task as one config (`TaskConfig`, JSON round-trippable) and its built form (`Task`).

Bring your own model and data
-----------------------------
Set `TaskConfig.factory = "package.module:function"`. `build_task` imports the module and calls::

    def function(cfg: TaskConfig) -> tuple[Callable[[int], nn.Module], Corpus | None]

It returns `(model_fn, corpus)`: `model_fn(seed)` builds a fresh model (deterministically for a given seed)
that defines `loss(x, y) -> Tensor` for int64 token batches `x`, `y` of shape (batch, cfg.model.seq_len);
`corpus` is the data (e.g. `Corpus(tokens, cfg.data)` over your own uint16 token array, or over a list of
`(document_id, tokens)` pairs so the validation split keeps documents whole), or None to load
`cfg.data` as usual. Token ids must stay below `cfg.model.vocab_size`. The fingerprint then hashes the factory
path, the model config and the parameter layout, so learners with a different model are refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from torch import nn

from diloco.errors import ConfigError
from diloco.task.data import Corpus, DataConfig, model_loss
from diloco.task.inner import InnerConfig
from diloco.task.model import GPT, ModelConfig, model_fingerprint
from diloco.task.params import param_specs, specs_fingerprint

C = TypeVar("C")
ModelFn = Callable[[int], nn.Module]


def config_to_dict(cfg: object) -> dict[str, Any]:
    """A config dataclass as a JSON-ready dict (tuples become lists)."""
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        raise TypeError(f"expected a config dataclass instance, got {cfg!r}")
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def config_from_dict(cls: type[C], data: object, section: str) -> C:
    """Build config `cls` from a dict, rejecting unknown keys; missing keys take their defaults."""
    if not isinstance(data, dict):
        raise ConfigError(f"{section} must be a JSON object, got {type(data).__name__}")
    allowed = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ConfigError(f"{section}: unknown keys {unknown}; allowed: {sorted(allowed)}")
    try:
        return cls(**data)
    except TypeError as e:
        raise ConfigError(f"{section}: {e}") from e


@dataclass(frozen=True)
class TaskConfig:
    """Model, data and inner optimizer; `factory` optionally names a user `"package.module:function"`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    factory: str = ""

    def __post_init__(self) -> None:
        for name, cls in (("model", ModelConfig), ("data", DataConfig), ("inner", InnerConfig)):
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"task.{name} must be a {cls.__name__}, got {getattr(self, name)!r}")
        if not isinstance(self.factory, str):
            raise ConfigError(f"task.factory must be a string 'package.module:function', not {self.factory!r}")
        if self.factory:
            _split_factory(self.factory)

    def to_json(self) -> str:
        """Stable JSON (sorted keys)."""
        return json.dumps(config_to_dict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TaskConfig:
        """Parse and validate; unknown keys anywhere raise `ConfigError`."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"task config is not valid JSON: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"task config must be a JSON object, got {type(data).__name__}")
        unknown = sorted(set(data) - {"model", "data", "inner", "factory"})
        if unknown:
            raise ConfigError(f"task: unknown keys {unknown}; allowed: ['data', 'factory', 'inner', 'model']")
        return cls(
            model=config_from_dict(ModelConfig, data.get("model", {}), "model"),
            data=config_from_dict(DataConfig, data.get("data", {}), "data"),
            inner=config_from_dict(InnerConfig, data.get("inner", {}), "inner"),
            factory=data.get("factory", ""),
        )


@dataclass(frozen=True)
class Task:
    """A built task: the corpus, a model constructor and the fingerprint learners must match."""

    config: TaskConfig
    corpus: Corpus
    fingerprint: str
    build_model: ModelFn

    def model_fn(self, seed: int = 0) -> nn.Module:
        """A fresh model with deterministic initial parameters for `seed`."""
        return self.build_model(seed)


def _split_factory(path: str) -> tuple[str, str]:
    module, sep, name = path.partition(":")
    if not sep or not module or not name.isidentifier():
        raise ConfigError(f"task.factory must look like 'package.module:function', got {path!r}")
    return module, name


def load_factory(path: str) -> Callable[[TaskConfig], Any]:
    """Import the user factory named `"package.module:function"`."""
    module_name, name = _split_factory(path)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"task.factory {path!r}: cannot import module {module_name!r} ({e})") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"task.factory {path!r}: module {module_name!r} has no callable {name!r}")
    return fn


def _gpt_builder(model_cfg: ModelConfig) -> ModelFn:
    def build(seed: int) -> nn.Module:
        return GPT(model_cfg, seed=seed)

    return build


def build_task(cfg: TaskConfig) -> Task:
    """Load the corpus and set up the model constructor; checks vocab and shard sizes against the config."""
    corpus: Corpus | None
    if cfg.factory:
        out = load_factory(cfg.factory)(cfg)
        if not (isinstance(out, tuple) and len(out) == 2 and callable(out[0])):
            raise ConfigError(f"task.factory {cfg.factory!r} must return (model_fn, corpus_or_None)")
        build: ModelFn = out[0]
        corpus = out[1]
        if corpus is not None and not isinstance(corpus, Corpus):
            raise ConfigError(f"task.factory {cfg.factory!r} returned {type(corpus).__name__}, not a Corpus")
        probe = build(0)
        if not isinstance(probe, nn.Module):
            raise ConfigError(f"task.factory {cfg.factory!r}: model_fn(seed) must return an nn.Module")
        model_loss(probe)
        blob = f"{cfg.factory}|{config_to_dict(cfg.model)}|{specs_fingerprint(param_specs(probe))}"
        fingerprint = hashlib.sha256(blob.encode()).hexdigest()[:16]
    else:
        build = _gpt_builder(cfg.model)
        corpus = None
        fingerprint = model_fingerprint(cfg.model)
    if corpus is None:
        corpus = Corpus.load(cfg.data)
    corpus.check_vocab(cfg.model.vocab_size)
    corpus.check_batch(cfg.inner.batch_size, cfg.model.seq_len)
    return Task(config=cfg, corpus=corpus, fingerprint=fingerprint, build_model=build)


def task_from_flags(a: Any) -> TaskConfig:
    """The task from parsed command-line flags (`--task-json`, or `--data --max-bytes --shards --d-model --layers
    --heads --seq-len --batch-size --inner-lr --warmup-steps --total-steps --factory`). A `--seed` flag, where the
    command has one, also orders the training data (`DataConfig.seed`), so a run's seed changes the data order as
    well as the initial parameters."""
    if getattr(a, "task_json", ""):
        return TaskConfig.from_json(a.task_json)
    return TaskConfig(
        model=ModelConfig(seq_len=a.seq_len, d_model=a.d_model, n_layers=a.layers, n_heads=a.heads),
        data=DataConfig(source=a.data, num_shards=a.shards, max_bytes=a.max_bytes, seed=getattr(a, "seed", 0)),
        inner=InnerConfig(
            lr=a.inner_lr, warmup_steps=a.warmup_steps, total_steps=a.total_steps, batch_size=a.batch_size
        ),
        factory=a.factory,
    )
