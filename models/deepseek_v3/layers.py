"""Building blocks shared by attention, MoE and MTP: RMSNorm, Linear (through deep_gemm), SwiGLU MLP.

Every projection of attention and every FFN/expert GEMM goes through ``deep_gemm`` so that (a) the
FP8 switch (``ModelArgs.fp8``) turns them all into block-scaled FP8 GEMMs at once and (b) their
weight-gradient GEMMs are deferred through ``accel.wgrad`` for zero-bubble pipeline schedules.
Embedding, output head, router, norms and the attention core never go through here.
"""

from __future__ import annotations

import torch
from torch import nn

import deep_gemm
import fused_ops

# A GEMM input's 1x128 cast made by its producer: (e4m3 values [rows, K], fp32 scales [rows, ceil(K/128)]).
Precast = tuple[torch.Tensor, torch.Tensor]

# The experts' grouped GEMM (contiguous layout, pad rows -1), re-exported for the MoE and its tests.
grouped_linear = deep_gemm.grouped_linear


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, output in the input dtype (as DeepSeek's and HF's implementations).

    ``norm(x)`` is ``y``. ``norm(x, residual)`` adds the residual stream first: ``NormOut(y, h, None)`` with
    ``h = x + residual`` (rounded to x's dtype, as torch's add) and ``y`` the norm of that rounded ``h``.
    ``fp8=True`` asks for ``y``'s 1x128 e4m3 cast too (``NormOut.fp8``), made in the same pass where the
    fused kernel runs and None otherwise (the consumer then casts ``y`` itself: the same bits).
    Not keeping ``y`` for backward (``recompute`` kind "norm") is the memory policy's
    (``training.memory_policy``). ``fused``: one ``fused_ops.rmsnorm`` kernel each way
    where it runs (same rounding points; ``fused_ops.rms_norm`` decides).
    """

    def __init__(self, dim: int, eps: float = 1e-6, fused: bool = False):
        super().__init__()
        self.dim, self.eps, self.fused = dim, eps, fused
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                fp8: bool = False) -> torch.Tensor | fused_ops.functions.NormOut:
        if x.shape[-1] != self.dim:
            raise ValueError(f"RMSNorm: input's last dim must be {self.dim}, got shape {tuple(x.shape)}")
        if residual is not None and residual.shape != x.shape:
            raise ValueError(f"RMSNorm: residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
        return fused_ops.rms_norm(x, self.weight, residual, eps=self.eps, fp8=fp8, fused=self.fused)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class Linear(deep_gemm.Fp8Linear):
    """Bias-free ``deep_gemm.Fp8Linear``: bf16/fp32 GEMMs, or block-scaled FP8 ones when ``fp8``.

    The weight is the plain ``[out_features, in_features]`` master weight, as in HF checkpoints; its
    gradient is deferred through ``accel.wgrad`` (accumulated into its gradient directly, ``accel.grads``).
    """

    def __init__(self, in_features: int, out_features: int, fp8: bool = False, fp8_cache: bool = False):
        super().__init__(in_features, out_features, bias=False, fp8=fp8, fp8_cache=fp8 and fp8_cache)


def swiglu(gate_up: torch.Tensor, weights: torch.Tensor | None = None, fused: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` for the fused ``[..., 2 * inter]`` gate/up projection output; with ``weights``
    (``[...]``, one per row: the MoE's routing weights) each row is scaled by its weight, so the expert
    outputs need no weighted sum afterwards (and nothing ``[rows, dim]`` is kept for the weights' gradient).
    ``fused``: one ``fused_ops.swiglu`` kernel each way where it runs (same rounding points;
    ``fused_ops.silu_and_mul`` decides)."""
    return fused_ops.silu_and_mul(gate_up, weights, fused)


class SwiGLU(nn.Module):
    """``swiglu(gate_up, weights)`` as a module (no parameters): what a memory policy recomputes from its input."""

    def __init__(self, fused: bool = False):
        super().__init__()
        self.fused = fused

    def forward(self, gate_up: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        return swiglu(gate_up, weights, self.fused)


class MLP(nn.Module):
    """SwiGLU FFN (dense layers and shared experts). Gate and up projections are fused into one GEMM:
    ``w13`` is ``cat[gate_proj, up_proj]`` (HF keys split it back).

    ``fp8_cache`` keeps ``w13``'s input in FP8 unless ``input_recomputed`` (the memory policy remakes it:
    nothing to cache); ``w2``'s input, the SwiGLU output, is remade by the policy whenever caching is on.
    """

    def __init__(self, dim: int, inter_dim: int, fp8: bool = False, fp8_cache: bool = False,
                 input_recomputed: bool = False, fused: bool = False):
        super().__init__()
        self.dim, self.inter_dim = dim, inter_dim
        self.w13 = Linear(dim, 2 * inter_dim, fp8=fp8, fp8_cache=fp8_cache and not input_recomputed)
        self.act = SwiGLU(fused)
        self.w2 = Linear(inter_dim, dim, fp8=fp8)

    def forward(self, x: torch.Tensor, x_fp8: Precast | None = None) -> torch.Tensor:
        """``x_fp8``: x's 1x128 cast made by its producer (the norm), read by ``w13`` instead of casting x again."""
        return self.w2(self.act(self.w13(x, x_fp8)))
