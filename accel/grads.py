"""Where a parameter's gradient lives: ``param.grad``, or an fp32 ``main_grad`` buffer beside a bf16 parameter.

DeepSeek-V3 (report 3.3) and Megatron-Core's distributed optimizer keep BF16 working weights but
accumulate weight gradients in FP32. PyTorch requires ``param.grad`` to have the parameter's dtype,
so ``keep_main_grads`` gives each parameter an fp32 buffer (Megatron's name: ``main_grad``) and a
post-accumulate-grad hook that adds what autograd accumulated into ``.grad`` to the buffer and frees
``.grad``. Everything that reads or updates gradients (reduction, clipping, the optimizer, the
deferred weight-gradient passes that add in place, the mirrored DualPipe copies) goes through
``grad(p)`` / ``accumulate_grad(p, g)``, which fall back to ``p.grad`` for parameters without a buffer,
so a run without the option behaves exactly as before. It lives in the leaf layer because kernel
packages, the model, the pipeline runtime and the trainer all accumulate gradients.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

_BUFFER = "main_grad"


def grad(p: torch.Tensor) -> torch.Tensor | None:
    """The gradient ``p`` accumulates into: its fp32 ``main_grad`` when it has one, else ``p.grad``."""
    return getattr(p, _BUFFER, p.grad)


def has_main_grad(p: torch.Tensor) -> bool:
    return hasattr(p, _BUFFER)


@torch.no_grad()
def accumulate_grad(p: torch.Tensor, g: torch.Tensor) -> None:
    """``grad(p) += g`` as autograd accumulates (a new ``.grad`` when there is none yet).

    Into a ``main_grad`` ``g`` is added in fp32 (a deferred wgrad GEMM's fp32 output keeps its bits).
    Runs under no_grad on a detached gradient: a deferred closure may run while grad mode is on, and a
    gradient must never join a graph (a later in-place add would then fail).
    """
    g = g.detach()
    main = getattr(p, _BUFFER, None)
    if main is not None:
        main.add_(g)
    elif p.grad is None:  # a copy: ``g`` may be a view into a buffer that is reused or kept alive
        p.grad = g.to(p.dtype, memory_format=torch.contiguous_format, copy=True)
    else:
        p.grad.add_(g.to(p.dtype))


@torch.no_grad()
def zero_grad(p: torch.Tensor) -> None:
    """Zero ``grad(p)`` in place, allocating ``.grad`` first for a parameter without a buffer.

    Gradients then always exist as ordinary tensors, so layers that add deferred weight gradients
    themselves add into them in place instead of installing a view made inside a backward pass.
    """
    if has_main_grad(p):
        p.grad = None
        getattr(p, _BUFFER).zero_()
    elif p.grad is None:
        p.grad = torch.zeros_like(p)
    else:
        p.grad.zero_()


def _fold_into_main_grad(p: torch.Tensor) -> None:
    if p.grad is None:  # autograd also runs the hook for an undefined gradient (a backward that returned None)
        return
    with torch.no_grad():
        getattr(p, _BUFFER).add_(p.grad)
    p.grad = None


def keep_main_grads(params: Iterable[torch.Tensor], dtype: torch.dtype = torch.float32) -> None:
    """Give each of ``params`` a zeroed ``dtype`` gradient buffer that autograd's gradients fold into."""
    for p in params:
        if has_main_grad(p):
            continue
        setattr(p, _BUFFER, torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format))
        p.register_post_accumulate_grad_hook(_fold_into_main_grad)
