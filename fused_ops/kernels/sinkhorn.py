"""mHC's Sinkhorn mixing matrix, one token's ``hc x hc`` matrix per row of a ``[BLOCK, hc, hc]`` register tile.

Forward: ``softmax(z, -1) + eps``, then a column normalisation and ``iters - 1`` (row, column) pairs, each
``x / (sum + eps)``, in fp32: the model's sequence (``fused_ops.sinkhorn``), read once and written once.

Backward, recomputed in the kernel: one normalisation step ``y = x / (r + eps)`` with ``r`` the sum along its
axis has ``dx = (dy - sum(dy * y)) / (r + eps)``, which needs the step's input ``x``. Keeping the ``2 iters - 1``
intermediate states would take ``(2 iters - 1) hc^2`` fp32 per token in registers (or that much scratch memory
traffic); instead, walking the steps backwards, each step's input is recomputed from the softmax, so the
backward does ``(2 iters - 1) iters`` normalisation steps (780 for 20 iterations, ~40 flops per step and token
for a 4 x 4 matrix) and reads only ``z`` and the output's gradient: compute the backward can afford (the op moves
192 bytes per token) and no memory beyond the inputs and outputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from accel import registry

BLOCK = 64  # tokens per program: 64 x 16 fp32 values, 16 per thread at 4 warps


@triton.jit
def _offsets(T, HC: tl.constexpr, BLOCK: tl.constexpr):
    """Offsets ``[BLOCK, hc, hc]`` of this program's tokens' matrices and their in-range mask."""
    tok = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    i = tl.arange(0, HC)
    offs = tok[:, None, None] * (HC * HC) + i[None, :, None] * HC + i[None, None, :]
    return offs, (tok < T)[:, None, None] & (offs >= 0)


@triton.jit
def _softmax(z):
    """Softmax along the last axis (a matrix's rows), torch's order: exp(z - max) / sum."""
    e = tl.exp(z - tl.expand_dims(tl.max(z, axis=2), 2))
    return e / tl.expand_dims(tl.sum(e, axis=2), 2)


@triton.jit
def _step(x, eps, s):
    """Normalisation step ``s`` of the sequence: even steps divide by column sums (axis 1), odd ones by row sums."""
    if s % 2 == 0:
        x = x / (tl.expand_dims(tl.sum(x, axis=1), 1) + eps)
    else:
        x = x / (tl.expand_dims(tl.sum(x, axis=2), 2) + eps)
    return x


@triton.jit
def _step_backward(g, x, eps, AXIS: tl.constexpr):
    """The gradient of a step's input ``x`` from its output's ``g``: ``(g - sum(g * y)) / (r + eps)`` along AXIS."""
    r = tl.expand_dims(tl.sum(x, axis=AXIS), AXIS) + eps
    return (g - tl.expand_dims(tl.sum(g * (x / r), axis=AXIS), AXIS)) / r


@triton.jit
def _sinkhorn_kernel(Z, OUT, T, eps, STEPS, HC: tl.constexpr, BLOCK: tl.constexpr):
    offs, mask = _offsets(T, HC, BLOCK)
    x = _softmax(tl.load(Z + offs, mask=mask, other=0.0)) + eps
    for s in range(0, STEPS):
        x = _step(x, eps, s)
    tl.store(OUT + offs, x, mask=mask)


@triton.jit
def _sinkhorn_backward_kernel(Z, DY, DZ, T, eps, STEPS, HC: tl.constexpr, BLOCK: tl.constexpr):
    offs, mask = _offsets(T, HC, BLOCK)
    p = _softmax(tl.load(Z + offs, mask=mask, other=0.0))
    g = tl.load(DY + offs, mask=mask, other=0.0)
    for k in range(0, STEPS):
        s = STEPS - 1 - k
        x = p + eps
        for t in range(0, s):  # step s's input, recomputed
            x = _step(x, eps, t)
        if s % 2 == 0:
            g = _step_backward(g, x, eps, 1)
        else:
            g = _step_backward(g, x, eps, 2)
    # d(p + eps) = g; the softmax's backward along the rows
    tl.store(DZ + offs, p * (g - tl.expand_dims(tl.sum(g * p, axis=2), 2)), mask=mask)


def _check(z: torch.Tensor) -> None:
    hc = z.shape[-1]
    if z.dtype != torch.float32 or z.dim() != 3 or z.shape[1] != hc or not z.is_contiguous():
        raise registry.Unsupported(f"logits must be contiguous fp32 [tokens, hc, hc], got {z.dtype} {tuple(z.shape)}")
    if hc & (hc - 1) or hc > 16:
        raise registry.Unsupported(f"hc must be a power of two <= 16, got {hc}")


def sinkhorn(logits: torch.Tensor, eps: float, iters: int) -> torch.Tensor:
    """``[tokens, hc, hc]`` fp32 logits -> the mixing matrices (``fused_ops.sinkhorn``'s reference)."""
    _check(logits)
    out = registry.empty(logits.shape, dtype=torch.float32, device=logits.device)
    if logits.shape[0]:
        grid = (triton.cdiv(logits.shape[0], BLOCK),)
        registry.wrap_triton(_sinkhorn_kernel)[grid](logits, out, logits.shape[0], eps, 2 * iters - 1,
                                                     HC=logits.shape[-1], BLOCK=BLOCK, num_warps=4)
    return out


def sinkhorn_backward(grad: torch.Tensor, logits: torch.Tensor, eps: float, iters: int) -> torch.Tensor:
    """The logits' gradient from the mixing matrices' ``grad``, the states recomputed from ``logits``."""
    _check(logits)
    if grad.dtype != torch.float32 or grad.shape != logits.shape or not grad.is_contiguous():
        raise registry.Unsupported(f"grad must be contiguous fp32 {tuple(logits.shape)}, got {grad.dtype} "
                                   f"{tuple(grad.shape)}")
    dz = registry.empty(logits.shape, dtype=torch.float32, device=logits.device)
    if logits.shape[0]:
        grid = (triton.cdiv(logits.shape[0], BLOCK),)
        registry.wrap_triton(_sinkhorn_backward_kernel)[grid](logits, grad, dz, logits.shape[0], eps, 2 * iters - 1,
                                                              HC=logits.shape[-1], BLOCK=BLOCK, num_warps=4)
    return dz
