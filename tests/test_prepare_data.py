"""recipes.prepare_data: raw JSONL / Parquet / text -> token shards + manifest, read back by the trainer;
Megatron-LM indexed datasets; bad input. Every expectation is recomputed independently from the texts."""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from recipes.prepare_data import main as prepare_main
from training.config import DataConfig
from training.data import check_vocab, load_corpus, token_dtype

ROOT = Path(__file__).resolve().parent.parent
WORDS = ["alpha", "beta", "gamma", "delta", "ünï", "code", "x", "the", "a"]


def _corpus(folder: Path, docs: int = 400, seed: int = 0) -> list[str]:
    """A JSONL file of ``docs`` random documents plus a text file; returns every document's text."""
    rng = random.Random(seed)
    texts = [f"doc {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60))) for i in range(docs)]
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "a.jsonl", "w") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"id": i, "text": t}) + "\n")
            if i == 7:
                f.write("   \n")  # blank: skipped silently
    (folder / "notes.txt").write_text("a plain text file\nis one document")
    return texts + ["a plain text file\nis one document"]


def _run(inp: list[Path], out: Path, tokenizer: str = "byte", *extra: str) -> int:
    return prepare_main(["--input", *map(str, inp), "--tokenizer", tokenizer, "--out", str(out), "--no-progress",
                         "--shard-mb", "0.004", *extra])


def _documents(out: Path) -> list[list[int]]:
    """Every document's tokens, read through the manifest and the document index (EOD included)."""
    m = json.loads((out / "manifest.json").read_text())
    docs = []
    for s in m["shards"]:
        tokens = np.fromfile(out / s["file"], dtype=m["dtype"])
        starts = np.load(out / s["docs_file"])
        assert starts[0] == 0 and starts[-1] == len(tokens) == s["tokens"]
        docs += [tokens[a:b].tolist() for a, b in zip(starts[:-1], starts[1:])]
    return docs


@pytest.mark.slow
def test_jsonl_and_text_to_shuffled_shards_with_eod_and_index(tmp_path):
    texts = _corpus(tmp_path / "in")
    assert _run([tmp_path / "in"], tmp_path / "out", "byte", "--workers", "2") == 0
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["dtype"] == "uint16" and m["tokenizer"] == {"spec": "byte", "hash": "byte", "vocab_size": 256,
                                                          "eod_id": 0}
    assert len(m["shards"]) > 3 and m["bad_lines"]["count"] == 0
    docs = _documents(tmp_path / "out")
    assert all(d[-1] == 0 and 0 not in d[:-1] for d in docs)  # one EOD, at the end of each document
    decoded = [bytes(d[:-1]).decode() for d in docs]
    assert sorted(decoded) == sorted(texts)  # every document exactly once
    assert decoded != texts and decoded[:20] != texts[:20]  # ... shuffled across shards
    assert m["total_tokens"] == sum(len(t.encode()) + 1 for t in texts) == sum(s["tokens"] for s in m["shards"])
    a = next(s for s in m["sources"] if s["path"].endswith("a.jsonl"))
    assert a["documents"] == len(texts) - 1
    import hashlib

    assert a["sha256"] == hashlib.sha256((tmp_path / "in" / "a.jsonl").read_bytes()).hexdigest()
    for s in m["shards"]:
        assert s["sha256"] == hashlib.sha256((tmp_path / "out" / s["file"]).read_bytes()).hexdigest()
        assert s["max_token"] == max(np.fromfile(tmp_path / "out" / s["file"], dtype=np.uint16))
    # deterministic: one worker gives the same bytes as two
    assert _run([tmp_path / "in"], tmp_path / "one", "byte", "--workers", "1") == 0
    m1 = json.loads((tmp_path / "one" / "manifest.json").read_text())
    assert [s["sha256"] for s in m1["shards"]] == [s["sha256"] for s in m["shards"]]


def test_resume_keeps_finished_shards_and_refuses_another_dataset(tmp_path, capsys):
    _corpus(tmp_path / "in")
    out = tmp_path / "out"
    assert _run([tmp_path / "in"], out) == 0
    m = json.loads((out / "manifest.json").read_text())
    # an interruption: the manifest and the last two shards never made it; a half-written tmp file remains
    (out / "manifest.json").unlink()
    for s in m["shards"][-2:]:
        for f in (s["file"], s["docs_file"], s["file"].replace(".bin", ".json")):
            (out / f).unlink()
    (out / (m["shards"][-1]["file"] + ".tmp")).write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match="incomplete"):
        load_corpus(DataConfig(source=str(out), seq_len=16), min_windows=1)
    kept = {s["file"]: os.stat(out / s["file"]).st_ino for s in m["shards"][:-2]}
    mtimes = {f: os.stat(out / f).st_mtime_ns for f in kept}
    assert _run([tmp_path / "in"], out) == 0
    m2 = json.loads((out / "manifest.json").read_text())
    assert m2["shards"] == m["shards"]
    assert {f: (os.stat(out / f).st_ino, os.stat(out / f).st_mtime_ns) for f in kept} == \
        {f: (kept[f], mtimes[f]) for f in kept}  # finished shards were not rewritten
    assert m2["throughput"]["tokens_this_run"] == sum(s["tokens"] for s in m["shards"][-2:])
    # the same folder with other inputs or options: refused, nothing touched
    capsys.readouterr()
    assert _run([tmp_path / "in"], out, "byte", "--seed", "7") == 2
    assert "holds another dataset" in capsys.readouterr().err and "seed" in (out / "prepare.json").read_text()
    assert json.loads((out / "manifest.json").read_text()) == m2
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "keep.me").write_text("x")
    assert _run([tmp_path / "in"], tmp_path / "foreign") == 2
    assert "not empty" in capsys.readouterr().err and (tmp_path / "foreign" / "keep.me").read_text() == "x"


def test_bad_jsonl_lines_counted_or_fatal_with_strict(tmp_path, capsys):
    texts = _corpus(tmp_path / "in", docs=50)
    with open(tmp_path / "in" / "a.jsonl", "a") as f:
        f.write("{not json\n")
        f.write(json.dumps({"body": "no text field"}) + "\n")
        f.write(json.dumps({"text": 5}) + "\n")
    n_lines = len((tmp_path / "in" / "a.jsonl").read_text().splitlines())
    assert _run([tmp_path / "in"], tmp_path / "out") == 0
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["bad_lines"]["count"] == 3 and len(_documents(tmp_path / "out")) == len(texts)
    where = sorted(e.split(": ")[0] for e in m["bad_lines"]["examples"])
    assert where == [f"{tmp_path / 'in' / 'a.jsonl'}:{n}" for n in (n_lines - 2, n_lines - 1, n_lines)]
    assert "3 bad JSONL lines" in capsys.readouterr().err
    assert _run([tmp_path / "in"], tmp_path / "strict", "byte", "--strict") == 2
    err = capsys.readouterr().err
    assert "a.jsonl:" in err and "--strict" in err and not (tmp_path / "strict" / "manifest.json").exists()


def test_max_tokens_cuts_exactly(tmp_path):
    _corpus(tmp_path / "in")
    assert _run([tmp_path / "in"], tmp_path / "out", "byte", "--max-tokens", "5000") == 0
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["total_tokens"] == 5000 == sum(len(d) for d in _documents(tmp_path / "out"))
    full = tmp_path / "full"
    assert _run([tmp_path / "in"], full) == 0
    stream = np.concatenate([np.fromfile(full / s["file"], np.uint16)
                             for s in json.loads((full / "manifest.json").read_text())["shards"]])
    cut = np.concatenate([np.fromfile(tmp_path / "out" / s["file"], np.uint16) for s in m["shards"]])
    assert np.array_equal(cut, stream[:5000])  # the cut is a prefix of the full stream


def _word_tokenizer(path: Path, extra_words: int = 0) -> Path:
    """A word-level tokenizer.json built here (no download): WORDS + digits + punctuation + </s>."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1}
    for w in WORDS + ["doc", ":"] + [str(i) for i in range(1000)] + [f"w{i}" for i in range(extra_words)]:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.add_special_tokens(["</s>"])
    tok.save(str(path))
    return path


@pytest.mark.slow
def test_hf_tokenizer_json_dtype_eod_and_hash_check(tmp_path):
    pytest.importorskip("tokenizers")
    texts = _corpus(tmp_path / "in", docs=60)
    tok = _word_tokenizer(tmp_path / "tok" / "tokenizer.json")
    assert _run([tmp_path / "in" / "a.jsonl"], tmp_path / "out", str(tok), "--workers", "2") == 0
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["dtype"] == "uint16" and m["tokenizer"]["eod_id"] == 1 and m["tokenizer"]["hash"].startswith("sha256:")
    from tokenizers import Tokenizer

    ref = Tokenizer.from_file(str(tok))
    want = sorted(ref.encode(t, add_special_tokens=False).ids + [1] for t in texts[:-1])
    assert sorted(_documents(tmp_path / "out")) == want
    corpus = load_corpus(DataConfig(source=str(tmp_path / "out"), tokenizer=str(tok), seq_len=16), min_windows=1)
    check_vocab(corpus, 1024)
    with pytest.raises(ValueError, match="larger than the model's vocab_size 256"):
        check_vocab(corpus, 256)
    with pytest.raises(ValueError, match="not the tokenizer the shards"):
        load_corpus(DataConfig(source=str(tmp_path / "out"), tokenizer="byte", seq_len=16), min_windows=1)
    other = _word_tokenizer(tmp_path / "tok2" / "tokenizer.json", extra_words=3)
    with pytest.raises(ValueError, match="not the tokenizer the shards"):
        load_corpus(DataConfig(source=str(tmp_path / "out"), tokenizer=str(other), seq_len=16), min_windows=1)
    # a vocabulary over 65536 ids is stored as uint32
    big = _word_tokenizer(tmp_path / "big" / "tokenizer.json", extra_words=70_000)
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    assert _run([tmp_path / "in" / "a.jsonl"], tmp_path / "out32", str(big), "--workers", "1") == 0
    m32 = json.loads((tmp_path / "out32" / "manifest.json").read_text())
    assert m32["dtype"] == "uint32" and sorted(_documents(tmp_path / "out32")) == want


def test_parquet_input(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    texts = [f"parquet row {i} " + "beta " * (i % 7) for i in range(90)]
    pq.write_table(pa.table({"text": texts, "n": list(range(90))}), tmp_path / "d.parquet", row_group_size=25)
    assert _run([tmp_path / "d.parquet"], tmp_path / "out", "byte", "--workers", "2") == 0
    assert sorted(bytes(d[:-1]).decode() for d in _documents(tmp_path / "out")) == sorted(texts)
    assert _run([tmp_path / "d.parquet"], tmp_path / "bad", "byte", "--text-field", "body") == 2


def test_corrupted_or_truncated_shard_is_named(tmp_path):
    _corpus(tmp_path / "in")
    out = tmp_path / "out"
    assert _run([tmp_path / "in"], out) == 0
    cfg = DataConfig(source=str(out), seq_len=16)
    assert load_corpus(cfg, min_windows=1).num_tokens == json.loads((out / "manifest.json").read_text())["total_tokens"]
    shard = out / "shard_00002.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="shard_00002.bin.*sha256"):
        load_corpus(cfg, min_windows=1)
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(ValueError, match="shard_00002.bin.*bytes"):
        load_corpus(cfg, min_windows=1)


def _write_megatron(prefix: Path, docs: list[np.ndarray], dtype=np.uint16, code: int = 8) -> None:
    """A Megatron-LM indexed dataset written from its format description (one sequence per document)."""
    lengths = np.array([len(d) for d in docs], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1].astype(np.int64))]) * np.dtype(dtype).itemsize
    doc_idx = np.arange(len(docs) + 1, dtype=np.int64)
    np.concatenate(docs).astype(dtype).tofile(prefix.with_suffix(".bin"))
    with open(prefix.with_suffix(".idx"), "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code))
        f.write(struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_idx)))
        f.write(lengths.tobytes() + pointers.astype(np.int64).tobytes() + doc_idx.tobytes())


def test_megatron_indexed_dataset(tmp_path):
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 70_000, size=int(n)).astype(np.int64) for n in rng.integers(5, 200, size=40)]
    _write_megatron(tmp_path / "corpus_text_document", docs, np.int32, 4)
    cfg = DataConfig(source=str(tmp_path / "corpus_text_document.bin"), seq_len=32, valid_fraction=0.0)
    corpus = load_corpus(cfg, min_windows=1)
    stream = np.concatenate(docs)
    assert corpus.shards[0].dtype == np.int32 and np.array_equal(np.asarray(corpus.shards[0]), stream)
    x, y = corpus.batch([3])
    assert x[0].tolist() == stream[96:128].tolist() and y[0].tolist() == stream[97:129].tolist()
    with pytest.raises(ValueError, match="vocab_size"):
        check_vocab(corpus, 256)
    # a truncated .bin or a foreign .idx: named
    bin_path = tmp_path / "corpus_text_document.bin"
    bin_path.write_bytes(bin_path.read_bytes()[:-4])
    with pytest.raises(ValueError, match="corpus_text_document.bin.*corrupted"):
        load_corpus(cfg, min_windows=1)
    (tmp_path / "corpus_text_document.idx").write_bytes(b"NOTANIDX" * 8)
    with pytest.raises(ValueError, match="not a Megatron-LM"):
        load_corpus(cfg, min_windows=1)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_jsonl_to_prepare_data_to_recipes_train(tmp_path):
    """One command from raw JSONL to shards, one to a training run on them (one process, 3 steps)."""
    _corpus(tmp_path / "in", docs=600)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1",
           "DSV3_KERNEL_IMPL": "reference"}
    prep = subprocess.run([sys.executable, "-m", "recipes.prepare_data", "--input", str(tmp_path / "in" / "a.jsonl"),
                           "--tokenizer", "byte", "--out", str(tmp_path / "data"), "--workers", "2", "--no-progress"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert prep.returncode == 0, prep.stderr
    cmd = [sys.executable, "-m", "recipes.train", "--config", "recipes/configs/tiny_cpu.toml", "--nproc", "1",
           "--run-dir", str(tmp_path / "run")]
    for o in ["parallel.pp=1", "parallel.dp=1", "parallel.ep=1", "parallel.schedule=none", "run.steps=3",
              "data.seq_len=32", "data.global_batch=4", "data.micro_batch=2", "logging.progress=false",
              "logging.eval_batches=1", "logging.wandb=disabled", "run.sample_tokens=4", "checkpoint.interval=0",
              "checkpoint.final=false", "model.fp8=false", f"data.source={tmp_path / 'data'}"]:
        cmd += ["--set", o]
    train = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert train.returncode == 0, (train.stdout + train.stderr)[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 3 and all(np.isfinite(losses)) and abs(losses[0] - np.log(256)) < 0.3


# ---- Fill-in-the-Middle ------------------------------------------------------------------------------------

def _char_tokenizer(path: Path, texts: list[str], fim: tuple[str, ...] = ("<｜fim▁begin｜>", "<｜fim▁hole｜>",
                                                                          "<｜fim▁end｜>")) -> Path:
    """A character-level tokenizer.json built here: every character of ``texts`` a token, plus </s> and the FIM
    sentinels ``fim`` as special tokens (so ids decode back to the exact text)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1}
    for ch in sorted(set("".join(texts))):
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    tok.add_special_tokens(["</s>", *fim])
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def _texts_of(out: Path, tok: Path) -> list[list[str]]:
    """Each stored document as its tokens' strings (EOD dropped)."""
    from tokenizers import Tokenizer

    ref = Tokenizer.from_file(str(tok))
    return [[ref.id_to_token(i) for i in doc[:-1]] for doc in _documents(out)]


@pytest.mark.slow
def test_fim_psm_spm_rate_and_reproducible_over_workers(tmp_path):
    """--fim-rate 0.1: about 10% of documents (binomial over 401: 40 +- 6; [16, 64] is 4 sigma) become
    begin prefix hole suffix end middle, whose parts put back in order are the document; the rest are
    unchanged; the same bytes with 1 or 3 workers; SPM stores begin hole suffix end prefix middle."""
    pytest.importorskip("tokenizers")
    texts = _corpus(tmp_path / "in")
    tok = _char_tokenizer(tmp_path / "tok" / "tokenizer.json", texts)
    begin, hole, end = "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"
    runs = {}
    for name, extra in (("psm1", ["--workers", "1"]), ("psm3", ["--workers", "3"]),
                        ("spm", ["--workers", "1", "--fim-mode", "spm"])):
        assert _run([tmp_path / "in"], tmp_path / name, str(tok), "--fim-rate", "0.1", *extra) == 0
        runs[name] = _texts_of(tmp_path / name, tok)
    shards = [json.loads((tmp_path / n / "manifest.json").read_text())["shards"] for n in ("psm1", "psm3")]
    assert runs["psm1"] == runs["psm3"] and shards[0] == shards[1]  # (file hashes included)
    originals = sorted(texts)
    restored, fim_docs = [], 0
    for doc in runs["psm1"]:
        if doc and doc[0] == begin:
            fim_docs += 1
            h, e = doc.index(hole), doc.index(end)
            assert doc.count(begin) == doc.count(hole) == doc.count(end) == 1 and 0 < h < e
            prefix, suffix, middle = doc[1:h], doc[h + 1:e], doc[e + 1:]
            restored.append("".join(prefix + middle + suffix))
        else:
            assert begin not in doc and hole not in doc and end not in doc
            restored.append("".join(doc))
    assert sorted(restored) == originals and 16 <= fim_docs <= 64, fim_docs
    manifest = json.loads((tmp_path / "psm1" / "manifest.json").read_text())
    assert manifest["fim"]["documents_this_run"] == fim_docs and manifest["fim"]["mode"] == "psm"
    # SPM: the same documents cut at the same points (the draw depends on the seed and the document only)
    spm = {}
    for doc in runs["spm"]:
        if doc and doc[0] == begin:
            assert doc[1] == hole
            e = doc.index(end)
            spm["".join(doc[2:e]) + "|" + "".join(doc[e + 1:])] = doc
    psm = {"".join(d[d.index(hole) + 1:d.index(end)]) + "|" + "".join(d[1:d.index(hole)] + d[d.index(end) + 1:])
           for d in runs["psm1"] if d and d[0] == begin}
    assert set(spm) == psm
    # another seed cuts other documents
    assert _run([tmp_path / "in"], tmp_path / "seed", str(tok), "--fim-rate", "0.1", "--seed", "7") == 0
    assert manifest["shards"] != json.loads((tmp_path / "seed" / "manifest.json").read_text())["shards"]


def test_fim_rate_one_and_zero(tmp_path):
    """Rate 1: every document is a FIM example; rate 0 (the default): the output is the FIM-free one, bytewise."""
    pytest.importorskip("tokenizers")
    texts = _corpus(tmp_path / "in", docs=40)
    tok = _char_tokenizer(tmp_path / "tok" / "tokenizer.json", texts)
    assert _run([tmp_path / "in"], tmp_path / "all", str(tok), "--fim-rate", "1") == 0
    assert all(doc[0] == "<｜fim▁begin｜>" for doc in _texts_of(tmp_path / "all", tok))
    assert _run([tmp_path / "in"], tmp_path / "none", str(tok), "--fim-rate", "0") == 0
    assert _run([tmp_path / "in"], tmp_path / "plain", str(tok)) == 0
    shas = [[s["sha256"] for s in json.loads((tmp_path / n / "manifest.json").read_text())["shards"]]
            for n in ("none", "plain")]
    assert shas[0] == shas[1]


@pytest.mark.parametrize("extra, needle", [
    (["--fim-rate", "1.5"], "--fim-rate must be in [0, 1]"),
    (["--fim-rate", "-0.1"], "--fim-rate must be in [0, 1]"),
    (["--fim-rate", "nan"], "--fim-rate must be in [0, 1]"),
    (["--fim-rate", "0.1", "--fim-tokens", "<a>", "<b>", "<c>"], "--fim-tokens: '<a>', '<b>', '<c>' not in the"),
    (["--fim-rate", "0.1", "--tokenizer-is-byte"], "the byte tokenizer has none"),
])
def test_fim_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, extra, needle):
    pytest.importorskip("tokenizers")
    texts = _corpus(tmp_path / "in", docs=10)
    tok = "byte" if "--tokenizer-is-byte" in extra else str(_char_tokenizer(tmp_path / "tok" / "t.json", texts))
    extra = [e for e in extra if e != "--tokenizer-is-byte"]
    assert _run([tmp_path / "in"], tmp_path / "out", tok, *extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and needle in err, err
    assert not (tmp_path / "out").exists()
