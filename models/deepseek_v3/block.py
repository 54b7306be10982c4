"""One DeepSeek-V3 layer: pre-norm MLA attention, then a dense SwiGLU FFN (first layers) or DeepSeekMoE."""

from __future__ import annotations

import torch
from torch import nn

from models.deepseek_v3.args import ModelArgs
from models.deepseek_v3.layers import MLP, RMSNorm
from models.deepseek_v3.mla import MLA, LatentCache
from models.deepseek_v3.moe import MoE
from models.deepseek_v3.recompute import maybe_recompute


class Block(nn.Module):
    """Pre-norm residual block: ``h = x + attn(attn_norm(x))``, then ``h + ffn(ffn_norm(h))``.

    One hidden-state tensor goes in and one comes out. What backward keeps (V3's norm and SwiGLU recompute,
    FP8 caching) is the memory policy's (``training.memory_policy``); whole-block recompute ("block") is
    applied by the caller (``run_block``). The overlapped pipeline runs an expert-parallel layer as the pieces
    in ``models.deepseek_v3.plan``, which call ``attention``, ``ffn_norm`` and the MoE's ``send`` /
    ``expert_rows`` / ``combined``.
    """

    def __init__(self, args: ModelArgs, layer_id: int, expert_ids: range | None = None):
        super().__init__()
        self.layer_id = layer_id
        self.recompute_block = args.recomputes("block", layer_id)
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


def run_block(block: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LatentCache | None = None,
              start_pos: int = 0) -> torch.Tensor:
    """``block(x, ...)``, keeping only ``x`` for backward (whole-block recompute) where the layer asks for it and
    no cache is written (a recomputed forward would write it twice)."""
    if block.recompute_block and cache is None:
        return maybe_recompute(lambda x: block(x, cos, sin), x, enabled=True)
    return block(x, cos, sin, cache, start_pos)
