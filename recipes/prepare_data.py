"""Tokenize a raw corpus into token shards that a config names as ``data.source``.

    python -m recipes.prepare_data --input corpus/ --tokenizer byte --out data/corpus
    python -m recipes.prepare_data --input a.jsonl b.parquet --tokenizer DeepSeek-V3/tokenizer.json \\
        --out data/v3 --workers 16 --max-tokens 2e9

Inputs: JSONL (one JSON object per line, the text in ``--text-field``), Parquet (the ``--text-field``
column; needs ``pyarrow``), plain text files (one document each), or folders of them (recursively).
Output ``DIR``:

- ``shard_00000.bin``: the tokens of a shard's documents back to back, each followed by the end-of-document
  token, as uint16 (vocabulary <= 65536) or uint32; ``shard_00000.docs.npy``: the int64 offsets where its
  documents start (plus the end), the index of document boundaries;
- ``manifest.json`` (written last: the dataset is complete): dtype, tokenizer (spec, hash, vocabulary,
  end-of-document id), per shard its tokens, documents, largest id and sha256, per source its sha256,
  and the bad JSONL lines (count and the first few, by file and line);
- ``prepare.json`` (written first): what the folder is being made from; a second run with the same inputs
  and options resumes (finished shards are kept), other inputs are refused.

Fill-in-the-Middle (``--fim-rate 0.1``, as DeepSeek-V3 pretrains): each document, before packing, is with that
probability cut at two uniformly drawn character positions into prefix, middle and suffix and stored as
``<｜fim▁begin｜>`` prefix ``<｜fim▁hole｜>`` suffix ``<｜fim▁end｜>`` middle, then the end-of-document token
(PSM; ``--fim-mode spm``: ``<｜fim▁begin｜><｜fim▁hole｜>`` suffix ``<｜fim▁end｜>`` prefix middle). The three
parts are tokenized separately; the sentinels are the tokenizer's own tokens (``--fim-tokens BEGIN HOLE END``
to name others). Whether and where a document is cut depends only on ``--seed`` and the document's place in
its source, so the output is the same for any ``--workers``.

Documents are shuffled deterministically (``--seed``) across and within shards: the document list is
permuted and cut into shards of about ``--shard-mb`` MB of source text, so the output depends on the
inputs and options, not on ``--workers``. Workers tokenize chunks of documents in parallel; the main
process writes each shard (fsynced, then renamed into place) in order, so ``--max-tokens`` cuts the stream
at exactly that many tokens.
"""

from __future__ import annotations

import argparse
import codecs
import functools
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from accel.cli import (
    BAD_INPUT,
    OK,
    ArgumentParser,
    check_output_dir,
    nonnegative_float,
    positive_float,
    positive_int,
)
from training.data import (
    MANIFEST_FILE,
    PLAN_FILE,
    PREPARED_FORMAT,
    ByteTokenizer,
    build_tokenizer,
    sha256_file,
    token_dtype,
    tokenizer_file,
    tokenizer_hash,
)

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
TEXT_SUFFIXES = (".txt", ".md", ".text")
CHUNK_DOCS = 512  # documents per worker task: small enough for a smooth progress bar, large enough to batch
# End-of-document tokens of common tokenizers (DeepSeek-V3's first), tried when tokenizer_config.json is absent
EOD_CANDIDATES = ("<｜end▁of▁sentence｜>", "<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>")
BAD_EXAMPLES = 20  # bad lines listed by file and line in the manifest (all are counted)
FIM_TOKENS = ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>")  # DeepSeek-V3's: before prefix, hole, before middle
FIM_MODES = ("psm", "spm")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = ArgumentParser(prog="python -m recipes.prepare_data", description=__doc__.split("\n")[0])
    ap.add_argument("--input", nargs="+", required=True, metavar="FILE",
                    help="JSONL / Parquet / text files or folders of them")
    ap.add_argument("--tokenizer", required=True, help="'byte' or a Hugging Face tokenizer.json (or its folder)")
    ap.add_argument("--out", required=True, help="output folder (data.source of a training config)")
    ap.add_argument("--text-field", default="text", help="JSONL key / Parquet column holding the text")
    ap.add_argument("--workers", type=positive_int, default=max(1, (os.cpu_count() or 1) - 1),
                    help="tokenizer processes")
    ap.add_argument("--max-tokens", type=nonnegative_float, default=0, help="stop after this many tokens (0 = all)")
    ap.add_argument("--seed", type=int, default=1234, help="seed of the document shuffle")
    ap.add_argument("--shard-mb", type=positive_float, default=256.0, help="source megabytes per shard")
    ap.add_argument("--eod", default=None, help="end-of-document token (default: the tokenizer's end-of-sentence)")
    ap.add_argument("--fim-rate", type=float, default=0.0,
                    help="share of documents turned into Fill-in-the-Middle examples, in [0, 1] (V3: 0.1)")
    ap.add_argument("--fim-mode", choices=FIM_MODES, default="psm",
                    help="FIM order: psm (prefix, suffix, middle: V3's) or spm (suffix, prefix, middle)")
    ap.add_argument("--fim-tokens", nargs=3, default=list(FIM_TOKENS), metavar=("BEGIN", "HOLE", "END"),
                    help="the tokenizer's FIM sentinel tokens (default: DeepSeek's " + " ".join(FIM_TOKENS) + ")")
    ap.add_argument("--strict", action="store_true", help="a bad JSONL line is fatal (default: count and skip)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap.parse_args(argv)


# ---- sources -------------------------------------------------------------------------------------

@dataclass
class Source:
    path: Path
    kind: str  # jsonl | parquet | text
    sha256: str = ""
    bytes: int = 0
    documents: int = 0


def find_sources(inputs: list[str]) -> list[Source]:
    """Every input file (folders searched recursively, in sorted order); ValueError naming a bad path."""
    known = JSONL_SUFFIXES + PARQUET_SUFFIXES + TEXT_SUFFIXES
    out: list[Source] = []
    for item in inputs:
        path = Path(item).expanduser()
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in known)
            if not files:
                raise ValueError(f"--input {item!r}: the folder holds no {'/'.join(known)} files")
        elif path.is_file():
            if path.suffix not in known:
                raise ValueError(f"--input {item!r}: unknown file type {path.suffix!r}, expected one of "
                                 f"{', '.join(known)}")
            if path.stat().st_size == 0:
                raise ValueError(f"--input {item!r}: the file is empty")
            files = [path]
        else:
            raise ValueError(f"--input {item!r}: no such file or folder")
        for f in files:
            kind = "jsonl" if f.suffix in JSONL_SUFFIXES else "parquet" if f.suffix in PARQUET_SUFFIXES else "text"
            out.append(Source(f.resolve(), kind))
    seen: set[Path] = set()
    return [s for s in out if not (s.path in seen or seen.add(s.path))]


def _parquet_file(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"--input {str(path)!r}: Parquet needs the optional 'pyarrow' package "
                         "(pip install pyarrow)") from None
    return pq.ParquetFile(str(path))


_IS_TEXT = np.ones(256, dtype=bool)
_IS_TEXT[[9, 10, 11, 12, 13, 32]] = False  # ASCII whitespace


def jsonl_lines(path: Path, block_size: int = 64 << 20) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start, end byte, 1-based line number) of every non-blank line, reading the file in blocks."""
    starts, ends, numbers = [], [], []
    offset, line_start, line_no, has_text = 0, 0, 1, False
    with open(path, "rb") as f:
        while block := f.read(block_size):
            b = np.frombuffer(block, np.uint8)
            newlines = np.flatnonzero(b == 10)
            text = np.concatenate([[0], np.cumsum(_IS_TEXT[b], dtype=np.int64)])
            seg_starts = np.concatenate([[0], newlines[:-1] + 1]) if len(newlines) else np.zeros(0, np.int64)
            counts = text[newlines] - text[seg_starts]
            if len(newlines):
                counts[0] += has_text  # the line carried over from the previous block
                seg_abs = np.concatenate([[line_start], offset + seg_starts[1:]]).astype(np.int64)
                keep = counts > 0
                starts.append(seg_abs[keep])
                ends.append(offset + newlines[keep] + 1)
                numbers.append(line_no + np.flatnonzero(keep))
                line_no += len(newlines)
                line_start = offset + int(newlines[-1]) + 1
                has_text = bool(text[-1] - text[newlines[-1] + 1])
            else:
                has_text = has_text or bool(text[-1])
            offset += len(b)
    if has_text:  # a last line without a newline
        starts.append(np.array([line_start]))
        ends.append(np.array([offset]))
        numbers.append(np.array([line_no]))
    cat = lambda parts: np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
    return cat(starts), cat(ends), cat(numbers)


def check_text(path: Path, block_size: int = 16 << 20) -> None:
    """ValueError naming ``path`` unless it is UTF-8 text without NUL bytes (a plain text input is one document;
    a binary file would tokenize into garbage)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(block_size)
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as exc:
                raise ValueError(f"--input {str(path)!r}: not UTF-8 text (byte {block[exc.start]:#04x} at offset "
                                 f"{offset + exc.start}); expected UTF-8 text, JSONL or Parquet") from None
            if (nul := block.find(b"\0")) >= 0:
                raise ValueError(f"--input {str(path)!r}: binary data (a NUL byte at offset {offset + nul}); "
                                 "expected UTF-8 text, JSONL or Parquet")
            if not block:
                return
            offset += len(block)


def scan(sources: list[Source], text_field: str) -> np.ndarray:
    """Hash every source and list its documents: int64 rows (source, a, b, line) where (a, b) is the byte
    range of a JSONL line or a text file, or (row group, row) of a Parquet row; ``line`` is 1-based."""
    rows: list[np.ndarray] = []
    for i, src in enumerate(sources):
        src.sha256, src.bytes = sha256_file(src.path), src.path.stat().st_size
        if src.kind == "text":
            check_text(src.path)
            refs = np.array([[i, 0, src.bytes, 1]] if src.bytes else [], dtype=np.int64).reshape(-1, 4)
        elif src.kind == "jsonl":
            starts, ends, lines = jsonl_lines(src.path)
            refs = np.stack([np.full(len(starts), i), starts, ends, lines], axis=1).astype(np.int64)
        else:
            pf = _parquet_file(src.path)
            if text_field not in pf.schema_arrow.names:
                raise ValueError(f"--input {str(src.path)!r}: no column {text_field!r} (it has "
                                 f"{', '.join(pf.schema_arrow.names)}); set --text-field")
            parts, line = [], 1
            for g in range(pf.metadata.num_row_groups):
                n = pf.metadata.row_group(g).num_rows
                parts.append(np.stack([np.full(n, i), np.full(n, g), np.arange(n), line + np.arange(n)], axis=1))
                line += n
            refs = np.concatenate(parts).astype(np.int64) if parts else np.zeros((0, 4), np.int64)
        src.documents = len(refs)
        rows.append(refs)
    return np.concatenate(rows) if rows else np.zeros((0, 4), np.int64)


# ---- tokenization (runs in the worker processes) ---------------------------------------------------------

@dataclass
class WorkerSetup:
    tokenizer: str
    sources: list[str]
    kinds: list[str]
    text_field: str
    eod: int
    strict: bool
    dtype: str
    fim_rate: float = 0.0
    fim_mode: str = "psm"
    fim_ids: tuple[int, int, int] = (-1, -1, -1)  # begin, hole, end
    seed: int = 0


_SETUP: WorkerSetup | None = None
_TOKENIZER = None


def _init_worker(setup: WorkerSetup) -> None:
    global _SETUP, _TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker; the pool is the parallelism
    _SETUP, _TOKENIZER = setup, build_tokenizer(setup.tokenizer)


@functools.lru_cache(maxsize=4)
def _row_group(path: str, group: int, field: str) -> list[Any]:
    return _parquet_file(Path(path)).read_row_group(group, columns=[field]).column(0).to_pylist()


def _read_documents(refs: np.ndarray) -> tuple[list[str | None], list[str]]:
    """The texts of ``refs`` (None for a bad JSONL line or a missing value) and why each bad one is bad."""
    s = _SETUP
    texts: list[str | None] = [None] * len(refs)
    bad: list[str] = []
    order = np.lexsort((refs[:, 2], refs[:, 1], refs[:, 0]))  # read each file front to back
    handles: dict[int, Any] = {}
    try:
        for k in order:
            src, a, b, line = (int(x) for x in refs[k])
            where = f"{s.sources[src]}:{line}"
            if s.kinds[src] == "parquet":
                value = _row_group(s.sources[src], a, s.text_field)[b]
                if isinstance(value, str):
                    texts[k] = value
                else:
                    bad.append(f"{where}: column {s.text_field!r} is {type(value).__name__}, expected a string")
                continue
            f = handles.get(src) or handles.setdefault(src, open(s.sources[src], "rb"))
            f.seek(a)
            data = f.read(b - a)
            if s.kinds[src] == "text":  # checked as UTF-8 by the scan
                texts[k] = data.decode("utf-8", errors="replace")
                continue
            try:
                raw = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                bad.append(f"{where}: not UTF-8 (byte {data[exc.start]:#04x} at column {exc.start + 1})")
                continue
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as exc:
                bad.append(f"{where}: not JSON ({exc.msg} at column {exc.colno})")
                continue
            value = obj.get(s.text_field) if isinstance(obj, dict) else None
            if isinstance(value, str):
                texts[k] = value
            else:
                bad.append(f"{where}: no string field {s.text_field!r}" + (
                    f" (keys: {', '.join(list(obj)[:8])})" if isinstance(obj, dict) else " (not a JSON object)"))
    finally:
        for f in handles.values():
            f.close()
    if bad and s.strict:
        raise ValueError(f"{bad[0]} (--strict: a bad line is fatal; without --strict it is counted and skipped)")
    return texts, bad


def fim_split(text: str, seed: int, ref: np.ndarray, rate: float) -> tuple[str, str, str] | None:
    """(prefix, middle, suffix) of ``text`` when the document ``ref`` (its source, start, end) is drawn for FIM
    (probability ``rate``), else None. The draw is seeded by ``seed`` and ``ref`` alone: the same for any chunking
    or worker count. The two cut points are uniform over the text's character positions (ends included)."""
    rng = np.random.default_rng([seed, *(int(x) for x in ref[:3])])
    if not rng.random() < rate:
        return None
    i, j = sorted(int(x) for x in rng.integers(0, len(text) + 1, size=2))
    return text[:i], text[i:j], text[j:]


def _encode(texts: list[str], refs: np.ndarray) -> tuple[list[list[int]], int]:
    """Each text's ids, FIM-transformed where drawn (``fim_split``); also how many were."""
    s = _SETUP
    if not s.fim_rate:
        return _TOKENIZER.encode_batch(texts), 0
    splits = [fim_split(t, s.seed, ref, s.fim_rate) for t, ref in zip(texts, refs)]
    pieces = [p for t, split in zip(texts, splits) for p in (split if split is not None else (t,))]
    ids = iter(_TOKENIZER.encode_batch(pieces))
    begin, hole, end = s.fim_ids
    out = []
    for split in splits:
        if split is None:
            out.append(next(ids))
            continue
        prefix, middle, suffix = next(ids), next(ids), next(ids)
        out.append([begin, *prefix, hole, *suffix, end, *middle] if s.fim_mode == "psm"
                   else [begin, hole, *suffix, end, *prefix, *middle])
    return out, sum(split is not None for split in splits)


def tokenize_chunk(refs: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[str], int]:
    """(tokens, per-document token counts, bad lines, FIM documents) of the documents ``refs`` in their given
    order; every document's tokens are followed by the end-of-document id. Empty documents are dropped."""
    texts, bad = _read_documents(refs)
    if isinstance(_TOKENIZER, ByteTokenizer):  # NUL is the byte tokenizer's end-of-document: keep it out of text
        texts = [t.replace("\x00", "") if t is not None else None for t in texts]
    keep = [k for k, t in enumerate(texts) if t]
    ids, fim = _encode([texts[k] for k in keep], refs[keep]) if keep else ([], 0)
    lengths = np.array([len(x) + 1 for x in ids], dtype=np.int64)
    tokens = np.empty(int(lengths.sum()), dtype=_SETUP.dtype)
    pos = 0
    for x in ids:
        tokens[pos:pos + len(x)] = x
        tokens[pos + len(x)] = _SETUP.eod
        pos += len(x) + 1
    return tokens, lengths, bad, fim


# ---- the main process ----------------------------------------------------------------------------------

def eod_id(spec: str, tokenizer, eod: str | None) -> int:
    """The end-of-document id: ``--eod``, else tokenizer_config.json's ``eos_token``, else a known token."""
    if isinstance(tokenizer, ByteTokenizer):
        if eod not in (None, "\\x00", "0"):
            raise ValueError(f"--eod {eod!r}: the byte tokenizer's end-of-document is byte 0 (NUL)")
        return 0
    names = [eod] if eod is not None else []
    config = tokenizer_file(spec).parent / "tokenizer_config.json"
    if eod is None and config.is_file():
        eos = json.loads(config.read_text()).get("eos_token")
        names.append(eos.get("content") if isinstance(eos, dict) else eos)
    names += list(EOD_CANDIDATES) if eod is None else []
    for name in names:
        if name is not None and tokenizer.token_to_id(name) is not None:
            return int(tokenizer.token_to_id(name))
    what = f"token {eod!r} is not in the tokenizer" if eod else "no end-of-document token found"
    raise ValueError(f"--eod: {what} ({spec!r}); pass --eod TOKEN with a token of its vocabulary")


def fim_ids(args: argparse.Namespace, tokenizer) -> tuple[int, int, int]:
    """The ids of ``--fim-tokens`` when ``--fim-rate`` > 0 ((-1, -1, -1) otherwise); ValueError for a rate outside
    [0, 1] or a sentinel the tokenizer lacks."""
    if not 0.0 <= args.fim_rate <= 1.0:  # (also refuses nan)
        raise ValueError(f"--fim-rate must be in [0, 1] (the share of documents made FIM examples), got "
                         f"{args.fim_rate}")
    if not args.fim_rate:
        return -1, -1, -1
    if isinstance(tokenizer, ByteTokenizer):
        raise ValueError("--fim-rate needs FIM sentinel tokens (--fim-tokens), and the byte tokenizer has none; use "
                         "a tokenizer.json that has them (DeepSeek-V3's: " + " ".join(FIM_TOKENS) + ")")
    ids = [tokenizer.token_to_id(t) for t in args.fim_tokens]
    missing = [t for t, i in zip(args.fim_tokens, ids) if i is None]
    if missing:
        raise ValueError(f"--fim-tokens: {', '.join(map(repr, missing))} not in the tokenizer ({args.tokenizer!r}); "
                         "name its fill-in-the-middle sentinels (BEGIN HOLE END) with --fim-tokens")
    return tuple(int(i) for i in ids)


def plan_identity(args: argparse.Namespace, sources: list[Source], tok_hash: str, eod: int,
                  fim: tuple[int, int, int] = (-1, -1, -1)) -> dict[str, Any]:
    """Everything the output depends on: a rerun with the same identity resumes, another one is refused."""
    identity = {"format": PREPARED_FORMAT, "tokenizer_hash": tok_hash, "eod_id": eod, "text_field": args.text_field,
                "seed": args.seed, "shard_mb": args.shard_mb, "max_tokens": int(args.max_tokens),
                "sources": [{"path": str(s.path), "sha256": s.sha256} for s in sources]}
    if args.fim_rate:  # (a FIM-free plan keeps the identity earlier folders were made with)
        identity["fim"] = {"rate": args.fim_rate, "mode": args.fim_mode, "ids": list(fim)}
    return identity


def check_out_folder(out: Path, identity: dict[str, Any]) -> None:
    """Create ``out``, or accept it when it holds this same dataset (resume); ValueError otherwise."""
    plan = out / PLAN_FILE
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a file, expected a folder")
    if plan.is_file():
        saved = json.loads(plan.read_text())
        if saved != identity:
            diff = sorted(k for k in set(saved) | set(identity) if saved.get(k) != identity.get(k))
            raise ValueError(f"--out {str(out)!r} holds another dataset (it differs in: {', '.join(diff)}); "
                             "choose another folder or delete this one (nothing was changed)")
        return
    if out.is_dir() and any(out.iterdir()):
        raise ValueError(f"--out {str(out)!r} is not empty and not a prepare_data folder (no {PLAN_FILE}); "
                         "choose an empty or new folder (nothing was changed)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--out {str(out)!r}: cannot create the folder ({exc.strerror})") from None
    _atomic_write(plan, json.dumps(identity, indent=1).encode())


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def shard_name(k: int) -> str:
    return f"shard_{k:05d}"


class ShardWriter:
    """Appends token chunks to ``shard_k.bin.tmp``; ``finish`` fsyncs it, writes the document index and the
    shard's record, and renames everything into place (the record last: it marks the shard finished)."""

    def __init__(self, out: Path, k: int, dtype: np.dtype) -> None:
        self.out, self.name, self.dtype = out, shard_name(k), dtype
        self.tmp = out / f"{self.name}.bin.tmp"
        self.f = open(self.tmp, "wb")
        self.hash = hashlib.sha256()
        self.lengths: list[np.ndarray] = []
        self.tokens, self.max_token = 0, -1

    def append(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        data = tokens.astype(self.dtype).tobytes()
        self.f.write(data)
        self.hash.update(data)
        self.lengths.append(lengths)
        self.tokens += len(tokens)
        if len(tokens):
            self.max_token = max(self.max_token, int(tokens.max()))

    def finish(self, bad: int) -> dict[str, Any]:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, self.out / f"{self.name}.bin")
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        docs_tmp = self.out / f"{self.name}.docs.tmp.npy"
        np.save(docs_tmp, starts)
        os.replace(docs_tmp, self.out / f"{self.name}.docs.npy")
        record = {"file": f"{self.name}.bin", "docs_file": f"{self.name}.docs.npy", "tokens": self.tokens,
                  "documents": len(lengths), "max_token": self.max_token, "sha256": self.hash.hexdigest(),
                  "bad_lines": bad}
        _atomic_write(self.out / f"{self.name}.json", json.dumps(record).encode())
        return record

    def abort(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)


def finished_shard(out: Path, k: int, dtype: np.dtype) -> dict[str, Any] | None:
    """The record of shard ``k`` if an earlier run finished it and its file has the recorded size."""
    rec_path = out / f"{shard_name(k)}.json"
    if not rec_path.is_file():
        return None
    record = json.loads(rec_path.read_text())
    path = out / record["file"]
    if not path.is_file() or path.stat().st_size != record["tokens"] * dtype.itemsize \
            or not (out / record["docs_file"]).is_file():
        return None
    return record


def prepare(args: argparse.Namespace) -> dict[str, Any]:
    """Tokenize ``args.input`` into ``args.out``; returns the manifest. ValueError for bad input."""
    out = check_output_dir(args.out, "--out")  # (--workers, --shard-mb, --max-tokens: checked by their types)
    try:
        tok_hash = tokenizer_hash(args.tokenizer)
    except ValueError as exc:  # named after the training config's key; here it is --tokenizer
        raise ValueError(str(exc).replace("data.tokenizer", "--tokenizer", 1)) from None
    try:
        tokenizer = build_tokenizer(args.tokenizer)
    except Exception as exc:  # the tokenizers library raises its own Exception for a malformed file
        raise ValueError(f"--tokenizer {args.tokenizer!r}: not a readable Hugging Face tokenizer.json ({exc})"
                         ) from None
    eod = eod_id(args.tokenizer, tokenizer, args.eod)
    fim = fim_ids(args, tokenizer)
    dtype = token_dtype(tokenizer.vocab_size)
    sources = find_sources(args.input)
    t_scan = time.perf_counter()
    refs = scan(sources, args.text_field)
    if len(refs) == 0:
        raise ValueError(f"--input {' '.join(args.input)}: no documents found")
    identity = plan_identity(args, sources, tok_hash, eod, fim)
    created = out  # the outermost folder this run creates (None: --out exists)
    while not created.parent.exists():
        created = created.parent
    created = None if out.exists() else created
    fresh = not (out / PLAN_FILE).is_file()  # not a resumed run: a refusal below leaves the folder as it found it
    check_out_folder(out, identity)
    perm = np.random.default_rng(args.seed).permutation(len(refs))
    total_bytes = sum(s.bytes for s in sources)
    num_shards = max(1, min(len(refs), int(np.ceil(total_bytes / (args.shard_mb * 1e6)))))
    shards = np.array_split(perm, num_shards)
    setup = WorkerSetup(args.tokenizer, [str(s.path) for s in sources], [s.kind for s in sources],
                        args.text_field, eod, args.strict, dtype.name, args.fim_rate, args.fim_mode, fim, args.seed)
    limit = int(args.max_tokens) or None
    records: list[dict[str, Any]] = []
    bad_examples: list[str] = []
    bad_count = fim_count = 0
    written = 0
    t0 = time.perf_counter()
    scan_s = t0 - t_scan
    new_tokens = 0
    # spawned, not forked: a fork copies whatever locks other threads of the caller hold (a test process, a
    # notebook), and a worker can then hang on one at exit
    pool = multiprocessing.get_context("spawn").Pool(args.workers, _init_worker, (setup,)) if args.workers > 1 else None
    if pool is None:
        _init_worker(setup)
    bar = tqdm(total=len(refs), unit="doc", disable=args.no_progress, desc="tokenizing", file=sys.stderr)
    try:
        for k, members in enumerate(shards):
            if limit is not None and written >= limit:
                break
            done = finished_shard(out, k, dtype)
            if done is not None:
                records.append(done)
                written += done["tokens"]
                bad_count += done["bad_lines"]
                bar.update(len(members))
                continue
            writer = ShardWriter(out, k, dtype)
            shard_bad = 0
            try:
                chunks = [refs[members[i:i + CHUNK_DOCS]] for i in range(0, len(members), CHUNK_DOCS)]
                results = pool.imap(tokenize_chunk, chunks) if pool is not None else map(tokenize_chunk, chunks)
                for chunk, (tokens, lengths, bad, fim_docs) in zip(chunks, results):
                    shard_bad += len(bad)
                    fim_count += fim_docs
                    bad_examples += bad[:max(0, BAD_EXAMPLES - len(bad_examples))]
                    if limit is not None and written + len(tokens) > limit:  # the cut: exactly `limit` tokens
                        keep = limit - written
                        ends = np.cumsum(lengths)
                        lengths = np.append(lengths[ends < keep], keep - (ends[ends < keep][-1:].sum()))
                        lengths = lengths[lengths > 0]
                        tokens = tokens[:keep]
                    writer.append(tokens, lengths)
                    written += len(tokens)
                    new_tokens += len(tokens)
                    bar.update(len(chunk))
                    bar.set_postfix(tokens=written, refresh=False)
                    if limit is not None and written >= limit:
                        break
            except BaseException:
                writer.abort()
                raise
            records.append(writer.finish(shard_bad))
            bad_count += shard_bad
    except ValueError:  # --strict and a bad line: a refused run leaves nothing (a resumed one its earlier shards)
        if fresh:
            discard(out, created)
        raise
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    elapsed = time.perf_counter() - t0
    if not any(r["tokens"] for r in records):
        discard(out, created)
        example = f"; {bad_count} bad JSONL lines, e.g. {bad_examples[0]}" if bad_examples else ""
        raise ValueError(f"--input {' '.join(args.input)}: 0 tokens produced from {len(refs)} documents{example} "
                         "(nothing was written)")
    for extra in range(len(records), num_shards):  # shards past a --max-tokens cut (from no run of this plan)
        (out / f"{shard_name(extra)}.json").unlink(missing_ok=True)
    manifest = {
        "format": PREPARED_FORMAT, "dtype": dtype.name,
        "tokenizer": {"spec": args.tokenizer, "hash": tok_hash, "vocab_size": tokenizer.vocab_size, "eod_id": eod},
        "text_field": args.text_field, "seed": args.seed, "max_tokens": limit,
        "total_tokens": int(sum(r["tokens"] for r in records)),
        "total_documents": int(sum(r["documents"] for r in records)),
        "shards": records,
        "sources": [{"path": str(s.path), "kind": s.kind, "bytes": s.bytes, "sha256": s.sha256,
                     "documents": s.documents} for s in sources],
        "bad_lines": {"count": bad_count, "examples": bad_examples},
        "fim": {"rate": args.fim_rate, "mode": args.fim_mode, "token_ids": list(fim), "documents_this_run": fim_count},
        "throughput": {"workers": args.workers, "seconds": round(elapsed, 3), "scan_seconds": round(scan_s, 3),
                       "tokens_this_run": new_tokens,
                       "tokens_per_s_per_worker": round(new_tokens / max(elapsed, 1e-9) / args.workers, 1)},
    }
    _atomic_write(out / MANIFEST_FILE, json.dumps(manifest, indent=1).encode())
    return manifest


def discard(out: Path, created: Path | None) -> None:
    """Remove what this run wrote to ``out``: the folders it created, else its plan and shard files."""
    if created is not None:
        shutil.rmtree(created, ignore_errors=True)
        return
    for path in [out / PLAN_FILE, *out.glob("shard_*")]:
        path.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        m = prepare(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT
    bad = m["bad_lines"]
    print(f"{m['total_tokens']} tokens ({m['dtype']}) in {m['total_documents']} documents, {len(m['shards'])} shards "
          f"-> {args.out}  [{m['throughput']['tokens_per_s_per_worker']:.0f} tokens/s per worker]")
    if bad["count"]:
        print(f"warning: {bad['count']} bad JSONL lines skipped (listed in {MANIFEST_FILE}), e.g. "
              f"{bad['examples'][0]}", file=sys.stderr)
    print(f"train on it with: --set data.source={args.out} --set data.tokenizer={args.tokenizer}")
    return OK


if __name__ == "__main__":
    sys.exit(main())
