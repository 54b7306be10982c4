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


class Block(nn.Module):
    """Pre-norm residual block: ``h = x + attn(attn_norm(x))``, then ``h + ffn(ffn_norm(h))``.

    One hidden-state tensor goes in and one comes out. What backward keeps (V3's norm, MLA up-projection and SwiGLU
    recompute, FP8 caching) and whole-block recompute ("block") are the memory policy's
    (``training.memory_policy``), applied from outside: whoever runs the layer takes the policy's wrapper
    (``LayerWrap``). The overlapped pipeline runs an expert-parallel layer as the pieces in
    ``models.deepseek_v3.plan``, which call ``attention``, ``ffn_norm`` and the MoE's ``send`` / ``expert_rows`` /
    ``combined``.
    """

    def __init__(self, args: ModelArgs, layer_id: int, expert_ids: range | None = None):
        super().__init__()
        self.layer_id = layer_id
        self.attn_norm = RMSNorm(args.dim, args.norm_eps, args.fused_ops)
        self.attn = MLA(args, layer_id)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, args.fused_ops)
        if args.is_moe_layer(layer_id):
            self.ffn: nn.Module = MoE(args, layer_id, expert_ids)
        else:
            self.ffn = MLP(args.dim, args.inter_dim, fp8=args.fp8, fp8_cache=args.fp8_cache,
                           input_recomputed=args.recomputes("norm", layer_id), fused=args.fused_ops)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LatentCache | None = None,
                start_pos: int = 0) -> torch.Tensor:
        h = x + self.attn(self.attn_norm(x), cos, sin, cache, start_pos)
        return h + self.ffn(self.ffn_norm(h))

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The first residual line alone (the overlapped pipeline's attention piece)."""
        return x + self.attn(self.attn_norm(x), cos, sin)

    @property
    def expert_parallel(self) -> bool:
        """Whether this layer's MoE exchanges tokens with other ranks (it then has all-to-alls to overlap)."""
        return isinstance(self.ffn, MoE) and self.ffn.ep is not None



# ``wrap(layer, fn) -> fn'``: how a layer's compute ``fn`` is run, given from outside by whoever runs the layers
# (``fn`` itself, or ``fn`` recomputed whole in backward: ``training.memory_policy.MemoryPolicy.recomputed``)
LayerWrap = Callable[[Block, Callable[..., Any]], Callable[..., Any]]


def call(block: Block, wrap: LayerWrap | None) -> Callable[..., torch.Tensor]:
    """``block`` as ``wrap`` runs it (``block`` itself without a wrapper)."""
    return block if wrap is None else wrap(block, block)
