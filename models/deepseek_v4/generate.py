"""Text generation with DeepSeek-V4: by recomputing the whole prefix at every step (``cache=None``: each step
is the training forward of the sequence so far, at quadratic cost), or incrementally from a KV cache
(``models.deepseek_v4.decode``): ``cache="plain"`` keeps the rows in the model's dtype, ``cache="fp8"`` in
FlashMLA's V4 FP8 layout (584 bytes a row) read by ``flash_mla.sparse_sink_decode``.
"""

from __future__ import annotations

import torch

from models.deepseek_v3.generate import check_generate_args, sampling_loop
from models.deepseek_v4.decode import V4Decoder
from models.deepseek_v4.model import Transformer

CACHES = (None, "plain", "fp8")


@torch.no_grad()
def generate(model: Transformer, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, eos_id: int | None = None, generator: torch.Generator | None = None,
             cache: str | None = None) -> torch.Tensor:
    """Extend ``prompt [b, s]`` by up to ``max_new_tokens`` tokens (greedy when ``temperature`` is 0); V3's
    arguments, checks, sampling and stopping rule (``models.deepseek_v3.generate.sampling_loop``): returns
    ``[b, s + n]``, stopping once every sequence has produced ``eos_id``. ``cache``: None (each step recomputes
    the whole prefix), ``"plain"`` or ``"fp8"`` (a KV cache; module docstring)."""
    check_generate_args(prompt, max_new_tokens, temperature, top_k)
    if cache not in CACHES:
        raise ValueError(f"generate: cache must be one of None, 'plain', 'fp8', got {cache!r}")
    model.eval()
    if cache is None:
        def next_logits(out: torch.Tensor) -> torch.Tensor:
            return model.final(model.hidden(out)[:, -1:])[:, -1]
    else:
        decoder = V4Decoder(model, prompt.shape[0], prompt.shape[1] + max_new_tokens, fp8=cache == "fp8")
        for t in range(prompt.shape[1] - 1):  # prefill, one token at a time: the same step as decoding
            decoder.step(prompt[:, t])

        def next_logits(out: torch.Tensor) -> torch.Tensor:
            return decoder.step(out[:, -1])
    return sampling_loop(next_logits, prompt, max_new_tokens, temperature, top_k, eos_id, generator)
