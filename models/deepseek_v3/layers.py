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
from torch.utils.checkpoint import checkpoint

import deep_gemm


def _linear(x: torch.Tensor, weight: torch.Tensor, fp8: bool) -> torch.Tensor:
    # TODO(deep_gemm landing): drop the fallback once deep_gemm.linear is committed.
    if hasattr(deep_gemm, "linear"):
        return deep_gemm.linear(x, weight, fp8=fp8)
    if fp8:
        raise NotImplementedError("fp8=True needs deep_gemm.linear")
    return F.linear(x, weight)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, m_indices: torch.Tensor, fp8: bool = False) -> torch.Tensor:
    """``deep_gemm.grouped_linear``: row r of x times ``weight[m_indices[r]]^T``; rows with index -1 give 0."""
    # TODO(deep_gemm landing): drop the fallback once deep_gemm.grouped_linear is committed.
    if hasattr(deep_gemm, "grouped_linear"):
        return deep_gemm.grouped_linear(x, weight, m_indices, fp8=fp8)
    if fp8:
        raise NotImplementedError("fp8=True needs deep_gemm.grouped_linear")
    out = x.new_zeros(x.shape[0], weight.shape[1])
    for g in range(weight.shape[0]):
        idx = (m_indices == g).nonzero().squeeze(1)
        if idx.numel():
            out = out.index_copy(0, idx, x[idx] @ weight[g].t())
    return out


def maybe_recompute(fn, *args: torch.Tensor, enabled: bool):
    """``fn(*args)``, storing only its inputs for backward (recomputed there) when ``enabled`` and grads flow."""
    if enabled and torch.is_grad_enabled() and any(a.requires_grad for a in args if isinstance(a, torch.Tensor)):
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, output in the input dtype (as DeepSeek's and HF's implementations)."""

    def __init__(self, dim: int, eps: float = 1e-6, recompute: bool = False):
        super().__init__()
        self.dim, self.eps, self.recompute = dim, eps, recompute
        self.weight = nn.Parameter(torch.ones(dim))

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (self.dim,), eps=self.eps).to(x.dtype) * self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return maybe_recompute(self._forward, x, enabled=self.recompute)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class Linear(nn.Module):
    """``y = x W^T`` through ``deep_gemm.linear`` (bf16/fp32, or block-scaled FP8 when ``fp8``).

    The weight is the plain ``[out_features, in_features]`` master weight, as in HF checkpoints.
    """

    def __init__(self, in_features: int, out_features: int, fp8: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.fp8 = in_features, out_features, fp8
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = _linear(x.reshape(-1, self.in_features), self.weight, self.fp8)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8={self.fp8}"


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for the fused ``[..., 2 * inter]`` gate/up projection output."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class MLP(nn.Module):
    """SwiGLU FFN (dense layers and shared experts). Gate and up projections are fused into one GEMM:
    ``w13`` is ``cat[gate_proj, up_proj]`` (HF keys split it back)."""

    def __init__(self, dim: int, inter_dim: int, fp8: bool = False, recompute_swiglu: bool = False):
        super().__init__()
        self.dim, self.inter_dim, self.recompute_swiglu = dim, inter_dim, recompute_swiglu
        self.w13 = Linear(dim, 2 * inter_dim, fp8=fp8)
        self.w2 = Linear(inter_dim, dim, fp8=fp8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(maybe_recompute(swiglu, self.w13(x), enabled=self.recompute_swiglu))
