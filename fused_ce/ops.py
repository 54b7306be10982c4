"""The fused cross-entropy's two kernel ops, registered with ``accel.registry`` (Triton + PyTorch reference) and
fronted by the custom ops ``torch.ops.dsv3.cross_entropy_forward`` / ``_backward`` (docs/custom_ops.md).

``cross_entropy_forward(logits [rows, vocab], targets [rows], ignore_index) -> (loss [rows], lse [rows])``
``cross_entropy_backward(logits, targets, lse, scale, ignore_index) -> grad_logits [rows, vocab]``

fp32 results for fp32/bf16 logits (float64 logits: float64, reference only, for exact tests).
``scale`` is a 0-d tensor (the upstream gradient over the number of counted targets for a mean), so
no host synchronisation is needed. Rows whose target is ``ignore_index`` give loss 0 and gradient 0.
The forward op's autograd is the backward op (scale 1) times each row's upstream gradient.
"""

from __future__ import annotations

import torch

from accel import registry
from accel.registry import Case, VerifySpec

FORWARD = "fused_ce.cross_entropy_forward"
BACKWARD = "fused_ce.cross_entropy_backward"


@registry.reference_for(FORWARD)
def cross_entropy_forward_reference(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100):
    x = logits.to(accumulation_dtype(logits.dtype))
    lse = torch.logsumexp(x, dim=-1)
    valid = targets != ignore_index
    picked = x.gather(1, torch.where(valid, targets, 0).unsqueeze(1)).squeeze(1)
    return torch.where(valid, lse - picked, 0.0), lse


@registry.reference_for(BACKWARD)
def cross_entropy_backward_reference(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                                     scale: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    valid = targets != ignore_index
    # minus 1 at the target column, 0 elsewhere (x - 0 is x): no data-dependent shapes, so it runs on fake tensors
    onehot = torch.arange(logits.shape[1], device=logits.device) == torch.where(valid, targets, -1).unsqueeze(1)
    grad = torch.exp(logits.to(lse.dtype) - lse.unsqueeze(1)) - onehot.to(lse.dtype)
    return grad * torch.where(valid, scale.to(grad.dtype), 0.0).unsqueeze(1)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp32 and narrower logits, float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def _forward_triton(logits, targets, ignore_index=-100):
    from fused_ce.kernels import cross_entropy_forward

    return cross_entropy_forward(logits, targets, ignore_index)


def _backward_triton(logits, targets, lse, scale, ignore_index=-100):
    from fused_ce.kernels import cross_entropy_backward

    return cross_entropy_backward(logits, targets, lse, scale, ignore_index)


def _inputs(shape: dict, seed: int, device: torch.device):
    g = torch.Generator().manual_seed(seed)
    rows, vocab = shape["rows"], shape["vocab"]
    logits = torch.randn(rows, vocab, generator=g) * 4  # spread: softmax far from uniform
    targets = torch.randint(0, vocab, (rows,), generator=g)
    targets[::3] = -100  # ignored rows
    dtype = getattr(torch, shape.get("dtype", "float32"))
    return logits.to(device=device, dtype=dtype), targets.to(device)


def _forward_case(shape: dict, seed: int, device: torch.device) -> Case:
    logits, targets = _inputs(shape, seed, device)
    return Case(args=(logits, targets), kwargs={"ignore_index": -100})


def _backward_case(shape: dict, seed: int, device: torch.device) -> Case:
    logits, targets = _inputs(shape, seed, device)
    _, lse = cross_entropy_forward_reference.__wrapped__(logits, targets)
    scale = torch.tensor(1.0 / max(1, int((targets != -100).sum())), device=device)
    return Case(args=(logits, targets, lse, scale), kwargs={"ignore_index": -100})


# Shapes: a vocab that is not a multiple of the column block, one smaller than it, and (bench) V3's.
# Tolerance: fp32 exp/log and sums over <= 1000 columns in another order than torch's: calc_diff
# ~1e-14; 1e-10 still flags a wrong column, row or mask (those are > 1e-3).
_SHAPES = [dict(rows=7, vocab=1000), dict(rows=4, vocab=300, dtype="bfloat16"), dict(rows=3, vocab=17)]
_BENCH = [dict(rows=512, vocab=129280), dict(rows=2048, vocab=129280, dtype="bfloat16")]


def _bytes(shape: dict, passes: float) -> float:
    return shape["rows"] * shape["vocab"] * (2 if shape.get("dtype") == "bfloat16" else 4) * passes


cross_entropy_forward_op = registry.register(
    FORWARD, reference=cross_entropy_forward_reference, triton=_forward_triton,
    verify=VerifySpec(make_case=_forward_case, shapes=_SHAPES, bench_shapes=_BENCH, tolerance=1e-10,
                      bytes_moved=lambda s: _bytes(s, 1.0)))
cross_entropy_backward_op = registry.register(
    BACKWARD, reference=cross_entropy_backward_reference, triton=_backward_triton,
    verify=VerifySpec(make_case=_backward_case, shapes=_SHAPES, bench_shapes=_BENCH, tolerance=1e-10,
                      bytes_moved=lambda s: _bytes(s, 1.0) + s["rows"] * s["vocab"] * 4))


@registry.torch_op(cross_entropy_backward_op)
def cross_entropy_backward(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor,
                           ignore_index: int = -100) -> torch.Tensor:
    return cross_entropy_backward_op(logits, targets, lse, scale, ignore_index)


def _forward_setup(ctx, inputs, output) -> None:
    logits, targets, ignore_index = inputs
    ctx.save_for_backward(logits, targets, output[1])
    ctx.ignore_index = ignore_index


def _forward_backward(ctx, grad_loss: torch.Tensor, grad_lse: torch.Tensor | None):
    logits, targets, lse = ctx.saved_tensors
    one = torch.ones((), dtype=lse.dtype, device=lse.device)
    grad = cross_entropy_backward(logits, targets, lse, one, ctx.ignore_index) * grad_loss.unsqueeze(1)
    if grad_lse is not None:  # d lse / d logits is the softmax
        grad = grad + torch.exp(logits.to(lse.dtype) - lse.unsqueeze(1)) * grad_lse.unsqueeze(1)
    return grad.to(logits.dtype), None, None


@registry.torch_op(cross_entropy_forward_op, backward=_forward_backward, setup_context=_forward_setup)
def cross_entropy_forward(logits: torch.Tensor, targets: torch.Tensor,
                          ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    return cross_entropy_forward_op(logits, targets, ignore_index)
