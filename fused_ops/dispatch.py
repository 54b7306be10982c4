"""The model's entry to each fusion: the fused kernel where it runs, else a torch path with the same rounding points.

``models/`` calls one function per fusion (``rms_norm``, ``silu_and_mul``, ``rotary``, ``rotary_tail_``,
``permute_tokens``, expert parallelism's ``send_layout``) with the
model's ``fused`` switch (``ModelArgs.fused_ops``, configuration); whether the kernels run on the tensors' device
(``kernels_run``: the registry's choice, ``DSV3_KERNEL_IMPL``) is decided here, beside the ops. The torch paths are
what the model computed inline before, bit for bit: tuned for a CPU (torch's fused RMSNorm forward, backwards that
keep only the input, RoPE as one complex multiply), and what the bit-exact equivalence tests compare.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from accel import registry
from fused_ops.functions import NormOut, apply_rope, permute, rmsnorm, rope_, swiglu
from fused_ops.grouping import Grouping, grouping


def kernels_run(device: torch.device) -> bool:
    """Whether the fused Triton kernels (not their references) run for tensors on ``device`` now: the registry's
    choice (``DSV3_KERNEL_IMPL``), Triton where it can run. Otherwise this module's torch paths run."""
    return registry.requested_impl() != "reference" and registry.triton_unavailable_reason(device) is None


class _RMSNormFunction(torch.autograd.Function):
    """``rms_norm(x.float()).to(x.dtype) * weight`` with a hand-written backward.

    The forward is torch's fused kernel (the same numbers as ``F.rms_norm``). torch has no fused CPU
    backward: autograd replays the decomposition (pow, mean, rsqrt, muls, a div, sums: ~14 passes over
    ``x``), and the weight multiply saves the normalised ``x`` as well. This backward saves only ``x``
    (``rstd`` is remade from it by the same kernel: the same bits) and takes ~8 passes:
    ``dx = rstd * (g - x_hat * mean(g * x_hat))`` with ``g = dy * weight``; same gradients up to fp32 rounding.
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None, eps: float = 1e-6,
             fp8: bool = False, fused: bool = True) -> torch.Tensor | NormOut:
    """``rmsnorm``'s contract (``y``, or ``NormOut(y, x + residual, fp8 cast)`` with a residual or ``fp8``): the
    ``fused_ops.rmsnorm`` kernel where ``fused`` and it runs, else the torch path, whose ``NormOut.fp8`` is None
    (the consumer casts ``y`` itself: the same bits)."""
    if fused and kernels_run(x.device):
        return rmsnorm(x, weight, residual, eps=eps, fp8=fp8)
    h = x if residual is None else x + residual
    y = _RMSNormFunction.apply(h, weight, eps)
    if residual is None and not fp8:
        return y
    return NormOut(y, None if residual is None else h, None)


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


def silu_and_mul(gate_up: torch.Tensor, weights: torch.Tensor | None = None, fused: bool = True) -> torch.Tensor:
    """``swiglu``'s contract (``silu(gate) * up`` of ``[..., 2 * inter]``, each row times ``weights [...]``): the
    ``fused_ops.swiglu`` kernel where ``fused`` and it runs, else the torch path (same rounding points)."""
    if fused and kernels_run(gate_up.device):
        return swiglu(gate_up, weights)
    return _SwiGLUFunction.apply(gate_up, weights)


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if cos.dim() == 2:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    else:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    pairs = x.float().unflatten(-1, (-1, 2))
    # view_as_complex needs (re, im) pairs at even offsets. Eager keeps a view where it may (no copy kept for
    # backward); a compiled graph cannot read the storage offset, so there the pairs are made contiguous (the same
    # values, and the compiler decides what backward keeps)
    if (torch.compiler.is_compiling() or pairs.storage_offset() % 2 or any(st % 2 for st in pairs.stride()[:-2])
            or pairs.stride(-1) != 1):
        pairs = pairs.contiguous()
    # one complex multiply, (x0 + i x1)(cos + i sin) = (x0 cos - x1 sin) + i (x1 cos + x0 sin): the same
    # products as four real multiplies and a stack, fewer passes forward and backward on a CPU
    y = torch.view_as_complex(pairs) * torch.complex(cos, sin)
    return torch.view_as_real(y).flatten(-2).to(x.dtype)


def _rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = True,
           fused: bool = True) -> torch.Tensor:
    """``apply_rope``'s contract (``x [b, s, h, d]`` rotated by ``cos/sin [s, d/2]``, or ``[b, s, d/2]`` for
    interleaved pairs; fp32 math, one rounding) into a new tensor: the ``fused_ops.apply_rope`` kernel where
    ``fused`` and it runs, else the torch path (interleaved: one complex multiply; halves: Llama's
    ``rotate_half``)."""
    if fused and kernels_run(x.device):
        return apply_rope(x, cos, sin, interleaved=interleaved)
    return _rotate_pairs(x, cos, sin) if interleaved else _rotate_halves(x, cos, sin)


def rotary_tail_(x: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor, fused: bool = True,
                 in_place: bool = True) -> torch.Tensor:
    """``x [b, s, h, d]`` with its last dims from ``start`` on rotated as interleaved pairs (MLA's queries: the
    RoPE dims after the nope dims). Where ``fused``, the kernel runs and ``in_place`` (``x`` may be written: not a
    view made inside an ``autograd.Function``), rotated where they sit in ``x`` (``fused_ops.rope_``: no second
    copy to join both parts) and ``x`` returned; else a new tensor ``cat[x[..., :start], rotary(x[..., start:])]``."""
    if fused and in_place and kernels_run(x.device):
        rope_(x[..., start:], cos, sin)
        return x
    head, tail = x.split([start, x.shape[-1] - start], dim=-1)
    return torch.cat([head, rotary(tail, cos, sin, fused=fused)], dim=-1)


class Permuted(NamedTuple):
    x_grouped: torch.Tensor  # [M, d]: each token once per chosen expert, expert-contiguous, pad rows 0
    m_indices: torch.Tensor  # [M] int32: expert of each row, -1 on padding
    rows: torch.Tensor  # [T * k]: row of assignment (t, j), at index t * k + j
    tokens_per_expert: torch.Tensor  # [E] int64, unpadded
    layout: Grouping | None  # the kernels' layout where they moved the rows (``unpermute`` takes it), else None


def permute_tokens(x: torch.Tensor, indices: torch.Tensor, num_experts: int, alignment: int,
                   fused: bool = True) -> Permuted:
    """Tokens ``x [T, d]`` copied once per chosen expert (``indices [T, k]``) into expert blocks padded to
    ``alignment`` rows (DeepGEMM's contiguous layout): ``fused_ops.permute`` (one kernel each way) where ``fused``
    and it runs, else one torch gather (the same layout and values)."""
    if fused and kernels_run(x.device):
        layout = grouping(indices, num_experts, alignment)
        return Permuted(permute(x, layout)[0], layout.m_indices, layout.rows, layout.tokens_per_expert, layout)
    num_tokens, k = indices.shape
    flat = indices.reshape(-1)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + alignment - 1) // alignment * alignment
    group_start = padded.cumsum(0) - padded
    order = flat.argsort(stable=True)
    sorted_experts = flat[order]
    rank_in_expert = torch.arange(flat.numel(), device=flat.device) - (counts.cumsum(0) - counts)[sorted_experts]
    rows = torch.empty_like(flat)
    rows[order] = group_start[sorted_experts] + rank_in_expert
    total = padded.sum().item()
    # at least one row per assignment: a compiled graph then knows the grouped buffer is never empty
    torch._check(total >= flat.numel())
    m_indices = torch.full((total,), -1, dtype=torch.int32, device=x.device)
    m_indices[rows] = flat.to(torch.int32)
    # one gather from x plus a zero row (index num_tokens) for the padding: fewer passes forward and backward on a
    # CPU than scattering gathered rows into a zero buffer
    source = torch.full((total,), num_tokens, dtype=torch.long, device=x.device)
    source[rows] = torch.arange(num_tokens, device=x.device).repeat_interleave(k)
    x_grouped = torch.cat([x, x.new_zeros(1, x.shape[-1])])[source]
    return Permuted(x_grouped, m_indices, rows, counts, None)


def send_layout(order: torch.Tensor, rows: torch.Tensor, num_sent: int, send_counts: torch.Tensor, num_tokens: int,
                k: int, fused: bool = True) -> Grouping | None:
    """Expert parallelism's send plan (assignments ``order``ed by expert, ``rows`` the sent row of each, the first
    ``num_sent`` sent) in the kernels' form, where ``fused`` and they run: the sender then gathers (or packs) its rows
    with ``gather_rows`` / ``pack_rows_fp8`` and the receiver regroups with their kernels. None: the torch path."""
    if not (fused and kernels_run(order.device)):
        return None
    # (the sent rows feed no grouped GEMM: no m_indices)
    return Grouping(rows=torch.where(rows < num_sent, rows, -1), assign=order[:num_sent],
                    m_indices=order.new_empty(0, dtype=torch.int32), tokens_per_expert=send_counts,
                    num_tokens=num_tokens, k=k)
