"""Training data: tokenizers, token shards, sequence packing, and a resumable rank-aware sampler.

Sources (``data.source``): ``"bundled"`` (the corpus shipped in ``recipes/data``), a plain text
file, a pre-tokenized ``.bin`` (raw memmap, element type ``data.bin_dtype``; with a sibling ``.idx``
it is Megatron-LM's indexed dataset and the index gives the type) or ``.npy`` shard, a folder / glob
of them, or a folder written by ``python -m recipes.prepare_data`` (it holds ``manifest.json``: the
shards' type, token counts and sha256, and the tokenizer's hash, checked against ``data.tokenizer``).
Text is tokenized with the byte-level tokenizer (vocabulary 256, the default: any text, no files) or a
Hugging Face ``tokenizers`` ``tokenizer.json``. Shards are read through ``numpy`` memmaps, so a corpus
larger than memory costs nothing until a window is read.

Packing: each file is one token stream, cut into windows of ``seq_len + 1`` tokens that overlap
by one (inputs are ``w[:-1]``, labels ``w[1:]``), so no token is padding and windows never cross
files. The tail of the
windows is held out for validation.

The sampler walks a seeded permutation of the windows, epoch after epoch; each optimizer step
takes the next ``global_batch`` indices, and data-parallel rank ``r`` reads the ``r``-th contiguous
slice. Its position is two integers (``state_dict()``), saved in checkpoints, so a resumed run
reads exactly the batches it would have read.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import tokenizers
import torch

from training.config import DataConfig

BUNDLED_CORPUS = Path(__file__).resolve().parent.parent / "recipes" / "data" / "python_reference.txt"
TEXT_SUFFIXES = (".txt", ".md", ".text")
SHARD_SUFFIXES = (".bin", ".npy")
MANIFEST_FILE = "manifest.json"  # written last by recipes.prepare_data: its presence means the dataset is complete
PLAN_FILE = "prepare.json"  # written first by recipes.prepare_data: what the folder is being made from
PREPARED_FORMAT = "dsv3-tokens/1"
# Megatron-LM's indexed dataset (megatron/core/datasets/indexed_dataset.py): .idx header and dtype codes
MEGATRON_IDX_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
                   8: np.uint16}


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, lossless, no files; a fresh model starts at ln 256 = 5.55."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer read from a ``tokenizer.json`` file (``option`` names where the
    path came from in errors); a missing or unreadable file is a ValueError naming it."""

    def __init__(self, path: str | Path, option: str = "data.tokenizer"):
        path = Path(path)
        path = tokenizer_file(path)
        if not path.is_file():
            raise ValueError(f"{option}: no tokenizer file at {str(path)!r} "
                             "(expected 'byte' or a tokenizer.json)")
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for a malformed file
            raise ValueError(f"{option}: {str(path)!r} is not a valid tokenizer.json: "
                             f"{' '.join(str(exc).split())}") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids])


def build_tokenizer(spec: str, option: str = "data.tokenizer") -> Tokenizer:
    """``"byte"`` or a ``tokenizer.json`` path (or its folder); ``option`` is what errors call the setting."""
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec, option)


def tokenizer_file(spec: str | Path) -> Path:
    """The ``tokenizer.json`` a ``data.tokenizer`` path names (a folder means its ``tokenizer.json``)."""
    path = Path(spec).expanduser()
    return path / "tokenizer.json" if path.is_dir() else path


def tokenizer_hash(spec: str) -> str:
    """What identifies a tokenizer: ``"byte"``, or ``"sha256:<hex>"`` of the ``tokenizer.json`` bytes."""
    if spec == "byte":
        return "byte"
    path = tokenizer_file(spec)
    if not path.is_file():
        raise ValueError(f"data.tokenizer: no tokenizer file at {str(path)!r} (expected 'byte' or a tokenizer.json)")
    return "sha256:" + sha256_file(path)


def sha256_file(path: Path, chunk: int = 16 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned type that holds every id of a vocabulary (uint16 up to 65536 ids, else uint32)."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def resolve_source(source: str) -> list[Path]:
    """The files a ``data.source`` names, sorted; ValueError if there are none or one is missing."""
    if source == "bundled":
        if not BUNDLED_CORPUS.is_file():
            raise ValueError(f"data.source='bundled' but the bundled corpus {str(BUNDLED_CORPUS)!r} is missing "
                             "(rebuild it with: python -m recipes.data.build_corpus)")
        return [BUNDLED_CORPUS]
    path = Path(source).expanduser()
    if path.is_file():
        files = [path]
    elif path.is_dir():
        if (path / MANIFEST_FILE).is_file() or (path / PLAN_FILE).is_file():
            raise ValueError(f"data.source {source!r} is a prepare_data folder: read it with load_prepared")
        files = sorted(p for p in path.iterdir() if p.suffix in TEXT_SUFFIXES + SHARD_SUFFIXES)
    elif any(ch in source for ch in "*?["):
        files = sorted(Path(p) for p in glob.glob(os.path.expanduser(source)))
    else:
        raise ValueError(f"data.source: no such file or folder {source!r}")
    if not files:
        raise ValueError(f"data.source {source!r} holds no {'/'.join(TEXT_SUFFIXES + SHARD_SUFFIXES)} files")
    for f in files:
        if f.suffix not in TEXT_SUFFIXES + SHARD_SUFFIXES:
            raise ValueError(f"data.source: {str(f)!r} is neither text ({', '.join(TEXT_SUFFIXES)}) nor a token "
                             f"shard ({', '.join(SHARD_SUFFIXES)})")
    return files


def load_shard(path: Path, tokenizer: Tokenizer, bin_dtype: str) -> np.ndarray:
    """One shard as a 1-D integer array (a read-only memmap for .bin/.npy)."""
    if path.suffix == ".bin" and path.with_suffix(".idx").is_file():
        arr = load_megatron(path)
    elif path.suffix == ".bin":
        arr = np.memmap(path, dtype=np.dtype(bin_dtype), mode="r")
    elif path.suffix == ".npy":
        arr = np.load(path, mmap_mode="r")
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"data.source: {str(path)!r} must hold a 1-D integer token array, "
                             f"got shape {arr.shape} dtype {arr.dtype}")
    else:
        text = path.read_text(encoding="utf-8", errors="replace")
        arr = np.asarray(tokenizer.encode(text), dtype=np.int64)
    return arr


def read_megatron_index(idx_path: Path) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray]:
    """(token dtype, sequence lengths, sequence byte offsets, document start indices) of a Megatron ``.idx``.

    Layout (little-endian): 9-byte magic, u64 version 1, u8 dtype code, u64 sequence count, u64 document
    count, then int32 lengths, int64 byte offsets into the ``.bin``, int64 document boundaries.
    """
    raw = idx_path.read_bytes()
    head = len(MEGATRON_IDX_MAGIC) + 8 + 1 + 8 + 8
    if len(raw) < head or raw[:len(MEGATRON_IDX_MAGIC)] != MEGATRON_IDX_MAGIC:
        raise ValueError(f"data.source: {str(idx_path)!r} is not a Megatron-LM indexed-dataset index "
                         f"(expected the header {MEGATRON_IDX_MAGIC!r})")
    off = len(MEGATRON_IDX_MAGIC)
    version, code, n_seq, n_doc = (int(np.frombuffer(raw, np.uint64, 1, off)[0]), raw[off + 8],
                                   *(int(x) for x in np.frombuffer(raw, np.uint64, 2, off + 9)))
    if version != 1 or code not in MEGATRON_DTYPES or not np.issubdtype(MEGATRON_DTYPES[code], np.integer):
        raise ValueError(f"data.source: {str(idx_path)!r} has index version {version} and dtype code {code}; "
                         "expected version 1 and an integer token type")
    need = head + 4 * n_seq + 8 * n_seq + 8 * n_doc
    if len(raw) < need:
        raise ValueError(f"data.source: {str(idx_path)!r} is truncated ({len(raw)} bytes, its header promises "
                         f"{n_seq} sequences and {n_doc} document entries = {need} bytes)")
    lengths = np.frombuffer(raw, np.int32, n_seq, head)
    pointers = np.frombuffer(raw, np.int64, n_seq, head + 4 * n_seq)
    docs = np.frombuffer(raw, np.int64, n_doc, head + 12 * n_seq)
    return np.dtype(MEGATRON_DTYPES[code]), lengths, pointers, docs


def load_megatron(bin_path: Path) -> np.ndarray:
    """A Megatron-LM ``.bin`` as one token stream (its sequences back to back, as preprocess_data.py wrote
    them), typed by the sibling ``.idx``; ValueError if the two disagree (a truncated or foreign file)."""
    dtype, lengths, pointers, _ = read_megatron_index(bin_path.with_suffix(".idx"))
    size = bin_path.stat().st_size
    expected = int(lengths.astype(np.int64).sum()) * dtype.itemsize
    contiguous = len(lengths) == 0 or (pointers[0] == 0 and np.array_equal(
        pointers[1:], np.cumsum(lengths[:-1].astype(np.int64)) * dtype.itemsize))
    if size != expected or not contiguous:
        raise ValueError(f"data.source: {str(bin_path)!r} holds {size} bytes but its index describes {len(lengths)} "
                         f"back-to-back sequences of {expected} bytes ({dtype}): the .bin/.idx pair is corrupted")
    return np.memmap(bin_path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of a ``recipes.prepare_data`` folder; ValueError if it is incomplete or not one."""
    path = folder / MANIFEST_FILE
    if not path.is_file():
        raise ValueError(f"data.source {str(folder)!r}: no {MANIFEST_FILE}; the folder is incomplete (prepare_data was "
                         "interrupted: run the same command again to finish it)")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != PREPARED_FORMAT:
        raise ValueError(f"data.source {str(folder)!r}: {MANIFEST_FILE} has format {manifest.get('format')!r}, "
                         f"expected {PREPARED_FORMAT!r}")
    return manifest


def load_prepared(folder: Path, tokenizer_spec: str, verify: bool = True) -> tuple[list[np.ndarray], dict[str, Any]]:
    """The shards of a ``recipes.prepare_data`` folder (memmaps) and its manifest.

    ValueError (naming the file) if ``tokenizer_spec`` is not the tokenizer the shards were made with (by hash),
    or a shard's size, or with ``verify`` its sha256, differs from the manifest's.
    """
    manifest = read_manifest(folder)
    tok = manifest["tokenizer"]
    mine = tokenizer_hash(tokenizer_spec)
    if mine != tok["hash"]:
        raise ValueError(f"data.tokenizer={tokenizer_spec!r} (hash {mine}) is not the tokenizer the shards in "
                         f"{str(folder)!r} were made with ({tok['spec']!r}, hash {tok['hash']}); set data.tokenizer to "
                         "that tokenizer or prepare the corpus again")
    dtype = np.dtype(manifest["dtype"])
    shards = []
    for entry in manifest["shards"]:
        path = folder / entry["file"]
        size = path.stat().st_size if path.is_file() else -1
        if size != entry["tokens"] * dtype.itemsize or (verify and sha256_file(path) != entry["sha256"]):
            what = "is missing" if size < 0 else (f"is {size} bytes, expected {entry['tokens']} {dtype} tokens"
                                                   if size != entry["tokens"] * dtype.itemsize
                                                   else "does not match its sha256 in the manifest")
            raise ValueError(f"data.source: shard {str(path)!r} {what}: it is corrupted; run prepare_data again "
                             "(it rebuilds only the shards it cannot verify after you delete them)")
        shards.append(np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype))
    return shards, manifest


@dataclass
class TokenCorpus:
    """Token shards cut into packed windows of ``seq_len + 1`` tokens, split into train and valid."""

    shards: list[np.ndarray]
    seq_len: int
    vocab_size: int
    valid_fraction: float = 0.0
    max_ids: list[int] | None = None  # each shard's largest id when known (a verified manifest), else computed

    def __post_init__(self) -> None:
        per_shard = [max(0, (len(s) - 1) // self.seq_len) for s in self.shards]
        self._starts = np.cumsum([0] + per_shard)
        total = int(self._starts[-1])
        self.num_valid = int(total * self.valid_fraction) if total > 1 else 0
        self.num_train = total - self.num_valid

    @property
    def num_tokens(self) -> int:
        return int(sum(len(s) for s in self.shards))

    def window(self, index: int) -> torch.Tensor:
        """Global window ``index`` (train windows first, then valid) as int64 ``[seq_len + 1]``."""
        shard = int(np.searchsorted(self._starts, index, side="right")) - 1
        off = (index - int(self._starts[shard])) * self.seq_len
        return torch.from_numpy(np.array(self.shards[shard][off:off + self.seq_len + 1], dtype=np.int64))

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels), each int64 ``[len(indices), seq_len]``."""
        w = torch.stack([self.window(int(i)) for i in indices])
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def valid_batch(self, index: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``index``-th validation batch of ``size`` windows (wrapping around the held-out tail)."""
        if self.num_valid == 0:
            raise ValueError("no validation windows: set data.valid_fraction > 0")
        ids = [self.num_train + (index * size + k) % self.num_valid for k in range(size)]
        return self.batch(ids)


def load_corpus(cfg: DataConfig, tokenizer: Tokenizer | None = None, min_windows: int = 1) -> TokenCorpus:
    """Read ``cfg.source``; ValueError if a file is missing, a token exceeds the vocabulary, or the
    corpus has fewer than ``min_windows`` training windows (pass the largest global batch)."""
    tokenizer = tokenizer or build_tokenizer(cfg.tokenizer)
    folder = Path(cfg.source).expanduser()
    max_ids = None
    if cfg.source != "bundled" and folder.is_dir() and ((folder / MANIFEST_FILE).is_file()
                                                        or (folder / PLAN_FILE).is_file()):
        shards, manifest = load_prepared(folder, cfg.tokenizer)
        max_ids = [entry["max_token"] for entry in manifest["shards"]]
    else:
        shards = [load_shard(f, tokenizer, cfg.bin_dtype) for f in resolve_source(cfg.source)]
    corpus = TokenCorpus(shards, cfg.seq_len, tokenizer.vocab_size, cfg.valid_fraction, max_ids)
    if corpus.num_train < min_windows:
        raise ValueError(f"data.source {cfg.source!r}: {corpus.num_tokens} tokens make {corpus.num_train} training "
                         f"windows of data.seq_len+1 = {cfg.seq_len + 1} tokens, fewer than one global batch "
                         f"(data.global_batch={min_windows}); use more data or a smaller seq_len / global_batch")
    return corpus


def check_vocab(corpus: TokenCorpus, vocab_size: int) -> None:
    """ValueError if the tokenizer's vocabulary is larger than the model's, or any token id is >= the model's
    vocabulary (checked on every shard's maximum)."""
    if corpus.vocab_size > vocab_size:
        raise ValueError(f"data.tokenizer has a vocabulary of {corpus.vocab_size} tokens, larger than the model's "
                         f"vocab_size {vocab_size}; set model.overrides.vocab_size >= {corpus.vocab_size} or use the "
                         "model's tokenizer")
    for i, s in enumerate(corpus.shards):
        top = corpus.max_ids[i] if corpus.max_ids is not None else (int(np.max(s)) if len(s) else -1)
        if top >= vocab_size:
            raise ValueError(f"data.source shard {i} holds token id {top} >= the model's vocab_size "
                             f"{vocab_size}; set model.overrides.vocab_size or use the matching tokenizer")


class ResumableSampler:
    """Seeded epochs of shuffled window indices; each step's global batch split across data-parallel ranks.

    Every rank computes the same permutation from the seed, so no indices travel between ranks.
    ``state_dict()`` is ``{"seed", "epoch", "offset"}``: where the next batch starts.
    """

    def __init__(self, num_samples: int, seed: int, dp_rank: int = 0, dp_size: int = 1):
        if num_samples < 1:
            raise ValueError(f"ResumableSampler: num_samples must be >= 1, got {num_samples}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"ResumableSampler: dp_rank {dp_rank} not in [0, {dp_size})")
        self.num_samples, self.seed, self.dp_rank, self.dp_size = num_samples, seed, dp_rank, dp_size
        self.epoch, self.offset = 0, 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_samples, generator=g)

    def next_global_batch(self, global_batch: int) -> list[int]:
        """The next ``global_batch`` indices (all ranks), advancing the position (crossing epochs as needed)."""
        out: list[int] = []
        while len(out) < global_batch:
            take = min(global_batch - len(out), self.num_samples - self.offset)
            out += self._perm[self.offset:self.offset + take].tolist()
            self.offset += take
            if self.offset == self.num_samples:
                self.epoch, self.offset = self.epoch + 1, 0
                self._perm = self._permutation(self.epoch)
        return out

    def next_batch(self, global_batch: int) -> list[int]:
        """This rank's slice of the next global batch."""
        if global_batch % self.dp_size:
            raise ValueError(f"global batch {global_batch} is not divisible by the data-parallel size {self.dp_size}")
        per_rank = global_batch // self.dp_size
        ids = self.next_global_batch(global_batch)
        return ids[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "epoch": self.epoch, "offset": self.offset, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["num_samples"]) != self.num_samples:
            raise ValueError(f"sampler state is for {state['num_samples']} windows, this corpus has "
                             f"{self.num_samples}: data.source or data.seq_len changed since the checkpoint")
        self.seed, self.epoch, self.offset = int(state["seed"]), int(state["epoch"]), int(state["offset"])
        self._perm = self._permutation(self.epoch)
