"""One DeepSeek-V3 layer: pre-norm MLA attention, then a dense SwiGLU FFN (first layers) or DeepSeekMoE."""

from __future__ import annotations

import torch
from torch import nn

from models.deepseek_v3.args import ModelArgs
from models.deepseek_v3.layers import MLP, RMSNorm, maybe_recompute
from models.deepseek_v3.mla import MLA, LatentCache
from models.deepseek_v3.moe import MoE
from models.deepseek_v3.recompute import produce, produce_consume
from models.deepseek_v3.steps import Cuts, Steps, drain


class Block(nn.Module):
    """Pre-norm residual block: ``x + attn(attn_norm(x))`` then ``x + ffn(ffn_norm(x))``.

    ``steps`` is the forward as a generator (an expert-parallel MoE yields while its all-to-alls are in
    flight); ``forward`` drains it and a pipeline stage runs it interleaved with another micro-batch.
    With recompute kind "norm" each norm's output is dropped after its consumer saved it and recomputed
    from ``x`` (kept anyway) before that consumer's backward; "block" keeps only ``x``.
    """

    def __init__(self, args: ModelArgs, layer_id: int, expert_ids: range | None = None):
        super().__init__()
        self.layer_id = layer_id
        self.recompute_norm = args.recomputes("norm", layer_id)
        self.recompute_block = args.recomputes("block", layer_id)
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.attn = MLA(args, layer_id)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        if args.is_moe_layer(layer_id):
            self.ffn: nn.Module = MoE(args, layer_id, expert_ids)
        else:
            self.ffn = MLP(args.dim, args.inter_dim, fp8=args.fp8, recompute_swiglu=args.recomputes("swiglu", layer_id),
                           fp8_cache=args.fp8_cache, input_recomputed=self.recompute_norm)

    def attention_residual(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           cache: LatentCache | None = None, start_pos: int = 0) -> torch.Tensor:
        """``x + attn(attn_norm(x))``."""
        attend = lambda y: self.attn(y, cos, sin, cache, start_pos)  # noqa: E731
        return x + produce_consume(self.attn_norm, attend, x, enabled=self.recompute_norm)

    def ffn_residual(self, x: torch.Tensor) -> torch.Tensor:
        """``x + ffn(ffn_norm(x))`` (an expert-parallel MoE as one call; stages split it at its all-to-alls)."""
        return x + produce_consume(self.ffn_norm, self.ffn, x, enabled=self.recompute_norm)

    def steps(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LatentCache | None = None,
              start_pos: int = 0, cuts: Cuts | None = None) -> Steps[torch.Tensor]:
        """The forward as steps (``MoE.steps``' yields); whole-block recompute runs it in one piece."""
        if self.recompute_block and cache is None:
            return maybe_recompute(lambda h: drain(self._steps(h, cos, sin, None, start_pos, None)), x, enabled=True)
        return (yield from self._steps(x, cos, sin, cache, start_pos, cuts))

    def _steps(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LatentCache | None,
               start_pos: int, cuts: Cuts | None) -> Steps[torch.Tensor]:
        h = self.attention_residual(x, cos, sin, cache, start_pos)
        if not isinstance(self.ffn, MoE) or self.ffn.ep is None:
            return self.ffn_residual(h)
        normed = produce(self.ffn_norm, h, enabled=self.recompute_norm)  # released once the combine has landed
        out = yield from self.ffn.steps(normed.outputs[0], cuts, residual=h)
        normed.release(out)
        return out

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LatentCache | None = None,
                start_pos: int = 0) -> torch.Tensor:
        return drain(self.steps(x, cos, sin, cache, start_pos))
