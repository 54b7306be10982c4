"""Multi-Token Prediction (MTP) modules: depth k predicts token t+k+1 from depth k-1's hidden state.

For depth k (1-based), position i: ``h_k[i] = Block(eh_proj(cat[enorm(emb(t[i+k])), hnorm(h_{k-1}[i])]))``
and its logits are ``head(norm(h_k[i]))`` with the embedding and output head shared with the main
model (the concatenation order, embedding first, is the released weights'). ``h_0`` is the main
model's last hidden state before the final norm. Each depth is one sequence shorter than the last.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import nn

from models.deepseek_v3.args import ModelArgs
from models.deepseek_v3.block import Block, LayerWrap, call
from models.deepseek_v3.layers import Linear, RMSNorm
from models.deepseek_v3.plan import Compute, Piece, layer_pieces
from models.deepseek_v3.rope import rope_cos_sin


class MTPModule(nn.Module):
    """One MTP depth. ``depth`` is 0-based; its block is layer ``n_layers + depth`` (HF key index)."""

    def __init__(self, args: ModelArgs, depth: int, expert_ids: range | None = None):
        super().__init__()
        self.depth, self.layer_id = depth, args.n_layers + depth
        self.enorm = RMSNorm(args.dim, args.norm_eps, args.fused_ops)
        self.hnorm = RMSNorm(args.dim, args.norm_eps, args.fused_ops)
        self.eh_proj = Linear(2 * args.dim, args.dim)  # a BF16 GEMM even in FP8 training, as V3 (released unquantised)
        self.block = Block(args, self.layer_id, expert_ids)
        self.norm = RMSNorm(args.dim, args.norm_eps, args.fused_ops)  # HF: shared_head.norm

    def project(self, h: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """The block's input: ``eh_proj(cat[enorm(emb), hnorm(h)])``."""
        return self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))

    def forward(self, h: torch.Tensor, emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """h ``[b, n, dim]`` (previous depth, already truncated), emb ``[b, n, dim]`` of the tokens k ahead."""
        return self.block(self.project(h, emb), cos, sin)


def _depths(args: ModelArgs, modules: Sequence[MTPModule], tokens: torch.Tensor,
            positions: torch.Tensor | None = None) -> Iterator[tuple]:
    """``(k, n, module, ahead, cos, sin)`` per depth k = 1..D that has positions left: depth k runs on the first
    ``n`` rows, those before global position ``s - k``, reading the tokens ``ahead [b, n]`` k positions on.

    ``positions`` (context parallelism): the rows' global positions in the whole ``tokens [b, s]``; the shift by
    k is then an index into the whole sequence (the CP-aware roll: a chunk's last rows read tokens of another
    rank's chunk, which every CP rank holds), and the rows dropped are the tail of the rank holding the last
    chunk. Without it the rows are positions ``0..s-1``."""
    s = tokens.shape[1]
    for k, module in enumerate(modules, start=1):
        if positions is None:
            n, pos, ahead = s - k, torch.arange(max(s - k, 0), device=tokens.device), tokens[:, k:]
        else:
            n = int((positions < s - k).sum())
            pos = positions[:n]
            ahead = tokens[:, pos + k]
        if n <= 0:
            return
        yield (k, n, module, ahead, *rope_cos_sin(args, pos))


def mtp_hidden(args: ModelArgs, modules: Sequence[MTPModule], embed: nn.Module, h: torch.Tensor,
               tokens: torch.Tensor, wrap: LayerWrap | None = None, positions: torch.Tensor | None = None
               ) -> list[torch.Tensor]:
    """MTP hidden states per depth k = 1..D (before each depth's ``norm``) from the main model's last
    hidden state ``h`` (before the final norm); depth k's ``[b, s - k, dim]``. Takes the modules
    explicitly so that a pipeline's last stage runs exactly this with the modules it holds. ``wrap``: how each
    depth's block runs (``model.run_layers``). ``positions``: ``h``'s rows' global positions in the whole
    ``tokens`` (context parallelism, see ``_depths``)."""
    out = []
    for _, n, module, ahead, cos, sin in _depths(args, modules, tokens, positions):
        h = call(module.block, wrap)(module.project(h[:, :n], embed(ahead)), cos, sin)
        out.append(h)
    return out


def mtp_pieces(args: ModelArgs, modules: Sequence[MTPModule], embed: nn.Module, tokens: torch.Tensor,
               stream: str = "h", wrap: LayerWrap | None = None, positions: torch.Tensor | None = None
               ) -> tuple[list[Piece], list[str]]:
    """``mtp_hidden`` as plan pieces (``models.deepseek_v3.plan``) reading the main hidden state ``stream``;
    also the names of the depths' hidden states. ``wrap``: as in ``plan.layer_pieces``."""
    pieces, names, prev = [], [], stream
    for k, n, module, ahead, cos, sin in _depths(args, modules, tokens, positions):
        name = f"mtp{k}"
        project = lambda h, module=module, n=n, ahead=ahead, name=name: {name: module.project(h[:, :n], embed(ahead))}  # noqa: E731
        pieces += [Compute(f"mtp {k} input", project, (prev,), (name,)),
                   *layer_pieces(module.block, cos, sin, name, wrap)]
        names.append(name)
        prev = name
    return pieces, names


def mtp_logits(args: ModelArgs, modules: Sequence[MTPModule], embed: nn.Module, head: nn.Module, h: torch.Tensor,
               tokens: torch.Tensor, wrap: LayerWrap | None = None) -> list[torch.Tensor]:
    """MTP logits per depth k = 1..D: depth k's ``[b, s - k, vocab]`` at position i predict ``tokens[i + k + 1]``.
    ``wrap``: as in ``mtp_hidden``."""
    return [head(module.norm(hk)) for module, hk in zip(modules, mtp_hidden(args, modules, embed, h, tokens, wrap))]
