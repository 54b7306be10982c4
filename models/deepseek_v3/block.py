"""One DeepSeek-V3 layer: pre-norm MLA attention, then a dense SwiGLU FFN (first layers) or DeepSeekMoE."""

from __future__ import annotations

import torch
from torch import nn

from models.deepseek_v3.args import ModelArgs
from models.deepseek_v3.layers import MLP, RMSNorm, maybe_recompute
from models.deepseek_v3.mla import MLA, LatentCache
from models.deepseek_v3.moe import MoE
from models.deepseek_v3.steps import Cuts, Steps, drain


class Block(nn.Module):
    """Pre-norm residual block: ``x + attn(attn_norm(x))`` then ``x + ffn(ffn_norm(x))``."""

    def __init__(self, args: ModelArgs, layer_id: int, expert_ids: range | None = None):
        super().__init__()
        self.layer_id = layer_id
        recompute_norm = args.recomputes("norm", layer_id)
        self.recompute_block = args.recomputes("block", layer_id)
        self.attn_norm = RMSNorm(args.dim, args.norm_eps, recompute=recompute_norm)
        self.attn = MLA(args, layer_id)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, recompute=recompute_norm)
        if args.is_moe_layer(layer_id):
            self.ffn: nn.Module = MoE(args, layer_id, expert_ids)
        else:
            self.ffn = MLP(args.dim, args.inter_dim, fp8=args.fp8, recompute_swiglu=args.recomputes("swiglu", layer_id))

    def steps(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LatentCache | None = None,
              start_pos: int = 0, cuts: Cuts | None = None) -> Steps[torch.Tensor]:
        """The forward as steps (``MoE.steps``' yields); whole-block recompute runs it in one piece."""
        if self.recompute_block and cache is None:
            return maybe_recompute(lambda h: drain(self._steps(h, cos, sin, None, start_pos, None)), x, enabled=True)
        return (yield from self._steps(x, cos, sin, cache, start_pos, cuts))

    def _steps(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LatentCache | None,
               start_pos: int, cuts: Cuts | None) -> Steps[torch.Tensor]:
        h = x + self.attn(self.attn_norm(x), cos, sin, cache, start_pos)
        if not isinstance(self.ffn, MoE):
            return h + self.ffn(self.ffn_norm(h))
        return (yield from self.ffn.steps(self.ffn_norm(h), cuts, residual=h))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LatentCache | None = None,
                start_pos: int = 0) -> torch.Tensor:
        return drain(self.steps(x, cos, sin, cache, start_pos))
