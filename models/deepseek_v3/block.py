"""One DeepSeek-V3 layer: pre-norm MLA attention, then a dense SwiGLU FFN (first layers) or DeepSeekMoE."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable

import deep_gemm
from models.deepseek_v3.args import ModelArgs
from models.deepseek_v3.layers import MLP, RMSNorm
from models.deepseek_v3.mla import MLA, LatentCache
from models.deepseek_v3.moe import MoE
from models.deepseek_v3.recompute import maybe_recompute, produce_consume


class _Added(torch.autograd.Function):
    """``x + residual``, already computed without a graph (``box[0]``, by the fused norm's kernel), given one:
    the incoming gradient goes to both summands as it is."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, residual: torch.Tensor, box: list) -> torch.Tensor:
        return box.pop()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        return grad, grad, None


def norm_consume(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None, consumer: Callable[..., Any],
                 recompute: bool, fp8: bool = False) -> tuple[torch.Tensor, Any]:
    """``(h, consumer(y, *cast))``: ``h = x + residual`` (``x`` without a residual), ``y = norm(h)`` and, with
    ``fp8`` where the fused kernel runs, ``cast`` = y's 1x128 e4m3 cast (else nothing: the consumer casts).

    The add, the norm and the cast are one fused kernel. With ``recompute`` (V3's norm recompute) only ``h``
    is kept for backward: the kernel runs without a graph, ``y`` is released after the consumer and
    recomputed from ``h`` by the norm alone, which gives the same bits (the kernel normalises the rounded
    ``h``); ``h`` gets the add's gradient through ``_Added``. The cast is not recomputed: a consumer whose
    input is recomputed keeps no FP8 copy of it (it casts ``y`` again for its weight gradient), so the cast
    lives only while the consumer's forward runs.
    """
    needs_grad = x.requires_grad or (residual is not None and residual.requires_grad)
    if not (recompute and torch.is_grad_enabled() and needs_grad):
        y, h, cast = _normed(norm, x, residual, fp8)
        return h, consumer(y, *cast)
    with torch.no_grad():
        y, h, cast = _normed(norm, x, residual, fp8)
    if residual is not None:
        h = _Added.apply(x, residual, [h])
    return h, produce_consume(norm, lambda y: consumer(y, *cast), h, outputs=(y,))


def _normed(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None, fp8: bool
            ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """``(y, h, cast)`` of ``norm(x, residual, fp8)``, ``cast`` empty where none was made."""
    out = norm(x, residual, fp8=fp8)
    if isinstance(out, torch.Tensor):
        return out, x, ()
    return out.y, x if residual is None else out.residual, out.fp8 or ()


class Block(nn.Module):
    """Pre-norm residual block: ``h = x + attn(attn_norm(x))``, then ``h + ffn(ffn_norm(h))``.

    Each residual add runs inside the next norm's kernel (``norm_consume``): ``x + attn`` in ``ffn_norm``'s,
    and, between consecutive layers, ``h + ffn`` in the next layer's ``attn_norm``: ``unadded`` returns
    ``(h, ffn_out)`` and takes the previous layer's pair as ``(x, pending)``; ``forward`` returns the sum.
    With recompute kind "norm" each norm's output is dropped after its consumer saved it and recomputed
    from the norm's input (kept anyway) before that consumer's backward; "block" keeps only the layer's
    input. The overlapped pipeline runs an expert-parallel layer as the pieces in ``models.deepseek_v3.plan``,
    which call the same methods: ``attention``, ``ffn_input``, the MoE's ``send`` / ``expert_rows`` /
    ``combined``.
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
        # the norms hand their FP8 cast to the GEMMs after them (MLA's wq_a / wkv_a, the FFN's w13, the one-rank
        # MoE's shared and routed w13) where the recipe takes one
        self.norm_fp8 = bool(args.fp8) and deep_gemm.takes_precast(args.fp8)

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LatentCache | None = None,
                  start_pos: int = 0, pending: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x', attn(attn_norm(x')))`` with the layer's input ``x' = x + pending`` (the previous layer's FFN
        output, added in attn_norm's kernel; ``x`` itself without one). Not added: ``ffn_input`` adds them."""
        attend = lambda y, *cast: self.attn(y, cos, sin, cache, start_pos, x_fp8=cast or None)  # noqa: E731
        return norm_consume(self.attn_norm, x, pending, attend, self.recompute_norm, self.norm_fp8)

    def ffn_input(self, x: torch.Tensor, attn_out: torch.Tensor, consumer: Callable[..., Any]
                  ) -> tuple[torch.Tensor, Any]:
        """``(h, consumer(ffn_norm(h), *cast))`` with ``h = x + attn_out`` added in ffn_norm's kernel; the cast
        where ``norm_fp8``."""
        return norm_consume(self.ffn_norm, attn_out, x, consumer, self.recompute_norm, self.norm_fp8)

    def unadded(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LatentCache | None = None,
                start_pos: int = 0, pending: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on ``x + pending``: ``(h, ffn(ffn_norm(h)))``, whose sum is its output (left for the next
        layer's attn_norm to add)."""
        if self.recompute_block and cache is None:
            x = x if pending is None else x + pending  # the checkpoint then keeps one tensor, as before
            return maybe_recompute(lambda x: self._unadded(x, cos, sin), x, enabled=True)
        return self._unadded(x, cos, sin, cache, start_pos, pending)

    def _unadded(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LatentCache | None = None,
                 start_pos: int = 0, pending: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        x, attn_out = self.attention(x, cos, sin, cache, start_pos, pending)
        return self.ffn_input(x, attn_out, lambda y, *cast: self.ffn(y, x_fp8=cast or None))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LatentCache | None = None,
                start_pos: int = 0) -> torch.Tensor:
        h, ffn_out = self.unadded(x, cos, sin, cache, start_pos)
        return h + ffn_out

    @property
    def expert_parallel(self) -> bool:
        """Whether this layer's MoE exchanges tokens with other ranks (it then has all-to-alls to overlap)."""
        return isinstance(self.ffn, MoE) and self.ffn.ep is not None
