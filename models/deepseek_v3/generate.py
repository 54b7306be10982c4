"""Generation with the MLA latent KV cache (absorbed attention through ``flash_mla.flash_mla_with_kvcache``).

The cache holds, per layer, 576 values per token (``kv_lora_rank`` latent + ``qk_rope_head_dim``
RoPE key) in FlashMLA's paged layout: ``[num_blocks, 64, 1, 576]`` pages addressed through a
``block_table [batch, max_blocks]``. Every sequence in a batch advances in lockstep (same length).
A DeepSeek-V3.2 model (sparse attention) also caches each layer's lightning-indexer keys; its new queries
score every cached key and attend to their top-k cached latents through FlashMLA's sparse decoding
(``MLA._attend_indexed_cache``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import flash_mla
from models.deepseek_v3.model import Transformer

BLOCK_SIZE = 64  # FlashMLA's page size


class LatentKVCache:
    """Paged latent cache for ``n_layers`` (+ MTP) layers of ``batch`` sequences up to ``max_len`` tokens."""

    def __init__(self, model: Transformer, batch: int, max_len: int, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, block_table: torch.Tensor | None = None):
        args = model.args
        if max_len > args.max_seq_len:
            raise ValueError(f"LatentKVCache: max_len={max_len} exceeds the model's max_seq_len={args.max_seq_len}")
        device = device if device is not None else model.embed.weight.device
        dtype = dtype or model.embed.weight.dtype
        self.batch, self.max_len, self.width = batch, max_len, args.kv_lora_rank + args.qk_rope_head_dim
        blocks_per_seq = -(-max_len // BLOCK_SIZE)
        if block_table is None:
            block_table = torch.arange(batch * blocks_per_seq, dtype=torch.int32, device=device).view(batch, -1)
        if block_table.shape != (batch, blocks_per_seq) or block_table.dtype != torch.int32:
            raise ValueError(f"LatentKVCache: block_table must be int32 [{batch}, {blocks_per_seq}], got "
                             f"{block_table.dtype} {tuple(block_table.shape)}")
        self.block_table = block_table
        num_blocks = int(block_table.max()) + 1
        self.k_cache = {layer: torch.zeros(num_blocks, BLOCK_SIZE, 1, self.width, dtype=dtype, device=device)
                        for layer in range(args.n_layers)}
        # DeepSeek-V3.2: each layer's lightning-indexer keys (index_head_dim per token), scored by every new query
        self.index_k = {layer: torch.zeros(batch, max_len, args.index_head_dim, dtype=dtype, device=device)
                        for layer in range(args.n_layers)} if args.sparse else {}
        self._step: dict | None = None

    def write(self, layer_id: int, start_pos: int, latent: torch.Tensor) -> None:
        """Store ``latent [batch, s, 576]`` at positions ``start_pos .. start_pos + s`` of every sequence."""
        b, s, _ = latent.shape
        if start_pos + s > self.max_len:
            raise ValueError(f"LatentKVCache: positions up to {start_pos + s} exceed max_len={self.max_len}")
        pos = torch.arange(start_pos, start_pos + s, device=latent.device)
        pages = self.block_table[:, pos // BLOCK_SIZE].long()  # [b, s]
        self.k_cache[layer_id][pages, pos % BLOCK_SIZE, 0] = latent.to(self.k_cache[layer_id].dtype)

    def slots(self, positions: torch.Tensor) -> torch.Tensor:
        """Token positions ``[batch, ...]`` (-1 = none) as cache slots ``page * 64 + offset``, FlashMLA's sparse
        decoding ``indices`` (-1 kept)."""
        pos = positions.clamp_min(0).long()
        pages = self.block_table.gather(1, (pos // BLOCK_SIZE).flatten(1)).view_as(pos)
        return torch.where(positions >= 0, pages * BLOCK_SIZE + pos % BLOCK_SIZE, -1).to(torch.int32)

    def index_keys(self, layer_id: int, start_pos: int, keys: torch.Tensor) -> torch.Tensor:
        """Store the indexer keys ``[batch, s, index_head_dim]`` at ``start_pos..``; return all ``start_pos + s``."""
        end = start_pos + keys.shape[1]
        if end > self.max_len:
            raise ValueError(f"LatentKVCache: positions up to {end} exceed max_len={self.max_len}")
        self.index_k[layer_id][:, start_pos:end] = keys.to(self.index_k[layer_id].dtype)
        return self.index_k[layer_id][:, :end]

    def begin_step(self, start_pos: int, num_tokens: int, num_heads: int) -> None:
        """Plan one step of ``num_tokens`` new tokens at ``start_pos`` (FlashMLA's once-per-step metadata)."""
        if start_pos + num_tokens > self.max_len:
            raise ValueError(f"LatentKVCache: positions up to {start_pos + num_tokens} exceed max_len={self.max_len}")
        seqlens = torch.full((self.batch,), start_pos + num_tokens, dtype=torch.int32, device=self.block_table.device)
        meta, splits = flash_mla.get_mla_metadata(seqlens, num_tokens * num_heads, 1)
        self._step = dict(cache_seqlens=seqlens, tile_scheduler_metadata=meta, num_splits=splits)

    def attention_args(self, layer_id: int) -> dict:
        """Keyword arguments for ``flash_mla_with_kvcache`` (after ``begin_step``)."""
        if self._step is None:
            raise RuntimeError("LatentKVCache.attention_args before begin_step")
        return dict(k_cache=self.k_cache[layer_id], block_table=self.block_table, **self._step)


@torch.no_grad()  # not inference_mode: flash_mla checks plan tensors by version counter
def forward_cached(model: Transformer, tokens: torch.Tensor, cache: LatentKVCache, start_pos: int) -> torch.Tensor:
    """Logits for ``tokens [b, s]`` at positions ``start_pos..``, appending them to ``cache``."""
    cache.begin_step(start_pos, tokens.shape[1], model.args.n_heads)
    return model(tokens, start_pos=start_pos, cache=cache)


@torch.no_grad()  # not inference_mode: flash_mla checks plan tensors by version counter
def generate(model: Transformer, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, eos_id: int | None = None, generator: torch.Generator | None = None
             ) -> torch.Tensor:
    """Extend ``prompt [b, s]`` by up to ``max_new_tokens`` tokens (greedy when ``temperature`` is 0).

    Returns ``[b, s + n]``; stops early once every sequence has produced ``eos_id``.
    """
    check_generate_args(prompt, max_new_tokens, temperature, top_k)
    model.eval()
    b, s = prompt.shape
    cache = LatentKVCache(model, b, s + max_new_tokens)

    def next_logits(out: torch.Tensor) -> torch.Tensor:  # the prompt first, then one new token at a time
        start = 0 if out.shape[1] == s else out.shape[1] - 1
        return forward_cached(model, out[:, start:], cache, start)[:, -1]

    return sampling_loop(next_logits, prompt, max_new_tokens, temperature, top_k, eos_id, generator)


def check_generate_args(prompt: torch.Tensor, max_new_tokens: int, temperature: float, top_k: int | None) -> None:
    """ValueError naming the argument ``generate`` (V3's and V4's) cannot use."""
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise ValueError(f"generate: prompt must be a non-empty [batch, seq] tensor, got {tuple(prompt.shape)}")
    if temperature < 0 or max_new_tokens < 0:
        raise ValueError(f"generate: temperature and max_new_tokens must be >= 0, got {temperature}, {max_new_tokens}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"generate: top_k must be >= 1 (None: the whole vocabulary), got {top_k}")


def sampling_loop(next_logits: Callable[[torch.Tensor], torch.Tensor], prompt: torch.Tensor, max_new_tokens: int,
                  temperature: float, top_k: int | None, eos_id: int | None, generator: torch.Generator | None
                  ) -> torch.Tensor:
    """The decode loop V3's and V4's ``generate`` share: ``next_logits(tokens so far) -> [b, vocab]`` for each new
    token, sampled (``sample``); a sequence that produced ``eos_id`` repeats it, the loop stops once all have."""
    out = prompt
    done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    for _ in range(max_new_tokens):
        nxt = sample(next_logits(out).float(), temperature, top_k, generator)
        if eos_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
            done |= nxt == eos_id
        out = torch.cat([out, nxt[:, None]], dim=1)
        if bool(done.all()):
            break
    return out


def sample(logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
           ) -> torch.Tensor:
    """Greedy at temperature 0, else a draw from ``softmax(logits / temperature)`` over the top-k."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(1)
