"""Hugging Face models, tokenizers and token files (issue #12, items 4 and 5): built offline from presets, config
files and `save_pretrained` folders; trained by the unchanged inner loop; fingerprinted; bad input refused with a
`ConfigError` naming the setting."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from diloco.cli.main import main
from diloco.cluster import TINY_TASK_ARGS
from diloco.errors import ConfigError
from diloco.task.data import Corpus, DataConfig, evaluate
from diloco.task.factory import HF_FACTORY, TaskConfig, build_task, fingerprint_differences
from diloco.task.hf import CausalLM
from diloco.task.inner import InnerConfig, InnerTrainer
from diloco.task.model import ModelConfig, model_fingerprint
from diloco.task.params import flatten_params, load_flat_, merge_segments, param_specs
from diloco.task.tokenizer import write_tokens
from tests.support import Events, cluster_config, running, wait_for

pytest.importorskip("transformers")

CPU = torch.device("cpu")
SEQ = 32
MODEL = ModelConfig(seq_len=SEQ)
INNER = InnerConfig(batch_size=8, lr=3e-3, warmup_steps=2, total_steps=200)
TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(600))


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return path


def task(text_file: Path, model_name: str = "hf:llama-tiny", **data: object) -> TaskConfig:
    return TaskConfig(
        model=MODEL,
        data=DataConfig(source=str(text_file), num_shards=2, **data),  # type: ignore[arg-type]
        inner=INNER,
        model_name=model_name,
    )


def llama_config(tmp_path: Path, name: str, **fields: object) -> Path:
    cfg = {
        "model_type": "llama",
        "vocab_size": 256,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        **fields,
    }
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return path


def _failing_factory(cfg: TaskConfig) -> object:
    raise RuntimeError("out of coffee")


# --- building and training ---------------------------------------------------------------------------------------


def test_llama_tiny_trains_with_the_inner_loop(text_file: Path) -> None:
    t = build_task(task(text_file))
    model = t.model_fn(0)
    assert isinstance(model, CausalLM) and model.vocab_size == 256
    assert len({s.name for s in param_specs(model)}) == len(merge_segments(model)) > 20
    assert torch.equal(flatten_params(t.model_fn(3)), flatten_params(t.model_fn(3)))
    assert not torch.equal(flatten_params(t.model_fn(3)), flatten_params(t.model_fn(4)))
    before = evaluate(model, t.corpus, SEQ, 2048, CPU).loss
    trainer = InnerTrainer(model, t.corpus, INNER, seq_len=SEQ, device=CPU)
    first = trainer.train([(0, 0, 0)], 15)
    second = trainer.train([(0, 0, first.ranges[0].end)], 15)
    assert second.loss < first.loss - 0.3, (first.loss, second.loss)
    assert evaluate(model, t.corpus, SEQ, 2048, CPU).loss < before - 0.3
    # the flat vector round-trips through the adapter, as the coordinator's parameters do
    fresh = t.model_fn(0)
    load_flat_(fresh, trainer.params_flat())
    assert torch.equal(flatten_params(fresh), trainer.params_flat())


def test_the_factory_name_works_like_the_model_flag(text_file: Path) -> None:
    by_name = build_task(task(text_file))
    by_factory = build_task(dataclasses.replace(task(text_file, ""), factory=HF_FACTORY))
    assert by_factory.config.model_name == "" and by_name.config.factory == ""
    assert torch.equal(flatten_params(by_name.model_fn(1)), flatten_params(by_factory.model_fn(1)))  # llama-tiny
    assert TaskConfig.from_json(by_name.config.to_json()) == by_name.config


def test_save_pretrained_folder_loads_its_weights(text_file: Path, tmp_path: Path) -> None:
    t = build_task(task(text_file))
    saved = t.model_fn(7)
    folder = tmp_path / "ckpt"
    assert isinstance(saved, CausalLM)
    saved.lm.save_pretrained(folder)  # type: ignore[operator]  # transformers' PreTrainedModel, untyped here
    loaded = build_task(task(text_file, f"hf:{folder}"))
    assert torch.equal(flatten_params(loaded.model_fn(0)), flatten_params(saved))
    assert param_specs(loaded.model_fn(0)) == param_specs(saved)
    # the same folder without its weights: random init from its config.json, deterministic for the seed
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_bytes((folder / "config.json").read_bytes())
    init = build_task(task(text_file, f"hf:{bare}"))
    assert not torch.equal(flatten_params(init.model_fn(0)), flatten_params(saved))
    assert torch.equal(flatten_params(init.model_fn(7)), flatten_params(t.model_fn(7)))


def test_json_config_file_and_fingerprints(text_file: Path, tmp_path: Path) -> None:
    a = build_task(task(text_file, f"hf:{llama_config(tmp_path, 'a.json')}"))
    assert sum(p.numel() for p in a.model_fn(0).parameters()) < 50_000
    b = build_task(task(text_file, f"hf:{llama_config(tmp_path, 'b.json', intermediate_size=96)}"))
    same = build_task(task(text_file, f"hf:{llama_config(tmp_path, 'c.json')}"))  # same config, another file
    assert fingerprint_differences(a.fingerprint, b.fingerprint) == ("model",)
    assert a.fingerprint == same.fingerprint
    other_data = tmp_path / "other.txt"
    other_data.write_text(TEXT.replace("return", "yield"))
    on_other = build_task(task(other_data, f"hf:{llama_config(tmp_path, 'a.json')}"))
    assert fingerprint_differences(a.fingerprint, on_other.fingerprint) == ("data",)
    # the built-in GPT on bytes: its model part is its architecture hash, and the data part tells corpora apart
    gpt = TaskConfig(model=MODEL, data=DataConfig(source=str(text_file), num_shards=2), inner=INNER)
    built = build_task(gpt)
    assert built.parts.model == model_fingerprint(MODEL)[:12]
    other = build_task(dataclasses.replace(gpt, data=DataConfig(source=str(other_data), num_shards=2)))
    assert fingerprint_differences(built.fingerprint, other.fingerprint) == ("data",)


# --- tokenizers and token files ----------------------------------------------------------------------------------


def test_tokenize_command_writes_files_the_data_layer_reads(text_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "tok"
    assert main(["data", "tokenize", "--corpus", str(text_file), "--vocab-size", "300", "--out", str(out)]) == 0
    tokenizer, tokens = out / "tokenizer.json", out / "tokens.bin"
    assert tokenizer.is_file() and tokens.is_file()
    stream = np.fromfile(tokens, dtype="<u2")
    assert 256 <= int(stream.max()) < 300 and stream.shape[0] < len(TEXT.encode()) // 2  # merges compress
    corpus = Corpus.load(DataConfig(source=str(tokens), num_shards=2, tokenizer=str(tokenizer)))
    assert corpus.num_tokens == stream.shape[0]
    # the text file through the same tokenizer gives the same tokens
    text = Corpus.load(DataConfig(source=str(text_file), num_shards=2, tokenizer=str(tokenizer)))
    assert text.num_tokens == stream.shape[0]
    # an HF preset takes the tokenizer's vocabulary; the fingerprint covers the tokenizer
    t = build_task(task(tokens, tokenizer=str(tokenizer)))
    assert t.model_fn(0).vocab_size == 300
    out2 = tmp_path / "tok2"
    assert main(["data", "tokenize", "--corpus", str(text_file), "--vocab-size", "280", "--out", str(out2)]) == 0
    by_text = build_task(task(text_file, tokenizer=str(tokenizer)))
    by_other = build_task(task(text_file, tokenizer=str(out2 / "tokenizer.json")))
    assert "tokenizer" in fingerprint_differences(by_text.fingerprint, by_other.fingerprint)


def test_npy_token_files_keep_uint32(tmp_path: Path) -> None:
    ids = (np.arange(20_000, dtype=np.uint32) * 7919) % 70_000
    assert write_tokens(ids, tmp_path, vocab=70_000) == tmp_path / "tokens.npy"  # over 16 bits: uint32 .npy
    corpus = Corpus.load(DataConfig(source=str(tmp_path / "tokens.npy"), num_shards=2))
    assert corpus.train.dtype == np.uint32 and corpus.max_token == int(ids.max()) and corpus.num_tokens == 20_000
    assert corpus.max_token > 65_535
    x, y, _ = corpus.batch(0, 0, 2, 16)
    assert x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])
    np.save(tmp_path / "floats.npy", ids.astype(np.float32))
    with pytest.raises(ConfigError, match=r"data\.source.*1-D uint16 or uint32"):
        Corpus.load(DataConfig(source=str(tmp_path / "floats.npy"), num_shards=2))


def test_jsonl_records_through_datasets(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"record {i}: " + "abc " * 50, "n": i}) + "\n" for i in range(60)))
    corpus = Corpus.load(DataConfig(source=str(path), num_shards=2))
    assert corpus.train_documents + corpus.val_documents == 60
    with pytest.raises(ConfigError, match=r"data\.text_field 'body'"):
        Corpus.load(DataConfig(source=str(path), num_shards=2, text_field="body"))


# --- bad input -----------------------------------------------------------------------------------------------------


def test_unknown_preset_names_the_flag(text_file: Path) -> None:
    with pytest.raises(ConfigError, match=r"--model hf:does-not-exist.*presets: llama-tiny"):
        build_task(task(text_file, "hf:does-not-exist"))
    with pytest.raises(ConfigError, match=r"task\.model_name \(--model\)"):
        TaskConfig(model_name="llama-tiny")


def test_a_factory_that_fails_is_a_config_error(text_file: Path) -> None:
    cfg = TaskConfig(data=DataConfig(source=str(text_file), num_shards=2), factory="tests.test_hf:_failing_factory")
    with pytest.raises(ConfigError, match=r"task\.factory 'tests\.test_hf:_failing_factory' failed.*out of coffee"):
        build_task(cfg)


def test_configs_that_do_not_build(text_file: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--model hf:.*bad_type\.json.*does not build"):
        build_task(task(text_file, f"hf:{llama_config(tmp_path, 'bad_type.json', model_type='no-such-arch')}"))
    with pytest.raises(ConfigError, match=r"--model hf:.*does not build"):
        build_task(task(text_file, f"hf:{llama_config(tmp_path, 'zero.json', num_attention_heads=0)}"))
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"--model hf:.*junk\.json is not a readable JSON config"):
        build_task(task(text_file, f"hf:{tmp_path / 'junk.json'}"))
    with pytest.raises(ConfigError, match=r"model\.seq_len \(--seq-len\) = 32 exceeds the 16 positions"):
        build_task(task(text_file, f"hf:{llama_config(tmp_path, 'short.json', max_position_embeddings=16)}"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"folder .*empty holds no config\.json"):
        build_task(task(text_file, f"hf:{tmp_path / 'empty'}"))


def test_tokenizer_larger_than_the_model_vocab(text_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "tok"
    assert main(["data", "tokenize", "--corpus", str(text_file), "--vocab-size", "300", "--out", str(out)]) == 0
    small = llama_config(tmp_path, "v256.json")  # vocab_size 256 < 300
    with pytest.raises(ConfigError, match=r"data\.tokenizer .* has 300 tokens, more than the vocab_size 256"):
        build_task(task(out / "tokens.bin", f"hf:{small}", tokenizer=str(out / "tokenizer.json")))
    gpt = TaskConfig(
        model=MODEL, data=DataConfig(source=str(text_file), num_shards=2, tokenizer=str(out / "tokenizer.json"))
    )
    with pytest.raises(ConfigError, match=r"data\.tokenizer .* has 300 tokens.*model\.vocab_size"):
        build_task(gpt)
    assert main(["data", "tokenize", "--corpus", str(text_file), "--vocab-size", "100", "--out", str(out)]) == 2
    with pytest.raises(ConfigError, match=r"data\.tokenizer .* does not exist"):
        build_task(task(text_file, tokenizer=str(tmp_path / "nope.json")))


def test_local_cluster_passes_the_model_to_the_coordinator() -> None:
    from diloco.cli.local import config_from_args
    from diloco.cli.main import build_parser

    a = build_parser("local").parse_args(["local", "--model", "hf:llama-tiny", "--workers", "2"])
    assert config_from_args(a).task_args == ("--model", "hf:llama-tiny")
    assert config_from_args(build_parser("local").parse_args(["local"])).task_args == ()


def test_coordinator_process_exits_2_on_an_unknown_model() -> None:
    argv = [sys.executable, "-m", "services.coordinator", "--insecure", "--model", "hf:does-not-exist"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "configuration error" in proc.stderr and "--model hf:does-not-exist" in proc.stderr


# --- a cluster ------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_learners_train_llama_tiny_in_a_local_cluster(tmp_path: Path) -> None:
    args = (*TINY_TASK_ARGS, "--model", "hf:llama-tiny")
    cfg = cluster_config(tmp_path, workers=2, outer_steps=3, local_steps=5, min_local_steps=2, task_args=args)
    with running(cfg, start_timeout_s=120) as c:
        wait_for("3 outer steps", lambda: c.status().finished, timeout_s=150, interval_s=0.5)
        status = c.status()
        # typically 3.6-3.9 at version 3 (ln 256 = 5.55 untrained); one CI run gave 5.08 with the usual tokens:
        # a failure shows every round and evaluation, to tell why
        log = Events(tmp_path / "coordinator.log")
        rounds = [*log.all("round.closed"), *log.all("eval.done"), *log.all("submission.rejected")]
        assert status.version >= 3 and status.validation_loss < 5.0, (status.validation_loss, rounds)
