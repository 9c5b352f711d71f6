"""The training task as one config (`TaskConfig`, JSON round-trippable) and its built form (`Task`).

Bring your own model and data
-----------------------------
Set `TaskConfig.factory = "package.module:function"`. `build_task` imports the module and calls::

    def function(cfg: TaskConfig) -> tuple[Callable[[int], nn.Module], Corpus | None]

It returns `(model_fn, corpus)`: `model_fn(seed)` builds a fresh model (deterministically for a given seed)
that defines `loss(x, y) -> Tensor` for int64 token batches `x`, `y` of shape (batch, cfg.model.seq_len);
`corpus` is the data (e.g. `Corpus(tokens, cfg.data)` over your own uint16 token array, or over a list of
`(document_id, tokens)` pairs so the validation split keeps documents whole), or None to load
`cfg.data` as usual. Token ids must stay below the model's `vocab_size` attribute when it has one, else
`cfg.model.vocab_size`. A factory that raises is reported as a `ConfigError` naming it.

The fingerprint
---------------
`Task.fingerprint` tells whether two processes built the same task from their own files. It has three named parts,
each the first 12 hex digits of a sha256 of contents, never of file paths (the same config in another folder gives
the same fingerprint), rendered as one 44-character string::

    m=<model>.t=<tokenizer>.d=<data>        e.g. m=3f2a9c0d1b7e.t=9a4e0b1c2d3f.d=07c1d2e3f4a5

- `model` (m): the built-in GPT's architecture (`model_fingerprint(cfg.model)`); for a factory (or `model_name`)
  the factory path, the model config, the model's `fingerprint_extra` string when it has one (the Hugging Face
  adapter puts its full config there) and the parameter layout;
- `tokenizer` (t): the tokenizer file's bytes (`data.tokenizer`), or the fixed word "bytes" without one;
- `data` (d): the corpus as built, its tokens and split (`Corpus.fingerprint`).

`fingerprint_differences(a, b)` names the parts in which two fingerprints differ (every part when either is not
of this form, e.g. the 16 hex digits of older builds), and `fingerprint_mismatch` says it in a sentence with what
to do. The coordinator refuses a Register whose non-empty fingerprint differs (FAILED_PRECONDITION); a learner
that adopts the coordinator's task (task_json) compares the task it built with `RegisterResponse.task_fingerprint`
and leaves (exit status 2) when they differ, so no learner trains on other data.

Hugging Face models: `TaskConfig.model_name = "hf:<preset-or-path>"` (flag `--model`) selects the built-in
factory `diloco.task.hf:causal_lm` (see that module) without naming it in `factory`.
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
HF_FACTORY = "diloco.task.hf:causal_lm"
HF_PREFIX = "hf:"
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
    """Model, data and inner optimizer; `factory` optionally names a user `"package.module:function"`;
    `model_name` is empty (the built-in GPT) or `"hf:<preset-or-path>"` (a Hugging Face causal LM)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    factory: str = ""
    model_name: str = ""

    def __post_init__(self) -> None:
        for name, cls in (("model", ModelConfig), ("data", DataConfig), ("inner", InnerConfig)):
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"task.{name} must be a {cls.__name__}, got {getattr(self, name)!r}")
        if not isinstance(self.factory, str):
            raise ConfigError(f"task.factory must be a string 'package.module:function', not {self.factory!r}")
        if self.factory:
            _split_factory(self.factory)
        if not isinstance(self.model_name, str) or (
            self.model_name and not (self.model_name.startswith(HF_PREFIX) and len(self.model_name) > len(HF_PREFIX))
        ):
            raise ConfigError(
                f"task.model_name (--model) must be '' (the built-in GPT) or 'hf:<preset-or-path>', "
                f"got {self.model_name!r}"
            )

    def factory_path(self) -> str:
        """The factory `build_task` calls: `factory`, else the Hugging Face one for an `hf:` model, else ''."""
        return self.factory or (HF_FACTORY if self.model_name else "")

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
        allowed = ["data", "factory", "inner", "model", "model_name"]
        unknown = sorted(set(data) - set(allowed))
        if unknown:
            raise ConfigError(f"task: unknown keys {unknown}; allowed: {allowed}")
        return cls(
            model=config_from_dict(ModelConfig, data.get("model", {}), "model"),
            data=config_from_dict(DataConfig, data.get("data", {}), "data"),
            inner=config_from_dict(InnerConfig, data.get("inner", {}), "inner"),
            factory=data.get("factory", ""),
            model_name=data.get("model_name", ""),
        )


FINGERPRINT_PARTS = ("model", "tokenizer", "data")  # in the order of the rendered string
_PART_KEYS = dict(zip(FINGERPRINT_PARTS, "mtd", strict=True))
PART_HEX = 12  # hex digits of a sha256 kept per part
_ADVICE = {
    "model": "the same model (--model/--factory, the model flags, model files and factory code; or the coordinator's "
    "task_json)",
    "tokenizer": "the same tokenizer file (--tokenizer, data.tokenizer)",
    "data": "the same data (--data, data.source: the same file contents, not only the same path)",
}


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:PART_HEX]


@dataclass(frozen=True)
class Fingerprint:
    """The task's fingerprint by part (module docstring): each part `PART_HEX` lowercase hex digits."""

    model: str
    tokenizer: str
    data: str

    def __post_init__(self) -> None:
        for name in FINGERPRINT_PARTS:
            value = getattr(self, name)
            if len(value) != PART_HEX or value.strip("0123456789abcdef"):
                raise ValueError(f"fingerprint part {name} must be {PART_HEX} lowercase hex digits, got {value!r}")

    def __str__(self) -> str:
        return ".".join(f"{_PART_KEYS[name]}={getattr(self, name)}" for name in FINGERPRINT_PARTS)

    @classmethod
    def parse(cls, text: str) -> Fingerprint | None:
        """The parts of a rendered fingerprint; None when `text` is not of the form `m=<hex>.t=<hex>.d=<hex>`."""
        pieces = text.split(".")
        if len(pieces) != len(FINGERPRINT_PARTS):
            return None
        values: dict[str, str] = {}
        for name, piece in zip(FINGERPRINT_PARTS, pieces, strict=True):
            key, sep, value = piece.partition("=")
            if key != _PART_KEYS[name] or not sep:
                return None
            values[name] = value
        try:
            return cls(**values)
        except ValueError:
            return None


def fingerprint_differences(a: str, b: str) -> tuple[str, ...]:
    """The names of the parts (`FINGERPRINT_PARTS`) in which fingerprints `a` and `b` differ; every part when they
    differ and either is not of the form `m=<hex>.t=<hex>.d=<hex>` (e.g. an older build's 16 hex digits)."""
    if a == b:
        return ()
    pa, pb = Fingerprint.parse(a), Fingerprint.parse(b)
    if pa is None or pb is None:
        return FINGERPRINT_PARTS
    return tuple(name for name in FINGERPRINT_PARTS if getattr(pa, name) != getattr(pb, name))


def _and(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def fingerprint_mismatch(learner: str, coordinator: str) -> str:
    """Empty when the learner's task fingerprint matches the coordinator's; else a sentence naming the parts that
    differ, both values of each, and what to do. Either may be caller input: bound and check it first (the
    coordinator's limits allow 64 printable characters)."""
    differ = fingerprint_differences(learner, coordinator)
    if not differ:
        return ""
    pl, pc = Fingerprint.parse(learner), Fingerprint.parse(coordinator)
    if pl is None or pc is None:
        odd = "learner's" if pl is None else "coordinator's"
        return (
            f"the {odd} task fingerprint is not of the form m=<hex>.t=<hex>.d=<hex> (learner {learner!r}, "
            f"coordinator {coordinator!r}), so model, tokenizer and data may all differ: run the learner with "
            "the coordinator's diloco version and task (task_json), or leave its fingerprint empty to adopt that task"
        )
    verb = "differs" if len(differ) == 1 else "differ"
    values = ", ".join(f"{name} {getattr(pl, name)} vs {getattr(pc, name)}" for name in differ)
    return (
        f"the learner's {_and(list(differ))} {verb} from the coordinator's ({values}): give the learner "
        f"{_and([_ADVICE[name] for name in differ])} as the coordinator"
    )


@dataclass(frozen=True)
class Task:
    """A built task: the corpus, a model constructor and the fingerprint learners must match (by part)."""

    config: TaskConfig
    corpus: Corpus
    parts: Fingerprint
    build_model: ModelFn

    @property
    def fingerprint(self) -> str:
        """The rendered fingerprint `m=<hex>.t=<hex>.d=<hex>` (module docstring)."""
        return str(self.parts)

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


def _call_factory(cfg: TaskConfig, path: str) -> tuple[ModelFn, Corpus | None, nn.Module]:
    """Run the factory and build one model to check it; any failure is a `ConfigError` naming the factory."""
    try:
        out = load_factory(path)(cfg)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"task.factory {path!r} failed: {type(e).__name__}: {e}") from e
    if not (isinstance(out, tuple) and len(out) == 2 and callable(out[0])):
        raise ConfigError(f"task.factory {path!r} must return (model_fn, corpus_or_None)")
    build: ModelFn = out[0]
    corpus = out[1]
    if corpus is not None and not isinstance(corpus, Corpus):
        raise ConfigError(f"task.factory {path!r} returned {type(corpus).__name__}, not a Corpus")
    try:
        probe = build(0)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"task.factory {path!r}: model_fn(0) failed: {type(e).__name__}: {e}") from e
    if not isinstance(probe, nn.Module):
        raise ConfigError(f"task.factory {path!r}: model_fn(seed) must return an nn.Module")
    model_loss(probe)
    return build, corpus, probe


def _tokenizer_digest(cfg: TaskConfig) -> str:
    if not cfg.data.tokenizer:
        return _digest("bytes")
    from diloco.task.tokenizer import file_digest, load_tokenizer

    load_tokenizer(cfg.data.tokenizer)  # a missing or malformed file is a ConfigError naming data.tokenizer
    return file_digest(cfg.data.tokenizer)[:PART_HEX]


def build_task(cfg: TaskConfig) -> Task:
    """Load the corpus and set up the model constructor; checks vocab and shard sizes against the config, and
    fingerprints model, tokenizer and data (module docstring)."""
    corpus: Corpus | None
    factory = cfg.factory_path()
    if factory:
        build, corpus, probe = _call_factory(cfg, factory)
        if corpus is None:
            corpus = Corpus.load(cfg.data)
        extra = getattr(probe, "fingerprint_extra", "")
        model_part = _digest(
            "|".join(  # contents, not file paths: the same config in another folder is the same model
                [
                    factory,
                    json.dumps(config_to_dict(cfg.model), sort_keys=True),
                    extra if isinstance(extra, str) else "",
                    specs_fingerprint(param_specs(probe)),
                ]
            )
        )
        vocab = getattr(probe, "vocab_size", cfg.model.vocab_size)
        vocab_size = vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else cfg.model.vocab_size
    else:
        build = _gpt_builder(cfg.model)
        corpus = Corpus.load(cfg.data)
        model_part = model_fingerprint(cfg.model)[:PART_HEX]
        vocab_size = cfg.model.vocab_size
    if cfg.data.tokenizer:
        from diloco.task.tokenizer import vocab_size as tokenizer_vocab

        n = tokenizer_vocab(cfg.data.tokenizer)
        if n > vocab_size:
            raise ConfigError(
                f"data.tokenizer {cfg.data.tokenizer!r} has {n} tokens, more than the model's vocab_size "
                f"{vocab_size}: use a model with a vocabulary of at least {n} (model.vocab_size, or the "
                "vocab_size of the Hugging Face config) or a smaller tokenizer"
            )
    corpus.check_vocab(vocab_size)
    corpus.check_batch(cfg.inner.batch_size, cfg.model.seq_len)
    parts = Fingerprint(model=model_part, tokenizer=_tokenizer_digest(cfg), data=corpus.fingerprint[:PART_HEX])
    return Task(config=cfg, corpus=corpus, parts=parts, build_model=build)


def task_from_flags(a: Any) -> TaskConfig:
    """The task from parsed command-line flags (`--task-json`, or `--data --max-bytes --shards --d-model --layers
    --heads --seq-len --batch-size --inner-lr --warmup-steps --total-steps --factory`, and `--model --tokenizer
    --grad-clip` where the command has them). A `--seed` flag, where the command has one, also orders the training
    data (`DataConfig.seed`), so a run's seed changes the data order as well as the initial parameters."""
    if getattr(a, "task_json", ""):
        return TaskConfig.from_json(a.task_json)
    return TaskConfig(
        model=ModelConfig(seq_len=a.seq_len, d_model=a.d_model, n_layers=a.layers, n_heads=a.heads),
        data=DataConfig(
            source=a.data,
            num_shards=a.shards,
            max_bytes=a.max_bytes,
            seed=getattr(a, "seed", 0),
            tokenizer=getattr(a, "tokenizer", ""),
        ),
        inner=InnerConfig(
            lr=a.inner_lr,
            warmup_steps=a.warmup_steps,
            total_steps=a.total_steps,
            batch_size=a.batch_size,
            grad_clip=getattr(a, "grad_clip", InnerConfig.grad_clip),
        ),
        factory=a.factory,
        model_name=getattr(a, "model", ""),
    )
