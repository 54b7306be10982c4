"""Building blocks shared by attention, MoE and MTP: RMSNorm, Linear (through deep_gemm), SwiGLU MLP.

Every projection of attention and every FFN/expert GEMM goes through ``deep_gemm`` so that (a) the
FP8 switch (``ModelArgs.fp8``) turns them all into block-scaled FP8 GEMMs at once and (b) their
weight-gradient GEMMs are deferred through ``accel.wgrad`` for zero-bubble pipeline schedules.
Embedding, output head, router, norms and the attention core never go through here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

import deep_gemm
import fused_ops
from deep_gemm.reference import dequantize
from models.deepseek_v3.recompute import Stash, produce_consume, recomputing

# A GEMM input's 1x128 cast made by its producer: (e4m3 values [rows, K], fp32 scales [rows, ceil(K/128)]).
Precast = tuple[torch.Tensor, torch.Tensor]

# The experts' grouped GEMM (contiguous layout, pad rows -1), re-exported for the MoE and its tests.
grouped_linear = deep_gemm.grouped_linear


class _RMSNormFunction(torch.autograd.Function):
    """``rms_norm(x.float()).to(x.dtype) * weight`` with a hand-written backward.

    The forward is torch's fused kernel (the same numbers as ``F.rms_norm``). torch has no fused CPU
    backward: autograd replays the decomposition (pow, mean, rsqrt, muls, a div, sums: ~14 passes over
    ``x``), and the weight multiply saves the normalised ``x`` as well. This backward saves only ``x``
    and ``rstd`` and takes ~7 passes: ``dx = rstd * (g - x_hat * mean(g * x_hat))`` with
    ``g = dy * weight``. About 20% less time per norm, forward+backward, on a CPU; same gradients up
    to fp32 rounding.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x_hat, rstd = torch.ops.aten._fused_rms_norm(x.float(), [x.shape[-1]], None, eps)
        ctx.save_for_backward(x, rstd, weight)
        return x_hat.to(x.dtype) * weight

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        x_hat = x.float() * rstd
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
    Recomputing it (``recompute`` kind "norm") is up to the caller, which knows the consumer:
    ``recompute.produce_consume(norm, consumer, x)``. ``fused``: one ``fused_ops.rmsnorm`` kernel each way
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
            out = (out * weights.unsqueeze(-1)).to(out.dtype)
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


def fp8_swiglu_handoff(recomputed: bool, fused: bool, fp8: object, health, gate_up: torch.Tensor) -> bool:
    """Whether a SwiGLU feeds its down projection through ``swiglu_down_fp8``: its output is recomputed (so the
    forward need not write it), the fused kernels run, the GEMM takes a precast, no ``Fp8Health`` report is
    being sampled (it counts the cast against the bf16 values it came from), and this is not a checkpointed
    region's rerun (``recomputing()``: the down projection must keep the real output it reads there) nor a
    forward whose SwiGLU input has no gradient while grads are on (nothing would recompute the output)."""
    return (recomputed and fused and fused_ops.kernels_run(gate_up.device) and deep_gemm.takes_precast(fp8)
            and (health is None or not health.active) and not recomputing()
            and (gate_up.requires_grad or not torch.is_grad_enabled()))


def swiglu_down_fp8(down: Callable[..., torch.Tensor], gate_up: torch.Tensor, weights: torch.Tensor | None = None,
                    stash: Stash | None = None) -> torch.Tensor:
    """``down(swiglu(gate_up, weights))`` where ``fp8_swiglu_handoff`` holds: the forward writes only the 1x128
    cast that ``down`` reads (``down(x, x_fp8=cast)``), in one ``fused_ops.swiglu_fp8`` kernel.

    ``down`` still takes the SwiGLU output ``x`` for its weight gradient: a tensor that nothing writes here,
    which ``produce_consume(..., outputs=)`` releases unread and refills from the SwiGLU's recompute before
    ``down``'s backward. ``down`` casts that output again there: the forward's cast, bit for bit, as
    ``swiglu_fp8`` casts exactly what ``swiglu`` writes. ``stash``: how ``gate_up`` is kept (FP8 caching)."""
    cast = fused_ops.swiglu_fp8(gate_up.reshape(-1, gate_up.shape[-1]), weights)  # not differentiable
    unwritten = gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
    consume = functools.partial(down, x_fp8=cast)
    if not torch.is_grad_enabled():  # no backward: the output is never read
        return consume(unwritten)
    inputs, stashes = ((gate_up,), stash) if weights is None else ((gate_up, weights), (stash, None))
    return produce_consume(functools.partial(swiglu, fused=True), consume, *inputs, stash=stashes,
                           outputs=(unwritten,))


def _fp8_pack(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, scales = deep_gemm.per_token_cast_to_fp8(x.reshape(-1, x.shape[-1]))
    return q.view(x.shape), scales.view(*x.shape[:-1], -1)


def _fp8_unpack(packed: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
    q, scales = packed
    return dequantize(q.reshape(-1, q.shape[-1]), scales.reshape(-1, scales.shape[-1])).to(dtype).view(q.shape)


# A recomputed producer's input kept as e4m3 + 1x128 scales: the SwiGLU input under FP8 activation caching.
FP8_STASH = Stash(pack=_fp8_pack, unpack=_fp8_unpack)


class MLP(nn.Module):
    """SwiGLU FFN (dense layers and shared experts). Gate and up projections are fused into one GEMM:
    ``w13`` is ``cat[gate_proj, up_proj]`` (HF keys split it back).

    ``recompute_swiglu``: keep ``w13``'s output (the SwiGLU input) instead of the SwiGLU output, which
    ``w2`` then recomputes. ``fp8_cache`` implies it, with the SwiGLU input kept in FP8, and keeps
    ``w13``'s input in FP8 unless ``input_recomputed`` (the caller recomputes it: nothing to cache).
    """

    def __init__(self, dim: int, inter_dim: int, fp8: bool = False, recompute_swiglu: bool = False,
                 fp8_cache: bool = False, input_recomputed: bool = False, fused: bool = False):
        super().__init__()
        self.dim, self.inter_dim, self.fused = dim, inter_dim, fused
        self.recompute_swiglu = recompute_swiglu or (fp8 and fp8_cache)
        self.stash = FP8_STASH if fp8 and fp8_cache else None
        self.w13 = Linear(dim, 2 * inter_dim, fp8=fp8, fp8_cache=fp8_cache and not input_recomputed)
        self.w2 = Linear(inter_dim, dim, fp8=fp8)  # its input is recomputed whenever caching is on

    def forward(self, x: torch.Tensor, x_fp8: Precast | None = None) -> torch.Tensor:
        """``x_fp8``: x's 1x128 cast made by its producer (the norm), read by ``w13`` instead of casting x again."""
        h = self.w13(x, x_fp8)
        if fp8_swiglu_handoff(self.recompute_swiglu, self.fused, self.w2.fp8, self.w2.health, h):
            return swiglu_down_fp8(self.w2, h, stash=self.stash)
        return produce_consume(functools.partial(swiglu, fused=self.fused), self.w2, h,
                               enabled=self.recompute_swiglu, stash=self.stash)
