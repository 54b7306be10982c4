"""``linear_cross_entropy``: cross-entropy of ``hidden @ weight^T`` without ever holding all the logits.

The output head's logits are ``[tokens, vocab]`` in fp32 (4096 x 129280 x 4 B = 2 GiB per micro-batch
at V3's sizes, plus as much again for their gradient). Here they are computed ``chunk`` rows at a
time: the forward keeps only the per-row log-sum-exp; the backward computes each chunk's logits
again, turns them into the logits' gradient (one fused pass, ``ops.cross_entropy_backward``) and
multiplies it into the hidden-state and weight gradients. Cost: the head GEMM once more; memory: one
chunk of logits and of their gradient, chosen no larger than ``hidden`` itself by default.

Numerics are the plain path's: logits from the GEMM in the inputs' dtype, then fp32 (as
``F.cross_entropy(F.linear(h, w).float(), t)``), the logits' gradient cast back to that dtype.

Both directions are custom ops (``torch.ops.dsv3.linear_cross_entropy`` / ``_backward``, the first with the second
as its registered autograd), so ``torch.compile`` takes the loss whole and never sees a chunk's logits.
"""

from __future__ import annotations

import math

import torch

from accel import registry
from fused_ce.ops import accumulation_dtype, cross_entropy_backward, cross_entropy_forward


def _chunks(rows: int, chunk: int):
    return [(a, min(a + chunk, rows)) for a in range(0, rows, chunk)]


@registry.library_op("dsv3::linear_cross_entropy")
def _linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                          reduction: str, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the loss, each row's log-sum-exp): what the backward needs besides the inputs (the logits are not kept)."""
    acc = accumulation_dtype(hidden.dtype)
    lse = torch.empty(hidden.shape[0], dtype=acc, device=hidden.device)
    total = torch.zeros((), dtype=acc, device=hidden.device)
    w = weight.to(hidden.dtype)
    for a, b in _chunks(hidden.shape[0], chunk):
        loss, lse[a:b] = cross_entropy_forward((hidden[a:b] @ w.T).to(acc), targets[a:b], ignore_index)
        total += loss.sum()
    return (total / (targets != ignore_index).sum().to(acc) if reduction == "mean" else total), lse


@_linear_cross_entropy.register_fake
def _(hidden, weight, targets, ignore_index, reduction, chunk):
    acc = accumulation_dtype(hidden.dtype)
    return hidden.new_empty((), dtype=acc), hidden.new_empty(hidden.shape[0], dtype=acc)


@registry.library_op("dsv3::linear_cross_entropy_backward")
def _linear_cross_entropy_backward(grad_loss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                                   targets: torch.Tensor, lse: torch.Tensor, ignore_index: int, reduction: str,
                                   chunk: int, need_hidden: bool = True,
                                   need_weight: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(d hidden, d weight): each chunk's logits again, their gradient by the fused pass, two GEMMs; a gradient not
    needed is not computed (0 elements)."""
    acc = lse.dtype
    scale = grad_loss.to(acc)
    if reduction == "mean":
        scale = scale / (targets != ignore_index).sum().to(acc)
    w = weight.to(hidden.dtype)
    grad_h = torch.empty_like(hidden) if need_hidden else hidden.new_empty(0)
    # the weight gradient sums over every chunk: accumulated in fp32 (float64 for float64 inputs)
    grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_weight else None
    for a, b in _chunks(hidden.shape[0], chunk):
        logits = (hidden[a:b] @ w.T).to(acc)
        g = cross_entropy_backward(logits, targets[a:b], lse[a:b], scale, ignore_index).to(hidden.dtype)
        del logits
        if need_hidden:
            torch.mm(g, w, out=grad_h[a:b])
        if need_weight:
            grad_w.addmm_(g.T.to(acc), hidden[a:b].to(acc))
    return grad_h, grad_w.to(weight.dtype) if need_weight else weight.new_empty(0)


@_linear_cross_entropy_backward.register_fake
def _(grad_loss, hidden, weight, targets, lse, ignore_index, reduction, chunk, need_hidden=True, need_weight=True):
    return (torch.empty_like(hidden) if need_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if need_weight else weight.new_empty(0))


def _setup_context(ctx, inputs, output) -> None:
    hidden, weight, targets, ignore_index, reduction, chunk = inputs
    ctx.save_for_backward(hidden, weight, targets, output[1])
    ctx.ignore_index, ctx.reduction, ctx.chunk = ignore_index, reduction, chunk


def _backward(ctx, grad_loss: torch.Tensor, _grad_lse: torch.Tensor | None):
    # the log-sum-exp is an internal output (the wrapper returns the loss alone): no gradient flows into it
    hidden, weight, targets, lse = ctx.saved_tensors
    need_h, need_w = ctx.needs_input_grad[:2]
    grad_h, grad_w = _linear_cross_entropy_backward(grad_loss, hidden, weight, targets, lse, ctx.ignore_index,
                                                    ctx.reduction, ctx.chunk, need_h, need_w)
    return grad_h if need_h else None, grad_w if need_w else None, None, None, None, None


_linear_cross_entropy.register_autograd(_backward, setup_context=_setup_context)


def default_chunk(rows: int, dim: int, vocab: int) -> int:
    """Rows per chunk so that a chunk of logits holds no more values than ``hidden`` (rows x dim)."""
    return max(1, min(rows, math.ceil(rows * dim / vocab)))


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         ignore_index: int = -100, reduction: str = "mean", chunk: int | None = None) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight).float(), targets, ignore_index=, reduction=)`` in chunks.

    hidden ``[..., dim]``, weight ``[vocab, dim]`` (the output head), targets ``[...]`` integer class
    ids or ``ignore_index``. ``reduction``: "mean" over the counted targets (NaN when there are none,
    as torch) or "sum". ``chunk``: rows of logits alive at once (default ``default_chunk``).
    """
    if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point() or hidden.dim() < 1:
        raise ValueError(f"linear_cross_entropy: hidden must be a floating-point [..., dim] tensor, got "
                         f"{getattr(hidden, 'dtype', type(hidden).__name__)}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"linear_cross_entropy: weight must be [vocab, {hidden.shape[-1]}] (hidden's last dim), "
                         f"got {list(getattr(weight, 'shape', []))}")
    if not isinstance(targets, torch.Tensor) or targets.is_floating_point() or targets.shape != hidden.shape[:-1]:
        raise ValueError(f"linear_cross_entropy: targets must be an integer tensor of shape {list(hidden.shape[:-1])}"
                         f" (hidden without its last dim), got {getattr(targets, 'dtype', None)} "
                         f"{list(getattr(targets, 'shape', []))}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"linear_cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")
    h = hidden.reshape(-1, hidden.shape[-1])
    chunk = default_chunk(h.shape[0], h.shape[1], weight.shape[0]) if chunk is None else chunk
    if chunk < 1:
        raise ValueError(f"linear_cross_entropy: chunk must be >= 1, got {chunk}")
    return _linear_cross_entropy(h, weight, targets.reshape(-1).long(), ignore_index, reduction, chunk)[0]
