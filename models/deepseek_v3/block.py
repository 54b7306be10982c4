"""One DeepSeek-V3 layer: pre-norm MLA attention, then a dense SwiGLU FFN (first layers) or DeepSeekMoE."""

from __future__ import annotations

import torch
from torch import nn

from models.deepseek_v3.args import ModelArgs
from models.deepseek_v3.layers import MLP, RMSNorm
from models.deepseek_v3.mla import MLA, LatentCache
from models.deepseek_v3.moe import MoE
from models.deepseek_v3.recompute import maybe_recompute, produce_consume


class Block(nn.Module):
    """Pre-norm residual block: ``x + attn(attn_norm(x))`` then ``x + ffn(ffn_norm(x))``.

    With recompute kind "norm" each norm's output is dropped after its consumer saved it and recomputed
    from ``x`` (kept anyway) before that consumer's backward; "block" keeps only ``x``. The overlapped
    pipeline runs an expert-parallel layer as the pieces in ``models.deepseek_v3.plan``, which call the
    same methods: ``attention``, the MoE's ``send`` / ``expert_rows`` / ``combined``.
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

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LatentCache | None = None,
                  start_pos: int = 0) -> torch.Tensor:
        """``x + attn(attn_norm(x))``."""
        attend = lambda y: self.attn(y, cos, sin, cache, start_pos)  # noqa: E731
        return x + produce_consume(self.attn_norm, attend, x, enabled=self.recompute_norm)

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        """``h + ffn(ffn_norm(h))``."""
        return h + produce_consume(self.ffn_norm, self.ffn, h, enabled=self.recompute_norm)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LatentCache | None = None,
                start_pos: int = 0) -> torch.Tensor:
        if self.recompute_block and cache is None:
            return maybe_recompute(lambda h: self.feed_forward(self.attention(h, cos, sin)), x, enabled=True)
        return self.feed_forward(self.attention(x, cos, sin, cache, start_pos))

    @property
    def expert_parallel(self) -> bool:
        """Whether this layer's MoE exchanges tokens with other ranks (it then has all-to-alls to overlap)."""
        return isinstance(self.ffn, MoE) and self.ffn.ep is not None
