"""Training data: bundled corpus, tokenizers, shards, packing, and the resumable rank-aware sampler."""

import numpy as np
import pytest
import torch

from training.config import DataConfig
from training.data import (
    BUNDLED_CORPUS,
    ByteTokenizer,
    HFTokenizer,
    ResumableSampler,
    build_tokenizer,
    check_vocab,
    load_corpus,
    resolve_source,
)


def test_bundled_corpus_is_real_text_of_useful_size():
    raw = BUNDLED_CORPUS.read_bytes()
    assert 300_000 < len(raw) < 2_000_000
    text = raw.decode("utf-8")
    assert "statement" in text and "The " in text  # English prose (the Python Language Reference)
    assert (BUNDLED_CORPUS.parent / "README.md").read_text().count("License") >= 1


def test_byte_tokenizer_round_trips_any_text():
    tok = ByteTokenizer()
    for text in ["plain ascii", "ünïcödé — ∑ 𝔸", ""]:
        ids = tok.encode(text)
        assert all(0 <= i < 256 for i in ids) and tok.decode(ids) == text


def test_windows_are_the_stream_shifted_by_one():
    cfg = DataConfig(seq_len=37, valid_fraction=0.0)
    corpus = load_corpus(cfg, min_windows=1)
    stream = np.frombuffer(BUNDLED_CORPUS.read_bytes(), dtype=np.uint8)
    for idx in [0, 1, 17, corpus.num_train - 1]:
        inputs, labels = corpus.batch([idx])
        assert torch.equal(inputs[0], torch.from_numpy(stream[idx * 37: idx * 37 + 37].astype(np.int64)))
        assert torch.equal(labels[0], torch.from_numpy(stream[idx * 37 + 1: idx * 37 + 38].astype(np.int64)))
    assert corpus.num_train == (len(stream) - 1) // 37


def test_validation_split_is_the_held_out_tail():
    corpus = load_corpus(DataConfig(seq_len=64, valid_fraction=0.05), min_windows=1)
    total = corpus.num_train + corpus.num_valid
    assert corpus.num_valid == int(total * 0.05) > 0
    x, _ = corpus.valid_batch(0, 3)
    assert torch.equal(x[0], corpus.batch([corpus.num_train])[0][0])


@pytest.mark.parametrize("suffix, dtype", [(".bin", "uint16"), (".bin", "int32"), (".npy", "int64")])
def test_token_shards_are_memmapped(tmp_path, suffix, dtype):
    rng = np.random.default_rng(0)
    shards = [rng.integers(0, 1000, size=n).astype(dtype) for n in (501, 333)]
    for i, arr in enumerate(shards):
        path = tmp_path / f"shard{i}{suffix}"
        np.save(path, arr) if suffix == ".npy" else arr.tofile(path)
    corpus = load_corpus(DataConfig(source=str(tmp_path), seq_len=50, bin_dtype=dtype, valid_fraction=0.0),
                         min_windows=1)
    assert isinstance(corpus.shards[0], np.memmap)
    assert corpus.num_train == 500 // 50 + 332 // 50  # windows never cross shards
    x, y = corpus.batch([10])  # first window of the second shard
    assert torch.equal(x[0], torch.from_numpy(shards[1][:50].astype(np.int64)))
    assert torch.equal(y[0], torch.from_numpy(shards[1][1:51].astype(np.int64)))
    with pytest.raises(ValueError, match="vocab_size"):
        check_vocab(corpus, 512)


def test_plain_text_file_and_glob(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 50)
    (tmp_path / "b.txt").write_text("second file " * 50)
    corpus = load_corpus(DataConfig(source=str(tmp_path / "*.txt"), seq_len=16, valid_fraction=0.0), min_windows=1)
    assert len(corpus.shards) == 2
    assert ByteTokenizer().decode(corpus.batch([0])[0][0].tolist()) == "hello world hell"


def test_hf_tokenizer_file(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    text = BUNDLED_CORPUS.read_text()[:50_000]
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = HFTokenizer(tmp_path)
    ids = hf.encode("The assert statement")
    assert hf.vocab_size <= 300 and len(ids) < len("The assert statement")
    assert hf.decode(ids).replace(" ", "") == "Theassertstatement"
    corpus = load_corpus(DataConfig(tokenizer=str(tmp_path / "tokenizer.json"), seq_len=32), min_windows=1)
    check_vocab(corpus, hf.vocab_size)


@pytest.mark.parametrize("text", ["{not json", '{"model": 3}', ""])
def test_corrupt_tokenizer_file_is_a_value_error_naming_it(tmp_path, text):
    (tmp_path / "tokenizer.json").write_text(text)
    with pytest.raises(ValueError, match=r"^data\.tokenizer: '.*tokenizer\.json' is not a valid tokenizer\.json: \S"):
        build_tokenizer(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"^--tokenizer: .* is not a valid tokenizer\.json"):
        build_tokenizer(str(tmp_path), "--tokenizer")  # a folder means its tokenizer.json


@pytest.mark.parametrize("source, match", [
    ("/nonexistent/corpus.txt", "no such file"),
    ("/nonexistent/*.bin", "holds no"),
])
def test_missing_data_is_a_clear_error(source, match):
    with pytest.raises(ValueError, match=match):
        resolve_source(source)


def test_corpus_too_small_for_one_batch(tmp_path):
    (tmp_path / "tiny.txt").write_text("x" * 300)
    with pytest.raises(ValueError, match=r"fewer than one global batch \(data.global_batch=16\)"):
        load_corpus(DataConfig(source=str(tmp_path / "tiny.txt"), seq_len=64), min_windows=16)


def test_sampler_splits_global_batches_across_ranks():
    ranks = [ResumableSampler(100, seed=3, dp_rank=r, dp_size=4) for r in range(4)]
    reference = ResumableSampler(100, seed=3)
    for _ in range(7):  # crosses an epoch boundary (7 x 16 > 100)
        parts = [s.next_batch(16) for s in ranks]
        assert sum(parts, []) == reference.next_global_batch(16)
    epoch0 = ResumableSampler(100, seed=3).next_global_batch(100)
    assert sorted(epoch0) == list(range(100))  # each window once per epoch


def test_sampler_resumes_exactly():
    a = ResumableSampler(50, seed=1, dp_rank=1, dp_size=2)
    for _ in range(5):
        a.next_batch(8)
    state = a.state_dict()
    b = ResumableSampler(50, seed=1, dp_rank=1, dp_size=2)
    b.load_state_dict(state)
    assert [a.next_batch(8) for _ in range(10)] == [b.next_batch(8) for _ in range(10)]
    with pytest.raises(ValueError, match="windows"):
        ResumableSampler(51, seed=1).load_state_dict(state)
