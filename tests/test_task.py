"""Unit tests for the training task: model, data, inner loop, flat parameters and the task factory."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from diloco.errors import ConfigError, InvalidArgument, NotFound
from diloco.rpc.payload import SpilledVector
from diloco.task import (
    GPT,
    Corpus,
    DataConfig,
    InnerConfig,
    InnerTrainer,
    ModelConfig,
    ShardRangeT,
    TaskConfig,
    build_task,
    decode,
    encode,
    evaluate,
    flatten_params,
    load_flat_,
    lr_at,
    model_fingerprint,
    param_specs,
)
from diloco.task.data import model_loss, stdlib_files
from diloco.task.params import view_flat_

CPU = torch.device("cpu")
TINY = ModelConfig(seq_len=16, d_model=32, n_layers=1, n_heads=2, mlp_ratio=2)
TINY_INNER = InnerConfig(batch_size=4, warmup_steps=2, total_steps=100)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models gain nothing from threads, and on a busy 2-core machine OpenMP threads waiting on each
    other make every op 100x slower; restore the setting for the other test modules."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    """A small stdlib corpus shared by the trainer tests (read-only)."""
    return Corpus.load(DataConfig(num_shards=4, max_bytes=200_000))


def make_trainer(corpus: Corpus, inner: InnerConfig = TINY_INNER, seed: int = 0) -> InnerTrainer:
    return InnerTrainer(GPT(TINY, seed=seed), corpus, inner, seq_len=TINY.seq_len, device=CPU)


def arange_corpus(n: int, num_shards: int, val_fraction: float = 0.1) -> Corpus:
    tokens = (np.arange(n) % 256).astype(np.uint16)
    return Corpus(tokens, DataConfig(source="memory", num_shards=num_shards, val_fraction=val_fraction))


# -- tokenizer ---------------------------------------------------------------------------------------------


@given(st.text())
@settings(max_examples=200, deadline=None)
def test_tokenizer_round_trip(text: str) -> None:
    ids = encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert decode(ids) == text
    assert decode(np.asarray(ids, dtype=np.uint16)) == text


def test_tokenizer_is_utf8_bytes() -> None:
    assert encode("aé") == [97, 0xC3, 0xA9]
    assert decode(torch.tensor([104, 105])) == "hi"


# -- corpus sources and split -------------------------------------------------------------------------------


def test_stdlib_files_skip_tests_and_site_packages() -> None:
    files = stdlib_files()
    assert files == sorted(files) and len(files) > 100
    assert all(f.suffix == ".py" for f in files)
    assert not any({"test", "tests", "site-packages"} & set(f.parts) for f in files)


def test_stdlib_corpus_is_deterministic() -> None:
    cfg = DataConfig(num_shards=5, max_bytes=150_000)
    a, b = Corpus.load(cfg), Corpus.load(cfg)
    assert a.num_tokens == 150_000
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
    assert a.fingerprint == b.fingerprint
    other = Corpus.load(DataConfig(num_shards=5, max_bytes=150_000, seed=1))
    assert other.fingerprint != a.fingerprint  # the seed shuffles the order of the training documents ...
    assert not np.array_equal(other.shard_tokens(0), a.shard_tokens(0))
    assert np.array_equal(other.val, a.val)  # ... and never changes the split
    assert np.array_equal(np.sort(other.train), np.sort(a.train))


def test_shards_are_disjoint_and_cover_the_train_split(corpus: Corpus) -> None:
    bounds = [corpus.shard_bounds(i) for i in range(corpus.num_shards)]
    assert bounds[0][0] == 0
    assert bounds[-1][1] == corpus.train_tokens
    for (_, end), (start, _) in itertools.pairwise(bounds):
        assert end == start  # contiguous: no gap, no overlap
    lengths = [corpus.shard_length(i) for i in range(corpus.num_shards)]
    assert sum(lengths) == corpus.train_tokens and max(lengths) - min(lengths) <= 1
    assert np.array_equal(np.concatenate([corpus.shard_tokens(i) for i in range(4)]), corpus.train)
    with pytest.raises(NotFound, match="shard 4"):
        corpus.shard_length(4)


def documents(n: int) -> list[tuple[str, np.ndarray]]:
    """`n` documents, each a run of one token value (document i holds value i % 250), of varying length."""
    return [(f"dir/doc{i:03d}.txt", np.full(40 + (i * 37) % 200, i % 250, dtype=np.uint16)) for i in range(n)]


def test_val_split_is_by_document_and_independent_of_the_seed() -> None:
    docs = documents(240)
    splits = [Corpus(docs, DataConfig(source="docs", num_shards=3, val_fraction=0.1, seed=s)) for s in range(3)]
    c = splits[0]
    assert c.train_tokens + c.val.shape[0] == c.num_tokens == sum(d.shape[0] for _, d in docs)
    assert 5 <= c.val_documents <= 45 and c.val_documents + c.train_documents == 240
    for _, d in docs:  # every document lies wholly on one side (document i is the only one holding value i)
        in_val, in_train = int((c.val == d[0]).sum()), int((c.train == d[0]).sum())
        assert (in_val, in_train) in {(d.shape[0], 0), (0, d.shape[0])}
    for other in splits[1:]:
        assert np.array_equal(other.val, c.val)  # the seed never moves a document across the split
        assert not np.array_equal(other.train, c.train)  # but it reorders the training documents
    assert np.array_equal(Corpus(docs[::-1], c.cfg).val, c.val)  # nor does the order the documents come in


def test_a_split_with_no_document_under_the_fraction_still_holds_one_out() -> None:
    c = Corpus(documents(3), DataConfig(source="docs", num_shards=1, val_fraction=0.001))
    assert c.val_documents == 1 and c.train_documents == 2
    with pytest.raises(ConfigError, match=r"documents.*data\.num_shards=1"):
        Corpus(documents(1), DataConfig(source="docs", num_shards=1))


def test_duplicate_document_ids_are_rejected() -> None:
    docs = documents(3)
    with pytest.raises(ConfigError, match="same id"):
        Corpus([*docs, docs[0]], DataConfig(source="docs", num_shards=1))


def test_text_file_source(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("hello world\n" * 400, encoding="utf-8")
    c = Corpus.load(DataConfig(source=str(path), num_shards=2, val_fraction=0.1))
    assert c.num_tokens == 4800 and 0 < c.val.shape[0] < 4800 and c.val.shape[0] % 64 == 0  # blocks of 64 tokens
    assert sorted(decode(np.concatenate([c.train, c.val]))) == sorted("hello world\n" * 400)


def test_text_folder_source_skips_hidden_and_binary(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("alpha " * 50)
    (tmp_path / "sub" / "b.md").write_text("beta " * 50)
    (tmp_path / ".hidden").write_text("HIDDEN")
    (tmp_path / "blob.dat").write_bytes(b"\x00\x01BINARY")
    c = Corpus.load(DataConfig(source=str(tmp_path), num_shards=1))
    text = decode(c.train) + decode(c.val)
    assert "alpha " * 50 + "\n\n" in text and "beta " * 50 + "\n\n" in text  # whole documents, either side
    assert "HIDDEN" not in text and "BINARY" not in text
    assert c.num_tokens == len("alpha " * 50) + len("beta " * 50) + 4
    assert c.val_documents == 1 and c.train_documents == 1


def test_uint16_bin_source(tmp_path: Path) -> None:
    tokens = (np.arange(50_000) * 7 % 1000).astype("<u2")
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    c = Corpus.load(DataConfig(source=str(path), num_shards=3))
    assert np.array_equal(np.sort(np.concatenate([c.train, c.val])), np.sort(tokens))
    assert c.val.shape[0] % 195 == 0 and c.val.shape[0] > 0  # whole blocks of 50_000 // 256 tokens
    assert c.max_token == 999
    c.check_vocab(1000)
    capped = Corpus.load(DataConfig(source=str(path), num_shards=3, max_bytes=2000))
    assert capped.num_tokens == 1000


def test_bin_with_odd_size_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x01\x00\x02")
    with pytest.raises(ConfigError, match=r"data\.source.*odd size"):
        Corpus.load(DataConfig(source=str(path)))


@pytest.mark.parametrize("kind", ["text", "bin", "folder"])
def test_empty_corpus_is_a_config_error(tmp_path: Path, kind: str) -> None:
    path = {"text": tmp_path / "empty.txt", "bin": tmp_path / "empty.bin", "folder": tmp_path / "empty"}[kind]
    if kind == "folder":
        path.mkdir()
    else:
        path.write_bytes(b"")
    with pytest.raises(ConfigError, match=r"data\.source.*empty"):
        Corpus.load(DataConfig(source=str(path)))


def test_missing_source_names_the_allowed_values(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r'data\.source.*does not exist.*"stdlib"'):
        Corpus.load(DataConfig(source=str(tmp_path / "nope")))


def test_vocab_mismatch_names_model_and_corpus(tmp_path: Path) -> None:
    path = tmp_path / "big.bin"
    np.full(4000, 300, dtype="<u2").tofile(path)
    cfg = TaskConfig(data=DataConfig(source=str(path), num_shards=2), model=TINY, inner=TINY_INNER)
    with pytest.raises(ConfigError, match=r"token id 300.*model\.vocab_size=256"):
        build_task(cfg)
    with pytest.raises(ConfigError, match=r"model\.vocab_size"):
        Corpus.load(cfg.data).check_vocab(300)


def test_shards_too_small_for_a_batch(tmp_path: Path) -> None:
    path = tmp_path / "small.txt"
    path.write_text("x" * 2000)
    cfg = TaskConfig(data=DataConfig(source=str(path), num_shards=4), model=TINY, inner=TINY_INNER)
    build_task(cfg)  # 4 shards of ~490 tokens hold a 4 x 16 batch
    big = TaskConfig(data=cfg.data, model=TINY, inner=InnerConfig(batch_size=64))
    with pytest.raises(ConfigError, match=r"inner\.batch_size=64"):
        build_task(big)


def test_data_config_validation() -> None:
    with pytest.raises(ConfigError, match=r"data\.num_shards"):
        DataConfig(num_shards=0)
    with pytest.raises(ConfigError, match=r"data\.val_fraction"):
        DataConfig(val_fraction=0.0)
    with pytest.raises(ConfigError, match=r"data\.max_bytes"):
        DataConfig(max_bytes=-1)
    with pytest.raises(ConfigError, match=r"data\.layout must be one of spread, contiguous"):
        DataConfig(layout="strided")


# -- batches and cursors ------------------------------------------------------------------------------------


def test_batch_rows_are_spread_across_the_shard() -> None:
    c = arange_corpus(4000, num_shards=2)
    shard = c.shard_tokens(1).astype(np.int64)
    length = shard.shape[0]
    row = length // 4
    x, y, nxt = c.batch(1, 0, 4, 8)
    assert nxt == 32 and x.dtype == torch.int64 and x.shape == (4, 8)
    for j in range(4):  # row j reads from j * floor(L / B)
        assert x[j].tolist() == shard[j * row : j * row + 8].tolist()
        assert y[j].tolist() == shard[j * row + 1 : j * row + 9].tolist()
    x1, _, nxt1 = c.batch(1, 32, 4, 8)  # the next step: every row advances one sequence
    assert nxt1 == 64 and all(x1[j].tolist() == shard[j * row + 8 : j * row + 16].tolist() for j in range(4))
    steps = c.steps_per_pass(1, 4, 8)
    assert steps == min(row // 8, (length - 1 - 3 * row) // 8)
    x2, y2, _ = c.batch(1, steps * 32, 4, 8)  # the next pass over the shard reads the same tokens again
    assert torch.equal(x2, x) and torch.equal(y2, y)


def test_contiguous_layout_reads_consecutive_sequences_and_wraps() -> None:
    tokens = (np.arange(4000) % 256).astype(np.uint16)
    c = Corpus(tokens, DataConfig(source="memory", num_shards=2, val_fraction=0.1, layout="contiguous"))
    shard = c.shard_tokens(1).astype(np.int64)
    length = shard.shape[0]
    x, y, nxt = c.batch(1, 8, 4, 8)  # rows are the 4 sequences after the cursor
    assert nxt == 40 and x.shape == (4, 8)
    assert x.flatten().tolist() == shard[8:40].tolist() and y.flatten().tolist() != x.flatten().tolist()
    assert y[3].tolist() == shard[33:41].tolist()
    xw, _, _ = c.batch(1, length - 8, 4, 8)  # past the end of the shard it wraps to its start
    assert xw[0].tolist() == shard[length - 8 :].tolist() and xw[1].tolist() == shard[:8].tolist()


@given(batch_size=st.integers(1, 5), seq_len=st.integers(1, 9), n=st.integers(1_000, 3_000))
@settings(max_examples=60, deadline=None)
def test_one_pass_reads_every_token_at_most_once(batch_size: int, seq_len: int, n: int) -> None:
    """Within a pass, a cursor range [c0, c1) is B disjoint token ranges: no token is an input twice, every row
    reads consecutive text, and the targets are the inputs shifted by one."""
    c = Corpus(np.arange(n, dtype=np.uint16), DataConfig(source="memory", num_shards=8, val_fraction=0.1))
    shard = c.shard_tokens(3).astype(np.int64)  # token values are unique: a value names its position
    where = {int(v): i for i, v in enumerate(shard)}
    step = batch_size * seq_len
    seen: list[int] = []
    for s in range(c.steps_per_pass(3, batch_size, seq_len)):
        x, y, nxt = c.batch(3, s * step, batch_size, seq_len)
        assert nxt == (s + 1) * step
        pos = np.vectorize(where.__getitem__)(x.numpy())
        tgt = np.vectorize(where.__getitem__)(y.numpy())
        assert (np.diff(pos, axis=1) == 1).all() and (tgt == pos + 1).all()
        seen.extend(pos.reshape(-1).tolist())
    assert len(seen) == len(set(seen))
    assert len(seen) > c.shard_length(3) - batch_size * (seq_len + 1)  # and a pass leaves little unread


def test_negative_cursor_is_rejected() -> None:
    with pytest.raises(InvalidArgument, match="cursor"):
        arange_corpus(4000, 2).batch(0, -32, 4, 8)


# -- evaluation ---------------------------------------------------------------------------------------------


def test_eval_sample_is_evenly_spread_and_fixed() -> None:
    c = arange_corpus(40_000, num_shards=2)
    n = (c.val.shape[0] - 1) // 16
    starts = c.eval_starts(16, 16 * 10)
    assert starts.tolist() == [(i * n // 10) * 16 for i in range(10)]
    assert c.eval_starts(16, 0).tolist() == [i * 16 for i in range(n)]  # 0: the whole split
    assert c.eval_starts(16, 10**9).tolist() == c.eval_starts(16, 0).tolist()  # a budget above the split: all of it
    seeded = Corpus((np.arange(40_000) % 256).astype(np.uint16), dataclasses.replace(c.cfg, seed=7, num_shards=5))
    assert np.array_equal(seeded.val, c.val) and np.array_equal(seeded.eval_starts(16, 160), starts)
    batches = list(c.val_batches(16, 16 * 10, rows=4))
    assert [x.shape[0] for x, _ in batches] == [4, 4, 2]
    x = torch.cat([x for x, _ in batches])
    y = torch.cat([y for _, y in batches])
    assert x.tolist() == [c.val[s : s + 16].tolist() for s in starts]
    assert y.tolist() == [c.val[s + 1 : s + 17].tolist() for s in starts]


@pytest.mark.parametrize("bad", [-1, 5, 1.5, True])
def test_eval_budget_is_validated(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"eval_tokens must be 0 .* >= model\.seq_len = 16"):
        arange_corpus(4000, 2).eval_starts(16, bad)  # type: ignore[arg-type]


# -- model and flat parameters ------------------------------------------------------------------------------


def test_model_config_validation() -> None:
    with pytest.raises(ConfigError, match=r"model\.d_model.*model\.n_heads"):
        ModelConfig(d_model=30, n_heads=4)
    with pytest.raises(ConfigError, match=r"model\.n_layers"):
        ModelConfig(n_layers=0)
    with pytest.raises(ConfigError, match=r"model\.dropout"):
        ModelConfig(dropout=1.0)
    with pytest.raises(ConfigError, match=r"model\.seq_len"):
        ModelConfig(seq_len=True)


def test_model_init_is_deterministic_and_fingerprint_stable() -> None:
    torch.manual_seed(123)  # the global RNG must not matter
    a = flatten_params(GPT(TINY, seed=7))
    torch.manual_seed(456)
    b = flatten_params(GPT(TINY, seed=7))
    assert torch.equal(a, b)
    assert not torch.equal(a, flatten_params(GPT(TINY, seed=8)))
    assert model_fingerprint(TINY) == model_fingerprint(ModelConfig(**vars(TINY)))
    assert model_fingerprint(TINY) != model_fingerprint(ModelConfig(**{**vars(TINY), "n_layers": 2}))
    assert len(model_fingerprint(TINY)) == 16


def test_model_forward_and_initial_loss() -> None:
    model = GPT(TINY)
    idx = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(0))
    assert model(idx).shape == (3, 16, 256)
    targets = (idx + 1) % 256
    assert float(model.loss(idx, targets).detach()) == pytest.approx(math.log(256), abs=0.1)  # small init: ~uniform
    with pytest.raises(InvalidArgument, match="seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_causal_attention_ignores_the_future() -> None:
    model = GPT(TINY).eval()
    a = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % 256
    assert torch.allclose(model(a)[0, :10], model(b)[0, :10], atol=1e-6)


def test_param_specs_and_flat_round_trip() -> None:
    model = GPT(TINY)
    specs = param_specs(model)
    names = [s.name for s in specs]
    assert names == [n for n, _ in model.named_parameters()]
    assert "wte.weight" in names and not any("head" in n for n in names)  # the tied head is not a parameter
    offset = 0
    for spec in specs:
        assert spec.offset == offset
        offset += math.prod(spec.shape)
    flat = flatten_params(model)
    assert flat.dtype == torch.float32 and flat.shape == (offset,)
    other = GPT(TINY, seed=99)
    load_flat_(other, flat)
    assert torch.equal(flatten_params(other), flat)
    with pytest.raises(InvalidArgument, match="expected"):
        load_flat_(other, flat[:-1])
    # a range of whole tensors (a streaming fragment), read and written alone
    lo, hi = specs[1].offset, specs[3].offset
    assert torch.equal(flatten_params(model, lo, hi), flat[lo:hi])
    load_flat_(other, -flat[lo:hi], lo, hi)
    assert torch.equal(flatten_params(other), torch.cat([flat[:lo], -flat[lo:hi], flat[hi:]]))
    with pytest.raises(InvalidArgument, match=rf"expected \({hi - lo},\)"):
        load_flat_(other, flat[lo : hi - 1], lo, hi)
    with pytest.raises(InvalidArgument, match="whole parameters"):
        flatten_params(model, lo + 1, hi)


def test_a_model_can_view_a_flat_vector_instead_of_holding_its_own() -> None:
    model, flat = GPT(TINY, seed=99), flatten_params(GPT(TINY))
    x = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    copied = GPT(TINY, seed=99)
    load_flat_(copied, flat)
    assert view_flat_(model, flat)
    assert torch.equal(model(x), copied(x))  # the same model, tied head included
    flat.mul_(0.5)  # a write to the vector is the model's
    assert torch.equal(flatten_params(model), flat)
    with pytest.raises(InvalidArgument, match="expected"):
        view_flat_(model, flat[:-1])
    assert not view_flat_(model, flat.double())  # another dtype: nothing changes, the caller copies
    assert torch.equal(flatten_params(model), flat)


# -- inner loop ---------------------------------------------------------------------------------------------


def test_inner_config_validation_and_schedule() -> None:
    with pytest.raises(ConfigError, match=r"inner\.lr"):
        InnerConfig(lr=0.0)
    with pytest.raises(ConfigError, match=r"inner\.betas"):
        InnerConfig(betas=(0.9, 1.0))
    with pytest.raises(ConfigError, match=r"inner\.batch_size"):
        InnerConfig(batch_size=0)
    cfg = InnerConfig(lr=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert lr_at(cfg, 0) == pytest.approx(0.1)
    assert lr_at(cfg, 9) == pytest.approx(1.0)
    assert lr_at(cfg, 10) == pytest.approx(1.0)
    assert lr_at(cfg, 60) == pytest.approx(0.55)
    assert lr_at(cfg, 110) == pytest.approx(0.1)
    assert lr_at(cfg, 10_000) == pytest.approx(0.1)


def test_pseudo_gradient_is_zero_before_training_then_base_minus_params(corpus: Corpus) -> None:
    tr = make_trainer(corpus)
    assert torch.count_nonzero(tr.pseudo_gradient()) == 0
    theta0 = flatten_params(GPT(TINY, seed=3))
    tr.load_global(theta0)
    assert torch.count_nonzero(tr.pseudo_gradient()) == 0
    result = tr.train([(0, 1, 0)], 3)
    assert torch.equal(result.pseudo_grad, theta0 - tr.params_flat())
    assert torch.equal(result.pseudo_grad, tr.pseudo_gradient())
    assert result.pseudo_grad.norm() > 0
    assert result.pseudo_grad.dtype == torch.float32 and result.pseudo_grad.device.type == "cpu"


def test_training_lowers_the_loss(corpus: Corpus) -> None:
    tr = make_trainer(corpus, InnerConfig(batch_size=8, warmup_steps=5, total_steps=60))
    before = evaluate(tr.model, corpus, TINY.seq_len, 512, CPU)
    assert before.loss == pytest.approx(math.log(256), abs=0.1) and before.tokens == 512
    first = tr.train([(0, 0, 0), (1, 0, 0)], 40)
    after = evaluate(tr.model, corpus, TINY.seq_len, 512, CPU)
    assert after.loss < before.loss - 0.5, (before, after, first.loss)  # held-out documents: a smaller drop
    whole = evaluate(tr.model, corpus, TINY.seq_len, 0, CPU)
    assert whole.tokens == (corpus.val.shape[0] - 1) // TINY.seq_len * TINY.seq_len
    assert tr.model.training  # evaluate restores the mode


def test_rebase_keeps_local_progress_exactly(corpus: Corpus) -> None:
    tr = make_trainer(corpus)
    tr.train([(0, 0, 0)], 3)
    tr.mark_submitted()
    at_submit = tr.params_flat()
    tr.train([(0, 0, 3 * 64)], 2)  # keeps training while the upload is in flight
    theta = tr.params_flat()
    new_global = flatten_params(GPT(TINY, seed=42))
    tr.rebase(new_global)
    assert torch.equal(tr.params_flat(), new_global + (theta - at_submit))
    assert torch.equal(tr.base, new_global)
    assert torch.equal(tr.pseudo_gradient(), new_global - tr.params_flat())
    # a second, newer version before the next submission moves the unsent progress onto it
    progress = tr.params_flat() - tr.base
    newer = flatten_params(GPT(TINY, seed=43))
    tr.rebase(newer)
    assert torch.allclose(tr.params_flat() - newer, progress, atol=1e-6)
    assert torch.equal(tr.base, newer)


def test_submit_into_is_pseudo_gradient_and_mark_submitted_in_one_read(corpus: Corpus) -> None:
    """`submit_into` (the worker's path) = `out += pseudo_gradient() * scale` + `mark_submitted`, bit for bit: a
    rebase after it keeps exactly the steps made since, as `test_rebase_keeps_local_progress_exactly` does with
    the two calls."""
    tr = make_trainer(corpus)
    tr.train([(0, 0, 0)], 3)
    residual = torch.randn(tr.numel, generator=torch.Generator().manual_seed(1))
    expected = residual + tr.pseudo_gradient() * 0.5
    at_submit = tr.params_flat()
    tr.submit_into(residual, 0.5)
    assert torch.equal(residual, expected)
    assert torch.count_nonzero(tr.pseudo_gradient()) == 0 and torch.equal(tr.base, at_submit)
    tr.train([(0, 0, 3 * 64)], 2)
    assert torch.equal(tr.base, at_submit)  # copied before the first step after the submission
    theta = tr.params_flat()
    new_global = flatten_params(GPT(TINY, seed=42))
    tr.rebase(new_global)
    assert torch.equal(tr.params_flat(), new_global + (theta - at_submit))
    with pytest.raises(InvalidArgument, match="flat fp32 CPU vector"):
        tr.submit_into(torch.zeros(tr.numel, dtype=torch.float64))


def test_a_version_adopted_right_after_a_submission_is_theta(corpus: Corpus) -> None:
    """No step between a submission and the next version (a sync round): θ becomes that version exactly."""
    tr = make_trainer(corpus)
    tr.train([(0, 0, 0)], 2)
    tr.submit_into(torch.zeros(tr.numel))
    new_global = flatten_params(GPT(TINY, seed=42))
    tr.rebase(new_global)
    assert torch.equal(tr.params_flat(), new_global) and torch.equal(tr.base, new_global)
    assert torch.count_nonzero(tr.pseudo_gradient()) == 0


def test_a_shared_base_is_the_callers_tensor_and_never_written(corpus: Corpus) -> None:
    """`share=True` (the broadcast follower's Θ̂): the base is that tensor, no copy; training, submitting and
    rebasing onto a newer version never write it."""
    tr = make_trainer(corpus)
    theta0 = flatten_params(GPT(TINY, seed=3))
    kept = theta0.clone()
    tr.load_global(theta0, share=True)
    assert tr.base.data_ptr() == theta0.data_ptr()
    tr.train([(0, 0, 0)], 2)
    tr.submit_into(torch.zeros(tr.numel))
    tr.train([(0, 0, 2 * 64)], 1)
    newer = flatten_params(GPT(TINY, seed=4))
    tr.rebase(newer, share=True)
    tr.train([(0, 0, 3 * 64)], 1)
    assert torch.equal(theta0, kept) and tr.base.data_ptr() == newer.data_ptr()
    tr.load_global(theta0)  # not shared: a copy
    assert tr.base.data_ptr() != theta0.data_ptr() and torch.equal(tr.base, theta0)


def test_optimizer_state_persists_across_rounds(corpus: Corpus) -> None:
    tr = make_trainer(corpus)
    tr.train([(0, 0, 0)], 4)
    p = next(tr.model.parameters())
    state = tr.optimizer_state(p)
    exp_avg_sq = state["exp_avg_sq"].clone()
    tr.load_global(flatten_params(GPT(TINY, seed=5)))
    assert tr.optimizer_state(p)["exp_avg_sq"] is state["exp_avg_sq"]  # load_global does not reset Adam
    tr.train([(0, 0, 4 * 64)], 3)
    assert int(tr.optimizer_state(p)["step"]) == 7
    assert tr.steps_done == 7
    assert tr.optimizer is not None and tr.optimizer.param_groups[0]["lr"] == pytest.approx(lr_at(TINY_INNER, 6))
    assert not torch.equal(tr.optimizer_state(p)["exp_avg_sq"], exp_avg_sq)


NO_CLIP = dataclasses.replace(TINY_INNER, grad_clip=0.0)


def test_stepping_in_backward_gives_the_same_bits_as_one_step_after_backward(corpus: Corpus) -> None:
    """Without clipping each parameter steps in backward as its gradient completes: over several steps, rounds and
    a rebase (warmup and decay, weight decay on some parameters only), the same parameters, AdamW state and losses,
    bit for bit, as the whole model's step after backward."""
    fused = make_trainer(corpus, NO_CLIP)
    plain = InnerTrainer(GPT(TINY, seed=0), corpus, NO_CLIP, seq_len=TINY.seq_len, device=CPU, step_in_backward=False)
    assert fused.in_backward and fused.optimizer is None
    assert not plain.in_backward and plain.optimizer is not None
    for tr in (fused, plain):
        tr.load_global(flatten_params(GPT(TINY, seed=7)))
    a, b = fused.train([(0, 0, 0), (1, 0, 0)], 4), plain.train([(0, 0, 0), (1, 0, 0)], 4)
    assert a.loss == b.loss and torch.equal(a.pseudo_grad, b.pseudo_grad)
    newer = flatten_params(GPT(TINY, seed=8))
    for tr in (fused, plain):
        tr.submit_into(torch.zeros(tr.numel))
        tr.rebase(newer)
    a, b = fused.train([(2, 0, 0)], 3), plain.train([(2, 0, 0)], 3)
    assert a.loss == b.loss and torch.equal(fused.params_flat(), plain.params_flat())
    for p, q in zip(fused.model.parameters(), plain.model.parameters(), strict=True):
        sa, sb = fused.optimizer_state(p), plain.optimizer_state(q)
        assert int(sa["step"]) == int(sb["step"]) == 7
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
        assert p.grad is None and q.grad is None


def _live_grads_during_backward(tr: InnerTrainer, x: Tensor, y: Tensor) -> int:
    """The most parameters holding a gradient at once while `tr` steps on a batch (seen from hooks that run after
    the trainer's own)."""
    params = list(tr.model.parameters())
    most = 0

    def seen(_: Tensor) -> None:
        nonlocal most
        most = max(most, sum(q.grad is not None for q in params))

    handles = [p.register_post_accumulate_grad_hook(seen) for p in params]  # type: ignore[no-untyped-call]
    tr.step(x, y)
    for h in handles:
        h.remove()
    return most


def test_stepping_in_backward_holds_no_gradient_of_the_whole_model(corpus: Corpus) -> None:
    """Stepping in backward, each gradient is dropped as soon as its parameter stepped; with clipping, which needs
    every gradient's norm first, all of them are alive at the end of backward. A backward outside `step` (not a
    training step) leaves its gradients and the parameters alone."""
    x, y, _ = corpus.batch(0, 0, NO_CLIP.batch_size, TINY.seq_len)
    fused, clipped = make_trainer(corpus, NO_CLIP), make_trainer(corpus)
    assert not clipped.in_backward
    assert _live_grads_during_backward(fused, x, y) == 0
    assert _live_grads_during_backward(clipped, x, y) == len(list(clipped.model.parameters()))
    before = fused.params_flat()
    model_loss(fused.model)(x, y).backward()  # type: ignore[no-untyped-call]
    assert torch.equal(fused.params_flat(), before)
    assert all(p.grad is not None for p in fused.model.parameters())


def test_ranges_are_contiguous_and_sum_to_tokens(corpus: Corpus) -> None:
    tr = make_trainer(corpus)
    per_batch = TINY_INNER.batch_size * TINY.seq_len
    result = tr.train([(2, 5, 1000), (0, 1, 0), (3, 2, 7)], 7)
    assert result.steps == 7 and result.tokens == 7 * per_batch
    assert result.ranges == [
        ShardRangeT(2, 5, 1000, 1000 + 3 * per_batch),
        ShardRangeT(0, 1, 0, 2 * per_batch),
        ShardRangeT(3, 2, 7, 7 + 2 * per_batch),
    ]
    assert sum(r.end - r.start for r in result.ranges) == result.tokens
    follow = tr.train([(r.shard_id, r.epoch, r.end) for r in result.ranges], 1)
    assert follow.ranges == [ShardRangeT(2, 5, result.ranges[0].end, result.ranges[0].end + per_batch)]
    assert math.isfinite(result.loss) and result.seconds > 0


def test_train_rejects_bad_shard_lists(corpus: Corpus) -> None:
    tr = make_trainer(corpus)
    with pytest.raises(InvalidArgument, match="distinct"):
        tr.train([(0, 0, 0), (0, 0, 64)], 2)
    with pytest.raises(InvalidArgument, match="at least one shard"):
        tr.train([], 1)
    with pytest.raises(InvalidArgument, match="flat float vector"):
        tr.load_global(torch.zeros(3))


def test_slowdown_sleeps_and_is_reported_in_throughput(corpus: Corpus) -> None:
    ticks = iter(range(1000))
    slept: list[float] = []
    tr = InnerTrainer(
        GPT(TINY),
        corpus,
        TINY_INNER,
        seq_len=TINY.seq_len,
        device=CPU,
        slowdown=3.0,
        sleep=slept.append,
        clock=lambda: float(next(ticks)),
    )
    assert tr.throughput().tokens_per_s == 0.0
    tr.train([(0, 0, 0)], 2)
    assert slept == [2.0, 2.0]  # each step "took" 1 s on the fake clock, so sleep 2 s more
    tp = tr.throughput()
    assert tp.step_time_s == pytest.approx(3.0)
    assert tp.tokens_per_s == pytest.approx(64 / 3.0)
    assert tp.device_kind == "cpu"


def test_slowdown_does_not_multiply_a_stall(corpus: Corpus) -> None:
    """A step that stalled (the process was paused) is not slowed down further in proportion to the stall."""
    # clock calls: train start, then (before, after) for each step, then train end
    times = iter([0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 102.0, 102.0])
    slept: list[float] = []
    tr = InnerTrainer(
        GPT(TINY),
        corpus,
        TINY_INNER,
        seq_len=TINY.seq_len,
        device=CPU,
        slowdown=3.0,
        sleep=slept.append,
        clock=lambda: next(times),
    )
    tr.train([(0, 0, 0)], 3)  # steps of 1 s, 1 s, then one of 100 s (paused)
    assert slept[:2] == [2.0, 2.0]
    assert slept[2] == pytest.approx(2.0 * 2.0)  # capped at twice the usual compute, not 2 x 100 s


# -- task config and factory --------------------------------------------------------------------------------


class Bigram(nn.Module):
    """A user model for the plug-in test: next-token logits from the current token only."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.table = nn.Embedding(256, 256)
        with torch.no_grad():
            self.table.weight.copy_(torch.randn(256, 256, generator=torch.Generator().manual_seed(seed)) * 0.01)

    def loss(self, x: Tensor, y: Tensor) -> Tensor:
        return nn.functional.cross_entropy(self.table(x).reshape(-1, 256), y.reshape(-1))


def user_factory(cfg: TaskConfig) -> tuple[object, Corpus]:
    """Plug-in under test: its own model and its own in-memory data."""
    tokens = np.frombuffer(b"abcabcabd" * 400, dtype=np.uint8).astype(np.uint16)
    return Bigram, Corpus(tokens, DataConfig(source="user", num_shards=cfg.data.num_shards))


def test_task_config_json_round_trip() -> None:
    cfg = TaskConfig(model=TINY, data=DataConfig(num_shards=3), inner=InnerConfig(betas=(0.8, 0.9)))
    again = TaskConfig.from_json(cfg.to_json())
    assert again == cfg and isinstance(again.inner.betas, tuple)
    assert TaskConfig.from_json("{}") == TaskConfig()


@pytest.mark.parametrize(
    ("doc", "match"),
    [
        ({"modle": {}}, r"unknown keys \['modle'\]"),
        ({"model": {"width": 3}}, r"model: unknown keys \['width'\]"),
        ({"inner": {"lr": -1}}, r"inner\.lr"),
        ({"data": {"num_shards": "4"}}, r"data\.num_shards"),
        ({"factory": "no-colon"}, r"task\.factory"),
        ([], "JSON object"),
    ],
)
def test_task_config_rejects_bad_json(doc: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        TaskConfig.from_json(json.dumps(doc))


def test_build_default_task(corpus: Corpus) -> None:
    cfg = TaskConfig(model=TINY, data=DataConfig(num_shards=4, max_bytes=200_000), inner=TINY_INNER)
    task = build_task(cfg)
    assert task.parts.model == model_fingerprint(TINY)[:12]  # the built-in GPT's part is its architecture hash
    assert task.corpus.fingerprint == corpus.fingerprint and task.parts.data == corpus.fingerprint[:12]
    assert torch.equal(flatten_params(task.model_fn()), flatten_params(GPT(TINY)))


def test_factory_hook_loads_a_user_function() -> None:
    cfg = TaskConfig(model=TINY, data=DataConfig(num_shards=2), inner=TINY_INNER, factory=f"{__name__}:user_factory")
    task = build_task(cfg)
    model = task.model_fn(3)
    assert isinstance(model, Bigram)
    assert task.corpus.description == "user" and task.corpus.num_shards == 2
    assert task.parts.model != model_fingerprint(TINY)[:12]
    tr = InnerTrainer(model, task.corpus, cfg.inner, seq_len=TINY.seq_len, device=CPU)
    result = tr.train([(0, 0, 0), (1, 0, 0)], 4)
    assert result.tokens == 4 * 64 and result.pseudo_grad.shape == (256 * 256,)


@pytest.mark.parametrize(
    ("path", "match"),
    [
        ("no_such_module_xyz:build", "cannot import module 'no_such_module_xyz'"),
        (f"{__name__}:missing_function", "has no callable 'missing_function'"),
        (f"{__name__}:CPU", "has no callable 'CPU'"),
    ],
)
def test_factory_hook_bad_path_is_a_config_error(path: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build_task(TaskConfig(model=TINY, inner=TINY_INNER, factory=path))


def test_catch_up_moves_the_schedule_forward_only(corpus: Corpus) -> None:
    tr = make_trainer(corpus)
    tr.catch_up(500)
    assert tr.steps_done == 500
    tr.catch_up(10)  # never backwards
    assert tr.steps_done == 500


def test_grad_clip_flag_reaches_the_trainer_and_is_bounded() -> None:
    """--grad-clip 0 (no clipping) lets each parameter step in backward, dropping its gradient there (no
    model-sized gradient buffer); a negative value is refused naming the setting."""
    from diloco.task.inner import InnerTrainer
    from services.coordinator.config import parse

    task_cfg = parse(["--grad-clip", "0", "--insecure"]).task
    assert task_cfg.inner.grad_clip == 0.0 and parse(["--insecure"]).task.inner.grad_clip == 1.0
    task = build_task(task_cfg)
    trainer = InnerTrainer(
        task.model_fn(0), task.corpus, task_cfg.inner, seq_len=task_cfg.model.seq_len, device=torch.device("cpu")
    )
    assert trainer.in_backward
    x, y, _ = trainer.corpus.batch(0, 0, task_cfg.inner.batch_size, task_cfg.model.seq_len)
    trainer.step(x, y)
    assert all(p.grad is None for p in trainer.model.parameters())
    with pytest.raises(ConfigError, match="grad_clip"):
        parse(["--grad-clip", "-1", "--insecure"])


def test_the_pseudo_gradient_added_a_slab_at_a_time_is_submit_into_bit_for_bit() -> None:
    from diloco.task.inner import InnerTrainer

    cfg = TaskConfig()
    task = build_task(cfg)
    a, b = (
        InnerTrainer(task.model_fn(0), task.corpus, cfg.inner, seq_len=cfg.model.seq_len, device=torch.device("cpu"))
        for _ in range(2)
    )
    for t in (a, b):
        x, y, _ = t.corpus.batch(0, 0, cfg.inner.batch_size, cfg.model.seq_len)
        t.step(x, y)
    whole, slabs = torch.randn(a.numel), torch.empty(a.numel)
    slabs.copy_(whole)
    a.submit_into(whole, 0.5)
    for start in range(0, b.numel, 1000):
        b.add_pseudo_gradient(start, slabs[start : start + 1000], 0.5)
    b.mark_submitted()
    assert torch.equal(whole, slabs) and torch.equal(a.base, b.base)
    with pytest.raises(InvalidArgument, match="within"):
        b.add_pseudo_gradient(b.numel - 10, torch.zeros(11))


def test_a_base_kept_in_a_file_gives_the_same_bits_as_one_in_memory(
    corpus: Corpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`spill_base` (the worker's --spill-dir): θ_at_submit goes to a file at the first step after a submission and
    is read back a slice at a time; pseudo-gradients, submissions a slab at a time and rebases are bit for bit
    those of a trainer holding it in memory."""
    from diloco.task import inner

    filed, memory = make_trainer(corpus), make_trainer(corpus)
    filed.spill_base(SpilledVector(str(tmp_path), filed.numel))
    monkeypatch.setattr(inner, "_SLICE", 1000)  # several slices even for this model
    for n in range(3):
        for t in (filed, memory):
            t.train([(0, 0, 5 * 64 * n)], 2)
            t.submit_into(torch.zeros(t.numel))
            t.train([(0, 0, 5 * 64 * n + 2 * 64)], 2)  # trains on while the upload is in flight
        assert filed._base_spilled and filed._base is None  # no model-sized base in memory
        assert torch.equal(filed.base, memory.base) and torch.equal(filed.pseudo_gradient(), memory.pseudo_gradient())
        if n == 1:  # a second submission before any rebase, a slab at a time
            whole, slabs = torch.zeros(memory.numel), torch.zeros(filed.numel)
            memory.submit_into(whole)
            for start in range(0, filed.numel, 777):
                filed.add_pseudo_gradient(start, slabs[start : start + 777])
            filed.mark_submitted()
            assert torch.equal(whole, slabs)
            for t in (filed, memory):
                t.train([(0, 0, 5 * 64 * n + 4 * 64)], 1)
        new_global = flatten_params(GPT(TINY, seed=42 + n))
        filed.rebase(new_global)
        memory.rebase(new_global)
        assert torch.equal(filed.params_flat(), memory.params_flat()) and not filed._base_spilled
        assert torch.equal(filed.base, new_global)
    with pytest.raises(InvalidArgument, match="flat CPU parameters"):
        filed.spill_base(SpilledVector(str(tmp_path), filed.numel + 1))
