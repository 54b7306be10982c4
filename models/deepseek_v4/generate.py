"""Text generation with DeepSeek-V4, recomputing the whole prefix at every step.

Plain and exact (each step is the training forward of the sequence so far), at quadratic cost; V4's
compressed KV cache and FlashMLA's V4 decode layout are a later step.
"""

from __future__ import annotations

import torch

from models.deepseek_v4.model import Transformer


@torch.no_grad()
def generate(model: Transformer, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, eos_id: int | None = None, generator: torch.Generator | None = None
             ) -> torch.Tensor:
    """Extend ``prompt [b, s]`` by up to ``max_new_tokens`` tokens (greedy when ``temperature`` is 0); the same
    signature and stopping rule as V3's ``generate``: returns ``[b, s + n]``, stopping once every sequence has
    produced ``eos_id``."""
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise ValueError(f"generate: prompt must be a non-empty [batch, seq] tensor, got {tuple(prompt.shape)}")
    if temperature < 0 or max_new_tokens < 0:
        raise ValueError(f"generate: temperature and max_new_tokens must be >= 0, got {temperature}, {max_new_tokens}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"generate: top_k must be >= 1 (None: the whole vocabulary), got {top_k}")
    model.eval()
    out = prompt
    done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    for _ in range(max_new_tokens):
        logits = model.final(model.hidden(out)[:, -1:])[:, -1].float()
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
