"""The DeepSeek-V3 Transformer: embedding, ``n_layers`` Blocks (MLA + dense FFN or MoE), norm, head, MTP.

Pipeline stages are built from the same pieces the full forward uses, so a stage computes exactly
what the whole model would: ``embed_tokens`` -> ``run_layers(h, start, end)`` -> ``final`` (and
``mtp_logits`` on the last stage). Build on the ``meta`` device and materialise only what a rank
holds (``materialize``), then load it with ``load_hf_checkpoint`` or ``init_weights``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fused_ce import linear_cross_entropy
from models.deepseek_v3.args import ModelArgs
from models.deepseek_v3.block import Block, LayerWrap, call
from models.deepseek_v3.layers import Linear, RMSNorm
from models.deepseek_v3.mla import LatentCache
from models.deepseek_v3.moe import Experts, Gate
from models.deepseek_v3.mtp import MTPModule, mtp_hidden, mtp_logits
from models.deepseek_v3.rope import rope_cos_sin

__all__ = ["Block", "Transformer", "lm_losses", "lm_losses_from_hidden"]


class Transformer(nn.Module):
    """DeepSeek-V3 causal LM. ``forward(tokens)`` -> logits ``[batch, seq, vocab]``.

    ``expert_ids`` (a contiguous range) builds only those routed experts in every MoE layer, for an
    expert-parallel rank. Submodules: ``embed``, ``layers`` (index = global layer id), ``norm``,
    ``head``, ``mtp`` (one ``MTPModule`` per depth).
    """

    def __init__(self, args: ModelArgs, expert_ids: range | None = None):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args, i, expert_ids) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps, args.fused_ops)
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.head.weight = self.embed.weight
        self.mtp = nn.ModuleList(MTPModule(args, k, expert_ids) for k in range(args.n_mtp_layers))
        if not self.embed.weight.is_meta:
            self.init_weights()

    # ---- pipeline pieces --------------------------------------------------------------------------
    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"tokens must be an integer [batch, seq] tensor, got {tokens.dtype} {tuple(tokens.shape)}")
        return self.embed(tokens)

    def run_layers(self, h: torch.Tensor, start: int = 0, end: int | None = None, start_pos: int = 0,
                   cache: LatentCache | None = None, wrap: LayerWrap | None = None) -> torch.Tensor:
        """Run layers ``start .. end`` (global ids) on hidden states ``h [b, s, dim]``, each as ``wrap`` runs it."""
        end = self.args.n_layers if end is None else end
        if not 0 <= start <= end <= self.args.n_layers:
            raise ValueError(f"run_layers: need 0 <= start <= end <= n_layers={self.args.n_layers}, got {start}, {end}")
        return run_layers(self.args, self.layers[start:end], h, start_pos, cache, wrap)

    def final(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and output head: logits ``[b, s, vocab]``."""
        return self.head(self.norm(h))

    def mtp_logits(self, h: torch.Tensor, tokens: torch.Tensor) -> list[torch.Tensor]:
        """MTP logits per depth k = 1..D from the main model's last hidden state ``h`` (before ``norm``).

        Depth k's logits ``[b, s - k, vocab]`` at position i predict ``tokens[i + k + 1]``.
        """
        return mtp_logits(self.args, self.mtp, self.embed, self.head, h, tokens)

    # ---- whole model ------------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, start_pos: int = 0, cache: LatentCache | None = None,
                return_mtp: bool = False) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Logits ``[b, s, vocab]``; with ``return_mtp`` also the MTP logits list (see ``mtp_logits``).

        With a ``cache`` (generation), the tokens sit at ``start_pos..`` and attention is absorbed.
        """
        h = self.run_layers(self.embed_tokens(tokens), start_pos=start_pos, cache=cache)
        logits = self.final(h)
        if return_mtp:
            return logits, self.mtp_logits(h, tokens)
        return logits

    def forward_with_mtp(self, tokens: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self.forward(tokens, return_mtp=True)

    # ---- weights ----------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, module: nn.Module | None = None) -> None:
        """Initialise ``module`` (default: the whole model) as the V3 report: normal(0, init_std), norms 1."""
        std = self.args.init_std
        for m in (module or self).modules():
            if isinstance(m, (Linear, nn.Linear, nn.Embedding)) and not m.weight.is_meta:
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, nn.LayerNorm) and not m.weight.is_meta:  # the indexer's k_norm: weight 1, bias 0
                m.reset_parameters()
            elif isinstance(m, (RMSNorm, Gate, Experts)) and not next(m.parameters()).is_meta:
                m.reset_parameters(std) if not isinstance(m, RMSNorm) else m.reset_parameters()

    def materialize(self, modules: Iterable[nn.Module], device: torch.device | str, init: bool = True) -> None:
        """Allocate the given (meta) submodules on ``device`` and, with ``init``, initialise them."""
        for m in modules:
            m.to_empty(device=device)
            if init:
                self.init_weights(m)


def lm_losses(args: ModelArgs, logits: torch.Tensor, mtp_logits: list[torch.Tensor], labels: torch.Tensor,
              ignore_index: int = -100) -> dict[str, torch.Tensor | list[torch.Tensor]]:
    """Next-token cross-entropy and the MTP losses, and ``total = main + lambda / D * sum(mtp)``.

    ``labels[:, i]`` is the target of position i (``tokens[:, 1:]`` for the model run on
    ``tokens[:, :-1]``, or shifted with padding); depth k's targets are ``labels[:, k:]``. Logits longer
    than their targets are cut to them. Computed in fp32; MTP losses are reported separately.
    ``lm_losses_from_hidden`` computes the same without materialising the logits (training uses it).
    """
    n = labels.shape[1]
    main = F.cross_entropy(logits[:, :n].flatten(0, 1).float(), labels.flatten(), ignore_index=ignore_index)
    mtp = [F.cross_entropy(lg[:, : n - k].flatten(0, 1).float(), labels[:, k:].flatten(), ignore_index=ignore_index)
           for k, lg in enumerate(mtp_logits, start=1) if n > k]
    return _with_total(args, main, mtp)


def _with_total(args: ModelArgs, main: torch.Tensor, mtp: list[torch.Tensor]) -> dict:
    total = main + args.mtp_loss_weight / len(mtp) * torch.stack(mtp).sum() if mtp else main
    return {"loss": total, "main": main, "mtp": mtp}


def head_loss(norm: RMSNorm, head: nn.Linear, h: torch.Tensor, targets: torch.Tensor,
              ignore_index: int = -100) -> torch.Tensor:
    """``cross_entropy(head(norm(h)).float(), targets)`` through ``fused_ce.linear_cross_entropy``: the logits
    are made a chunk of rows at a time and never kept."""
    return linear_cross_entropy(norm(h), head.weight, targets, ignore_index)


def head_losses(args: ModelArgs, norm: RMSNorm, head: nn.Linear, mtp: Sequence[MTPModule], h: torch.Tensor,
                hidden: Sequence[torch.Tensor], labels: torch.Tensor, ignore_index: int = -100,
                positions: torch.Tensor | None = None) -> dict:
    """``lm_losses`` from the last hidden state ``h`` and the MTP depths' ``hidden`` states (before their norms),
    through the fused head (``head_loss``).

    ``positions`` (context parallelism): ``h``'s rows are these global positions of sequences whose whole
    ``labels`` are given; each loss is then this rank's share, its local mean weighted by local / global target
    count, so the shares of the CP group sum to the one-process loss."""
    n = labels.shape[1]
    if positions is None:
        main = head_loss(norm, head, h[:, :n], labels, ignore_index)
        losses = [head_loss(module.norm, head, hk[:, : n - k], labels[:, k:], ignore_index)
                  for k, (module, hk) in enumerate(zip(mtp, hidden), start=1) if n > k]
        return _with_total(args, main, losses)

    def share(module_norm: RMSNorm, hk: torch.Tensor, k: int) -> torch.Tensor:
        rows = hk.shape[1]  # depth k keeps the local rows before global position n - k (a prefix)
        local = head_loss(module_norm, head, hk, labels[:, positions[:rows] + k], ignore_index)
        return local * (rows / (n - k))

    main = share(norm, h, 0)
    losses = [share(module.norm, hk, k) for k, (module, hk) in enumerate(zip(mtp, hidden), start=1) if n > k]
    return _with_total(args, main, losses)


def lm_losses_from_hidden(args: ModelArgs, norm: RMSNorm, head: nn.Linear, mtp: Sequence[MTPModule],
                          embed: nn.Module, h: torch.Tensor, tokens: torch.Tensor, labels: torch.Tensor,
                          ignore_index: int = -100, wrap: LayerWrap | None = None,
                          positions: torch.Tensor | None = None) -> dict[str, torch.Tensor | list[torch.Tensor]]:
    """``lm_losses`` of the logits ``head(norm(h))`` and ``mtp_logits(...)``, from the last hidden state ``h``
    (before the final norm) and the model's modules, without ever holding ``[tokens, vocab]`` logits. ``wrap``:
    how the MTP blocks run (``run_layers``). ``positions``: ``h``'s rows are these global positions of the whole
    ``tokens`` / ``labels`` (context parallelism; see ``head_losses``)."""
    hidden = mtp_hidden(args, mtp, embed, h, tokens, wrap, positions)
    return head_losses(args, norm, head, mtp, h, hidden, labels, ignore_index, positions)


def run_layers(args: ModelArgs, layers: Iterable[Block], h: torch.Tensor, start_pos: int = 0,
               cache: LatentCache | None = None, wrap: LayerWrap | None = None,
               positions: torch.Tensor | None = None) -> torch.Tensor:
    """The layer loop: ``layers`` in order on hidden states ``h [b, s, dim]`` at positions ``start_pos..``
    (the whole model's, and a pipeline stage's slice of it); each layer's output is the next one's input.
    ``wrap``: how each layer runs (the memory policy's whole-block recompute, ``block.LayerWrap``); none with a
    ``cache`` (generation: a replayed forward would write the cache twice). ``positions``: the rows' global
    positions instead (context parallelism: a rank's chunks of the sequence)."""
    s = h.shape[1]
    if positions is None:
        if start_pos + s > args.max_seq_len:
            raise ValueError(f"positions up to {start_pos + s} exceed max_seq_len={args.max_seq_len}")
        positions = torch.arange(start_pos, start_pos + s, device=h.device)
    cos, sin = rope_cos_sin(args, positions)
    for layer in layers:
        h = call(layer, wrap if cache is None else None)(h, cos, sin, cache, start_pos)
    return h
