"""Building blocks shared by attention, MoE and MTP: RMSNorm, Linear (through deep_gemm), SwiGLU MLP.

Every projection of attention and every FFN/expert GEMM goes through ``deep_gemm`` so that (a) the
FP8 switch (``ModelArgs.fp8``) turns them all into block-scaled FP8 GEMMs at once and (b) their
weight-gradient GEMMs are deferred through ``accel.wgrad`` for zero-bubble pipeline schedules.
Embedding, output head, router, norms and the attention core never go through here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

import deep_gemm
import fused_ops

# A GEMM input's 1x128 cast made by its producer: (e4m3 values [rows, K], fp32 scales [rows, ceil(K/128)]).
Precast = tuple[torch.Tensor, torch.Tensor]

# The experts' grouped GEMM (contiguous layout, pad rows -1), re-exported for the MoE and its tests.
grouped_linear = deep_gemm.grouped_linear


class _RMSNormFunction(torch.autograd.Function):
    """``rms_norm(x.float()).to(x.dtype) * weight`` with a hand-written backward.

    The forward is torch's fused kernel (the same numbers as ``F.rms_norm``). torch has no fused CPU
    backward: autograd replays the decomposition (pow, mean, rsqrt, muls, a div, sums: ~14 passes over
    ``x``), and the weight multiply saves the normalised ``x`` as well. This backward saves only ``x``
    (``rstd`` is remade from it by the same kernel: the same bits) and takes ~8 passes:
    ``dx = rstd * (g - x_hat * mean(g * x_hat))`` with ``g = dy * weight``. About 20% less time per norm,
    forward+backward, on a CPU; same gradients up to fp32 rounding.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x_hat, rstd = torch.ops.aten._fused_rms_norm(x.float(), [x.shape[-1]], None, eps)
        ctx.eps = eps
        ctx.save_for_backward(x, weight)
        return x_hat.to(x.dtype) * weight

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        x_hat, rstd = torch.ops.aten._fused_rms_norm(x.float(), [x.shape[-1]], None, ctx.eps)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad_out * x_hat.to(grad_out.dtype)).flatten(0, -2).sum(0).to(weight.dtype)
        g = (grad_out * weight).float()
        mean_g_xhat = torch.linalg.vecdot(g, x_hat).unsqueeze(-1).div_(x.shape[-1])
        grad_x = torch.addcmul(g, x_hat, mean_g_xhat, value=-1).mul_(rstd).to(x.dtype)
        return grad_x, grad_weight, None


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, output in the input dtype (as DeepSeek's and HF's implementations).

    ``norm(x)`` is ``y``. ``norm(x, residual)`` adds the residual stream first: ``NormOut(y, h, None)`` with
    ``h = x + residual`` (rounded to x's dtype, as torch's add) and ``y`` the norm of that rounded ``h``.
    ``fp8=True`` asks for ``y``'s 1x128 e4m3 cast too (``NormOut.fp8``), made in the same pass where the
    fused kernel runs and None otherwise (the consumer then casts ``y`` itself: the same bits).
    Not keeping ``y`` for backward (``recompute`` kind "norm") is the memory policy's
    (``training.memory_policy``). ``fused``: one ``fused_ops.rmsnorm`` kernel each way
    where it runs (same rounding points).
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
        if self.fused and fused_ops.kernels_run(x.device):
            return fused_ops.rmsnorm(x, self.weight, residual, eps=self.eps, fp8=fp8)
        h = x if residual is None else x + residual
        y = _RMSNormFunction.apply(h, self.weight, self.eps)
        if residual is None and not fp8:
            return y
        return fused_ops.functions.NormOut(y, None if residual is None else h, None)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class Linear(deep_gemm.Fp8Linear):
    """Bias-free ``deep_gemm.Fp8Linear``: bf16/fp32 GEMMs, or block-scaled FP8 ones when ``fp8``.

    The weight is the plain ``[out_features, in_features]`` master weight, as in HF checkpoints; its
    gradient is deferred through ``accel.wgrad`` (accumulated into its gradient directly, ``accel.grads``).
    """

    def __init__(self, in_features: int, out_features: int, fp8: bool = False, fp8_cache: bool = False):
        super().__init__(in_features, out_features, bias=False, fp8=fp8, fp8_cache=fp8 and fp8_cache)


class _SwiGLUFunction(torch.autograd.Function):
    """``silu(gate) * up``, times a per-row ``weights`` when given, saving only ``gate_up`` (and ``weights``).

    Autograd's graph of the same ops would also keep ``silu(gate)`` and, with weights, the unweighted
    product (one ``[rows, inter]`` tensor each). Backward in at least fp32:
    ``d gate = g up sigmoid(gate) (1 + gate (1 - sigmoid(gate)))``, ``d up = g silu(gate)`` with
    ``g = grad * weights``, and ``d weights = sum(grad * silu(gate) * up)`` over the row.
    """

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        out = F.silu(gate) * up
        if weights is not None:
            weighted = out * weights.unsqueeze(-1)
            # cast back only where the product promoted (bf16 rows, fp32 weights): torch 2.11's compiled backward of
            # this Function is wrong when its output is a no-op ``.to`` of an intermediate (benchmarks/compile.md)
            out = weighted if weighted.dtype == out.dtype else weighted.to(out.dtype)
        ctx.save_for_backward(gate_up, weights)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        gate_up, weights = ctx.saved_tensors
        compute = torch.promote_types(gate_up.dtype, torch.float32)
        gate, up = gate_up.to(compute).chunk(2, dim=-1)
        g = grad.to(compute)
        sig = torch.sigmoid(gate)
        silu = gate * sig
        grad_weights = None
        if weights is not None:
            if ctx.needs_input_grad[1]:
                grad_weights = torch.linalg.vecdot(g, silu * up).to(weights.dtype)
            g = g * weights.unsqueeze(-1).to(compute)
        grad_gate = g * up * sig * (1 + gate * (1 - sig))
        return torch.cat([grad_gate, g * silu], dim=-1).to(gate_up.dtype), grad_weights


def swiglu(gate_up: torch.Tensor, weights: torch.Tensor | None = None, fused: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` for the fused ``[..., 2 * inter]`` gate/up projection output; with ``weights``
    (``[...]``, one per row: the MoE's routing weights) each row is scaled by its weight, so the expert
    outputs need no weighted sum afterwards (and nothing ``[rows, dim]`` is kept for the weights' gradient).
    ``fused``: one ``fused_ops.swiglu`` kernel each way where it runs (same rounding points)."""
    if fused and fused_ops.kernels_run(gate_up.device):
        return fused_ops.swiglu(gate_up, weights)
    return _SwiGLUFunction.apply(gate_up, weights)


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
