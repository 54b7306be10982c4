"""Training data: tokenizers, token shards, sequence packing, and a resumable rank-aware sampler.

Sources (``data.source``): ``"bundled"`` (the corpus shipped in ``recipes/data``), a plain text
file, a pre-tokenized ``.bin`` (raw memmap, element type ``data.bin_dtype``) or ``.npy`` shard, or a
folder / glob of them. Text is tokenized with the byte-level tokenizer (vocabulary 256, the
default: any text, no files) or a Hugging Face ``tokenizers`` ``tokenizer.json``. Shards are read
through ``numpy`` memmaps, so a corpus larger than memory costs nothing until a window is read.

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
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from training.config import DataConfig

BUNDLED_CORPUS = Path(__file__).resolve().parent.parent / "recipes" / "data" / "python_reference.txt"
TEXT_SUFFIXES = (".txt", ".md", ".text")
SHARD_SUFFIXES = (".bin", ".npy")


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, lossless, no files; a fresh model starts at ln 256 = 5.55."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer read from a ``tokenizer.json`` file."""

    def __init__(self, path: str | Path):
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError as exc:  # pragma: no cover - tokenizers ships with transformers
            raise ValueError("data.tokenizer: a tokenizer.json needs the 'tokenizers' package (pip install "
                             "tokenizers)") from exc
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"data.tokenizer: no tokenizer file at {str(path)!r} "
                             "(expected 'byte' or a tokenizer.json)")
        self._tok = _Tokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids])


def build_tokenizer(spec: str) -> Tokenizer:
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec)


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
    if path.suffix == ".bin":
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


@dataclass
class TokenCorpus:
    """Token shards cut into packed windows of ``seq_len + 1`` tokens, split into train and valid."""

    shards: list[np.ndarray]
    seq_len: int
    vocab_size: int
    valid_fraction: float = 0.0

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
    shards = [load_shard(f, tokenizer, cfg.bin_dtype) for f in resolve_source(cfg.source)]
    corpus = TokenCorpus(shards, cfg.seq_len, tokenizer.vocab_size, cfg.valid_fraction)
    if corpus.num_train < min_windows:
        raise ValueError(f"data.source {cfg.source!r}: {corpus.num_tokens} tokens make {corpus.num_train} training "
                         f"windows of data.seq_len+1 = {cfg.seq_len + 1} tokens, fewer than one global batch "
                         f"(data.global_batch={min_windows}); use more data or a smaller seq_len / global_batch")
    return corpus


def check_vocab(corpus: TokenCorpus, vocab_size: int) -> None:
    """ValueError if any token id is >= the model's vocabulary (checked on every shard's maximum)."""
    for i, s in enumerate(corpus.shards):
        if len(s) and int(np.max(s)) >= vocab_size:
            raise ValueError(f"data.source shard {i} holds token id {int(np.max(s))} >= the model's vocab_size "
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
