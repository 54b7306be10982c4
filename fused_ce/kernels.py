"""Triton kernels of the fused cross-entropy: one program per row of a ``[rows, vocab]`` logits chunk.

Both are memory-bound passes over the row in ``BLOCK`` columns: the forward keeps an online max and
sum of exponentials (log-sum-exp, as a flash-attention softmax), the backward writes
``(softmax - onehot(target)) * scale`` from the saved log-sum-exp. Math in fp32 whatever the logits'
dtype; a row whose target is ``ignore_index`` gets loss 0 and gradient 0. Launched through ``wrap_triton`` so
that ``torch.compile`` sees into the ``torch.ops.dsv3`` ops around them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from accel import registry

BLOCK = 1024


@triton.jit
def _forward_kernel(LOGITS, TARGETS, LOSS, LSE, V, stride, ignore_index, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ptr = LOGITS + row * stride
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    target = tl.load(TARGETS + row)
    valid = target != ignore_index
    x_t = tl.load(ptr + tl.where(valid, target, 0)).to(tl.float32)
    tl.store(LOSS + row, tl.where(valid, lse - x_t, 0.0))
    tl.store(LSE + row, lse)


@triton.jit
def _backward_kernel(LOGITS, TARGETS, LSE, SCALE, GRAD, V, stride, stride_g, ignore_index, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(TARGETS + row)
    scale = tl.where(target != ignore_index, tl.load(SCALE), 0.0)
    lse = tl.load(LSE + row)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(LOGITS + row * stride + cols, mask=cols < V, other=0.0).to(tl.float32)
        g = (tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)) * scale
        tl.store(GRAD + row * stride_g + cols, g, mask=cols < V)


def _check_rows(logits: torch.Tensor) -> None:
    if logits.stride(-1) != 1:
        raise registry.Unsupported("logits rows must be contiguous (unit column stride)")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise registry.Unsupported(f"logits must be float32/bfloat16/float16, got {logits.dtype}")


def cross_entropy_forward(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int):
    _check_rows(logits)
    rows, vocab = logits.shape
    loss = registry.empty(rows, dtype=torch.float32, device=logits.device)
    lse = registry.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        registry.wrap_triton(_forward_kernel)[(rows,)](logits, targets, loss, lse, vocab, logits.stride(0),
                                                       ignore_index, BLOCK=min(BLOCK, triton.next_power_of_2(vocab)))
    return loss, lse


def cross_entropy_backward(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor,
                           ignore_index: int) -> torch.Tensor:
    _check_rows(logits)
    rows, vocab = logits.shape
    grad = registry.empty(rows, vocab, dtype=torch.float32, device=logits.device)
    if rows:
        registry.wrap_triton(_backward_kernel)[(rows,)](logits, targets, lse, scale, grad, vocab, logits.stride(0),
                                                        grad.stride(0), ignore_index,
                                                        BLOCK=min(BLOCK, triton.next_power_of_2(vocab)))
    return grad
