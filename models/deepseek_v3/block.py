"""One DeepSeek-V3 layer: pre-norm MLA attention, then a dense SwiGLU FFN (first layers) or DeepSeekMoE."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from models.deepseek_v3.args import ModelArgs
from models.deepseek_v3.layers import MLP, RMSNorm
from models.deepseek_v3.mla import MLA, LatentCache
from models.deepseek_v3.moe import MoE
from models.deepseek_v3.recompute import maybe_recompute, produce_consume


class Block(nn.Module):
    """Pre-norm residual block: ``h = x + attn(attn_norm(x))``, then ``h + ffn(ffn_norm(h))``.

    One hidden-state tensor goes in and one comes out. With recompute kind "norm" each norm's output is
    dropped once its consumer saved it and recomputed from the norm's input (kept anyway) before that
    consumer's backward (``normed``). Whole-block recompute ("block") is applied by the caller
    (``run_block``). The overlapped pipeline runs an expert-parallel layer as the pieces in
    ``models.deepseek_v3.plan``, which call ``attention``, ``normed`` and the MoE's ``send`` /
    ``expert_rows`` / ``combined``.
    """

    def __init__(self, args: ModelArgs, layer_id: int, expert_ids: range | None = None):
        super().__init__()
        self.layer_id = layer_id
        self.recompute_norm = args.recomputes("norm", layer_id)
        self.recompute_block = args.recomputes("block", layer_id)
        self.attn_norm = RMSNorm(args.dim, args.norm_eps, args.fused_ops)
        self.attn = MLA(args, layer_id)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, args.fused_ops)
        if args.is_moe_layer(layer_id):
            self.ffn: nn.Module = MoE(args, layer_id, expert_ids)
        else:
            self.ffn = MLP(args.dim, args.inter_dim, fp8=args.fp8, recompute_swiglu=args.recomputes("swiglu", layer_id),
                           fp8_cache=args.fp8_cache, input_recomputed=self.recompute_norm, fused=args.fused_ops)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LatentCache | None = None,
                start_pos: int = 0) -> torch.Tensor:
        h = self.attention(x, cos, sin, cache, start_pos)
        return h + self.normed(self.ffn_norm, h, self.ffn)

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LatentCache | None = None,
                  start_pos: int = 0) -> torch.Tensor:
        """The first residual line, ``x + attn(attn_norm(x))``."""
        return x + self.normed(self.attn_norm, x, lambda y: self.attn(y, cos, sin, cache, start_pos))

    def normed(self, norm: RMSNorm, x: torch.Tensor, consumer: Callable[[torch.Tensor], Any]) -> Any:
        """``consumer(norm(x))``; with recompute kind "norm" only ``x`` is kept for backward, not the norm's output."""
        return produce_consume(norm, consumer, x, enabled=self.recompute_norm)

    @property
    def expert_parallel(self) -> bool:
        """Whether this layer's MoE exchanges tokens with other ranks (it then has all-to-alls to overlap)."""
        return isinstance(self.ffn, MoE) and self.ffn.ep is not None


def run_block(block: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LatentCache | None = None,
              start_pos: int = 0) -> torch.Tensor:
    """``block(x, ...)``, keeping only ``x`` for backward (whole-block recompute) where the layer asks for it and
    no cache is written (a recomputed forward would write it twice)."""
    if block.recompute_block and cache is None:
        return maybe_recompute(lambda x: block(x, cos, sin), x, enabled=True)
    return block(x, cos, sin, cache, start_pos)
