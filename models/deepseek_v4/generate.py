"""Text generation with DeepSeek-V4, recomputing the whole prefix at every step.

Plain and exact (each step is the training forward of the sequence so far), at quadratic cost; V4's
compressed KV cache and FlashMLA's V4 decode layout are a later step.
"""

from __future__ import annotations

import torch

from models.deepseek_v3.generate import check_generate_args, sampling_loop
from models.deepseek_v4.model import Transformer


@torch.no_grad()
def generate(model: Transformer, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, eos_id: int | None = None, generator: torch.Generator | None = None
             ) -> torch.Tensor:
    """Extend ``prompt [b, s]`` by up to ``max_new_tokens`` tokens (greedy when ``temperature`` is 0); V3's
    arguments, checks, sampling and stopping rule (``models.deepseek_v3.generate.sampling_loop``): returns
    ``[b, s + n]``, stopping once every sequence has produced ``eos_id``."""
    check_generate_args(prompt, max_new_tokens, temperature, top_k)
    model.eval()
    return sampling_loop(lambda out: model.final(model.hidden(out)[:, -1:])[:, -1], prompt, max_new_tokens,
                         temperature, top_k, eos_id, generator)
