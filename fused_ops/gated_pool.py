"""DeepSeek-V4's compressor pool as ``torch.ops.dsv3`` ops: overlapping windows pooled by a softmax gate.

Every ``ratio`` (m) tokens close a compressed entry. ``kv`` and ``score`` are the compressor's two projections of
the tokens, ``[b, n m, c d]`` (c = 2 with overlap, CSA's ratio 4; c = 1 for HCA), ``ape [m, c d]`` a learned bias
per position in the window. Entry ``i`` pools, per column, the softmax over its window's rows of
``score + ape`` times ``kv``; with overlap the window is window ``i-1``'s first ``d`` columns (Ca) stacked on
window ``i``'s last ``d`` (Cb): 2m tokens, stride m, entry 0's Ca rows padding (weight 0).

Fused, the pool reads ``kv`` and ``score`` once and writes the entries (``docs/v4_kernels.md`` counts the bytes
against the unfused sequence); its backward writes ``d kv`` and ``d score`` once each, ``d ape`` being
``d score`` summed over windows and batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from accel import registry
from accel.registry import Case, VerifySpec

OP, BWD_OP = "fused_ops.gated_pool", "fused_ops.gated_pool_backward"


def _windows(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, ratio: int, overlap: bool
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """kv and ``score + ape`` as windows ``[b, n, W, d]`` (the model's lines; padding kv 0, score -inf)."""
    n, d = kv.shape[1] // ratio, kv.shape[2] // (2 if overlap else 1)
    kv, score = kv.unflatten(1, (n, ratio)), score.unflatten(1, (n, ratio)) + ape
    if overlap:
        kv = torch.cat([F.pad(kv[:, :-1, :, :d], (0, 0, 0, 0, 1, 0)), kv[:, :, :, d:]], dim=2)
        first = F.pad(score[:, :-1, :, :d], (0, 0, 0, 0, 1, 0), value=float("-inf"))
        score = torch.cat([first, score[:, :, :, d:]], dim=2)
    return kv, score


@registry.reference_for(OP)
def gated_pool_reference(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, ratio: int,
                         overlap: bool) -> torch.Tensor:
    """``[b, n m, c d]`` -> ``[b, n, d]`` in kv's dtype: softmax in fp32, weights and products in kv's dtype."""
    kv, score = _windows(kv, score, ape, ratio, overlap)
    return (kv * score.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2)


@registry.reference_for(BWD_OP)
def gated_pool_backward_reference(grad: torch.Tensor, kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor,
                                  ratio: int, overlap: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(d kv, d score) in fp32 math, written out: ``dkv = p dout``, ``dscore = p dout (kv - out)``, each window
    row's gradient put back where the row came from (the last window's Ca rows, read by no entry, get 0)."""
    b, t, cd = kv.shape
    n, d = t // ratio, cd // (2 if overlap else 1)
    kvw, sw = _windows(kv.float(), score, ape, ratio, overlap)
    p = sw.float().softmax(dim=2)
    dout = grad.float().unsqueeze(2)
    dkvw = p * dout
    dsw = dkvw * (kvw - (p * kvw).sum(dim=2, keepdim=True))
    dkv, ds = (torch.zeros(b, n, ratio, cd, device=kv.device) for _ in range(2))
    for full, win in ((dkv, dkvw), (ds, dsw)):
        if overlap:
            full[:, :, :, d:] = win[:, :, ratio:]
            full[:, :-1, :, :d] = win[:, 1:, :ratio]
        else:
            full.copy_(win)
    return dkv.flatten(1, 2).to(kv.dtype), ds.flatten(1, 2).to(score.dtype)


def _inputs(shape: dict, seed: int, device: torch.device):
    g = torch.Generator().manual_seed(seed)
    b, n, m, d, overlap = shape["b"], shape["n"], shape["m"], shape["d"], shape["m"] == 4
    cd = d * (2 if overlap else 1)
    dtype = getattr(torch, shape.get("dtype", "float32"))
    kv = torch.randn(b, n * m, cd, generator=g).to(dtype)
    score = (torch.randn(b, n * m, cd, generator=g) * 2).to(dtype)
    ape = torch.randn(m, cd, generator=g)  # fp32: the release keeps position biases in fp32
    return kv.to(device), score.to(device), ape.to(device), m, overlap


def _make_case(shape: dict, seed: int, device: torch.device) -> Case:
    return Case(args=_inputs(shape, seed, device))


def _make_bwd_case(shape: dict, seed: int, device: torch.device) -> Case:
    kv, score, ape, m, overlap = _inputs(shape, seed, device)
    grad = torch.randn(kv.shape[0], kv.shape[1] // m, shape["d"], generator=torch.Generator().manual_seed(seed + 1))
    return Case(args=(grad.to(device=device, dtype=kv.dtype), kv, score, ape, m, overlap))


def pool_bytes(shape: dict, backward: bool = False) -> float:
    """Bytes the fused kernel moves: kv and score read (and their gradients written), the entries written (read)."""
    b, n, m, d = shape["b"], shape["n"], shape["m"], shape["d"]
    size = torch.tensor([], dtype=getattr(torch, shape.get("dtype", "float32"))).element_size()
    rows = b * n * m * d * (2 if m == 4 else 1)
    return size * ((4 if backward else 2) * rows + b * n * d)


# CSA (ratio 4, overlap) and HCA (ratio 128) with odd widths past the 32-column block, fp32 and bf16, one entry.
_SHAPES = [dict(b=2, n=5, m=4, d=40), dict(b=1, n=3, m=128, d=24), dict(b=2, n=1, m=4, d=64, dtype="bfloat16"),
           dict(b=1, n=4, m=4, d=33, dtype="bfloat16")]
# V4-Flash at 4K: the CSA compressor (d 512) and its indexer's (d 128), the HCA compressor
_BENCH = [dict(b=1, n=1024, m=4, d=512, dtype="bfloat16"), dict(b=1, n=1024, m=4, d=128, dtype="bfloat16"),
          dict(b=1, n=32, m=128, d=512, dtype="bfloat16")]

gated_pool_op = registry.register(
    OP, reference=gated_pool_reference, triton="fused_ops.kernels.gated_pool:gated_pool",
    # the reference's rounding points kept; fp32: the sum's order only (calc_diff ~1e-15); bf16: an entry may
    # round the other way after a differently ordered fp32 sum (1 bf16 ulp, calc_diff <~1e-6)
    verify=VerifySpec(make_case=_make_case, shapes=_SHAPES, bench_shapes=_BENCH, tolerance=1e-5,
                      bytes_moved=pool_bytes),
)
gated_pool_backward_op = registry.register(
    BWD_OP, reference=gated_pool_backward_reference, triton="fused_ops.kernels.gated_pool:gated_pool_backward",
    # fp32 math both sides, one rounding to the inputs' dtype (bf16: calc_diff ~1e-6)
    verify=VerifySpec(make_case=_make_bwd_case, shapes=_SHAPES, bench_shapes=_BENCH, tolerance=1e-5,
                      bytes_moved=lambda s: pool_bytes(s, backward=True)),
)


@registry.torch_op(gated_pool_backward_op)
def _gated_pool_backward_torch_op(grad: torch.Tensor, kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor,
                                  ratio: int, overlap: bool) -> tuple[torch.Tensor, torch.Tensor]:
    dkv, ds = gated_pool_backward_op(grad, kv, score, ape, ratio, overlap)
    return dkv.contiguous(), ds.contiguous()


def _grads(grad: torch.Tensor, kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, ratio: int,
           overlap: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d kv, d score, d ape) from the inputs: the weights are recomputed, never kept."""
    dkv, ds = _gated_pool_backward_torch_op(grad, kv, score, ape, ratio, overlap)
    dape = ds.float().unflatten(1, (-1, ratio)).sum(dim=(0, 1)).to(ape.dtype)  # ape is added to every window
    return dkv, ds, dape


@registry.torch_op(gated_pool_op, recompute=_grads)
def _gated_pool_torch_op(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, ratio: int,
                         overlap: bool) -> torch.Tensor:
    return gated_pool_op(kv, score, ape, ratio, overlap)


def gated_pool(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, ratio: int, overlap: bool) -> torch.Tensor:
    """V4's compressor pool, differentiable in ``kv``, ``score`` and ``ape``: ``kv``, ``score [b, n ratio, c d]``
    (c = 2 when ``overlap``), ``ape [ratio, c d]`` -> entries ``[b, n, d]`` in kv's dtype (module docstring)."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 3:
        raise ValueError(f"gated_pool: kv must be a 3-d tensor [b, n * ratio, c * d], got "
                         f"{tuple(getattr(kv, 'shape', ()))}")
    if ratio < 1 or kv.shape[1] % ratio:
        raise ValueError(f"gated_pool: kv's token count {kv.shape[1]} must be a multiple of ratio={ratio}")
    if overlap and kv.shape[2] % 2:
        raise ValueError(f"gated_pool: with overlap kv's last dim must be even (Ca, Cb), got {kv.shape[2]}")
    if score.shape != kv.shape:
        raise ValueError(f"gated_pool: score must have kv's shape {tuple(kv.shape)}, got {tuple(score.shape)}")
    if tuple(ape.shape) != (ratio, kv.shape[2]):
        raise ValueError(f"gated_pool: ape must be [{ratio}, {kv.shape[2]}], got {tuple(ape.shape)}")
    return _gated_pool_torch_op(kv.contiguous(), score.contiguous(), ape.contiguous(), int(ratio), bool(overlap))
