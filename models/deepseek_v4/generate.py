"""Text generation with DeepSeek-V4: by recomputing the whole prefix at every step (``cache=None``: each step
is the training forward of the sequence so far, at quadratic cost), or incrementally from a KV cache
(``models.deepseek_v4.decode``): ``cache="plain"`` keeps the rows in the model's dtype, ``cache="fp8"`` in
FlashMLA's V4 FP8 layout (584 bytes a row) read by ``flash_mla.sparse_sink_decode``.
"""

from __future__ import annotations

import torch

from models.deepseek_v4.decode import V4Decoder
from models.deepseek_v4.model import Transformer

CACHES = (None, "plain", "fp8")


@torch.no_grad()
def generate(model: Transformer, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, eos_id: int | None = None, generator: torch.Generator | None = None,
             cache: str | None = None) -> torch.Tensor:
    """Extend ``prompt [b, s]`` by up to ``max_new_tokens`` tokens (greedy when ``temperature`` is 0); the same
    signature and stopping rule as V3's ``generate``: returns ``[b, s + n]``, stopping once every sequence has
    produced ``eos_id``. ``cache``: None (recompute), ``"plain"`` or ``"fp8"`` (module docstring)."""
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise ValueError(f"generate: prompt must be a non-empty [batch, seq] tensor, got {tuple(prompt.shape)}")
    if temperature < 0 or max_new_tokens < 0:
        raise ValueError(f"generate: temperature and max_new_tokens must be >= 0, got {temperature}, {max_new_tokens}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"generate: top_k must be >= 1 (None: the whole vocabulary), got {top_k}")
    if cache not in CACHES:
        raise ValueError(f"generate: cache must be one of None, 'plain', 'fp8', got {cache!r}")
    model.eval()
    decoder = None
    if cache is not None:
        decoder = V4Decoder(model, prompt.shape[0], prompt.shape[1] + max_new_tokens, fp8=cache == "fp8")
        for t in range(prompt.shape[1] - 1):  # prefill, one token at a time: the same step as decoding
            decoder.step(prompt[:, t])
    out = prompt
    done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    for _ in range(max_new_tokens):
        if decoder is None:
            logits = model.final(model.hidden(out)[:, -1:])[:, -1].float()
        else:
            logits = decoder.step(out[:, -1]).float()
        nxt = sample(logits, temperature, top_k, generator)
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
