"""Hugging Face causal language models as a task factory (the `hf` extra), offline.

Use it as `--model hf:<preset-or-path>` (`TaskConfig.model_name`), or as `--factory diloco.task.hf:causal_lm`
(then `model_name` picks the model, `llama-tiny` when empty). `<preset-or-path>` is one of:

- a preset name (`PRESETS`): `llama-tiny` (4 Llama layers, hidden 64: trains on a CPU in tests), `llama-small`
  (8 layers, hidden 256), `llama-100m` (12 layers, hidden 768: about 100 M parameters with a 32k vocabulary);
  their vocabulary is the tokenizer's (256 for bytes) and their context `max(seq_len, 128)`;
- a folder holding `config.json`: randomly initialised from it, or loaded from its weights when the folder is a
  `save_pretrained` output (`model.safetensors`, `pytorch_model.bin` or a sharded index);
- a JSON config file (`config.json` of any causal LM `transformers` knows): randomly initialised.

Nothing is downloaded: the hub is switched off (`HF_HUB_OFFLINE=1`) before `transformers` is imported and every
load is `local_files_only`. Random initialisation is deterministic for a seed, whatever the global RNG.

The model is wrapped in `CausalLM`, a thin `nn.Module` with the interface the training loop expects
(`forward(idx) -> logits`, `loss(x, y)`, `vocab_size`), so flat parameters, merge segments and evaluation work
unchanged; its parameters are the HF model's, named `lm.<hf name>`. Every failure to build (an unknown preset, a
path that does not exist, a config `transformers` refuses, a context longer than the model's positions, a
tokenizer larger than the model's vocabulary) is a `ConfigError` naming the setting.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from diloco.errors import ConfigError
from diloco.task._validate import hf_extra
from diloco.task.data import Corpus
from diloco.task.factory import HF_PREFIX, TaskConfig

DEFAULT_PRESET = "llama-tiny"
_BOOKKEEPING = (
    "transformers_version",
    "_name_or_path",
    "dtype",
    "torch_dtype",
    "architectures",
    "_attn_implementation",
)
_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)

# preset -> Llama config fields (vocab_size and max_position_embeddings are filled from the task)
PRESETS: dict[str, dict[str, Any]] = {
    "llama-tiny": {
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "llama-small": {
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
    },
    "llama-100m": {
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
    },
}
_PRESET_COMMON: dict[str, Any] = {
    "model_type": "llama",
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-5,
    "attention_bias": False,
    "mlp_bias": False,
}


def _transformers() -> Any:
    return hf_extra("transformers", "--model hf:...")


class CausalLM(nn.Module):
    """A Hugging Face causal LM with the training loop's interface: `forward(idx) -> logits (B, T, V)`,
    `loss(x, y) -> mean next-token cross-entropy` (computed in fp32), `vocab_size`, `fingerprint_extra`."""

    def __init__(self, lm: nn.Module, *, seq_len: int) -> None:
        super().__init__()
        self.lm = lm
        config: Any = lm.config
        self.seq_len = seq_len
        self.vocab_size = int(config.vocab_size)
        self.fingerprint_extra = json.dumps(_config_dict(config), sort_keys=True)

    def enable_activation_checkpointing(self) -> None:
        """Hugging Face's gradient checkpointing of the decoder layers (non-reentrant): the gradients are the
        same, activations are computed again in backward. `ConfigError` for a model class without it."""
        lm: Any = self.lm
        try:
            if hasattr(lm, "activation_checkpointing_enable"):  # transformers 5.x
                lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        except ValueError as e:  # transformers: the class does not support gradient checkpointing
            raise ConfigError(f"--activation-checkpointing: {e}") from None

    def forward(self, idx: Tensor) -> Tensor:
        logits: Tensor = self.lm(input_ids=idx, use_cache=False).logits
        return logits

    def loss(self, x: Tensor, y: Tensor) -> Tensor:
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def _config_dict(config: Any) -> dict[str, Any]:
    """The config fields that define the model (library version and dtype bookkeeping left out)."""
    d = config.to_dict()
    for key in _BOOKKEEPING:
        d.pop(key, None)
    out: dict[str, Any] = json.loads(json.dumps(d, default=str))
    return out


def _tokenizer_vocab(cfg: TaskConfig) -> int:
    if not cfg.data.tokenizer:
        return 256
    from diloco.task.tokenizer import vocab_size

    return vocab_size(cfg.data.tokenizer)


def _config_from_json(path: Path, setting: str) -> Any:
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{setting}: {path} is not a readable JSON config: {e}") from e
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        raise ConfigError(f"{setting}: {path} must be a JSON object with a 'model_type' (e.g. \"llama\")")
    model_type = raw.pop("model_type")
    try:
        return _transformers().AutoConfig.for_model(model_type, **raw)
    except Exception as e:  # transformers raises ValueError/KeyError/TypeError for bad configs
        raise ConfigError(f"{setting}: the config in {path} does not build: {type(e).__name__}: {e}") from e


def resolve(cfg: TaskConfig) -> tuple[Any, Path | None]:
    """The HF config named by `cfg.model_name` (or the default preset) and the folder to load weights from, if
    any."""
    spec = cfg.model_name[len(HF_PREFIX) :] if cfg.model_name else DEFAULT_PRESET
    setting = f"--model hf:{spec} (task.model_name)"
    if spec in PRESETS:
        fields = {
            **_PRESET_COMMON,
            **PRESETS[spec],
            "vocab_size": _tokenizer_vocab(cfg),
            "max_position_embeddings": max(cfg.model.seq_len, 128),
        }
        return _config_from_json_dict(fields, setting), None
    path = Path(spec).expanduser()
    if not path.exists():
        raise ConfigError(
            f"{setting}: no preset and no local path of that name; presets: {', '.join(PRESETS)}; or give a folder "
            "with config.json (a save_pretrained folder loads its weights) or a JSON config file"
        )
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"{setting}: folder {path} holds no config.json")
        config = _config_from_json(path / "config.json", setting)
        weights = path if any((path / f).is_file() for f in _WEIGHT_FILES) else None
        return config, weights
    return _config_from_json(path, setting), None


def _config_from_json_dict(fields: dict[str, Any], setting: str) -> Any:
    fields = dict(fields)
    model_type = fields.pop("model_type")
    try:
        return _transformers().AutoConfig.for_model(model_type, **fields)
    except Exception as e:
        raise ConfigError(f"{setting}: the config does not build: {type(e).__name__}: {e}") from e


def _check(cfg: TaskConfig, config: Any, setting: str) -> None:
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if isinstance(positions, int) and cfg.model.seq_len > positions:
        raise ConfigError(
            f"model.seq_len (--seq-len) = {cfg.model.seq_len} exceeds the {positions} positions of {setting}; "
            "lower --seq-len or raise max_position_embeddings in the config"
        )
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 1:
        raise ConfigError(f"{setting}: the config has no valid vocab_size ({vocab!r})")
    need = _tokenizer_vocab(cfg)
    if need > vocab:
        what = f"data.tokenizer {cfg.data.tokenizer!r}" if cfg.data.tokenizer else "the byte tokenizer"
        raise ConfigError(
            f"{what} has {need} tokens, more than the vocab_size {vocab} of {setting}: use a config with "
            f"vocab_size >= {need} or a smaller tokenizer"
        )


def build_model(cfg: TaskConfig, seed: int) -> CausalLM:
    """The model named by `cfg.model_name`: weights from a `save_pretrained` folder, else random init for
    `seed` (deterministic, the global RNG untouched)."""
    config, weights = resolve(cfg)
    setting = f"--model {cfg.model_name or HF_PREFIX + DEFAULT_PRESET} (task.model_name)"
    _check(cfg, config, setting)
    auto = _transformers().AutoModelForCausalLM
    try:
        if weights is not None:
            lm = auto.from_pretrained(str(weights), local_files_only=True, dtype=torch.float32)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                lm = auto.from_config(config, dtype=torch.float32)
    except ConfigError:
        raise
    except Exception as e:  # a config transformers cannot instantiate, unreadable weights
        raise ConfigError(f"{setting}: the model does not build: {type(e).__name__}: {e}") from e
    return CausalLM(lm.float(), seq_len=cfg.model.seq_len)


def causal_lm(cfg: TaskConfig) -> tuple[Callable[[int], nn.Module], Corpus | None]:
    """The task factory: `(model_fn, None)`, the data read from `cfg.data` as usual."""
    resolve(cfg)  # fail fast on a bad name before any data is read

    def model_fn(seed: int) -> nn.Module:
        return build_model(cfg, seed)

    return model_fn, None
