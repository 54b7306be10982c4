"""FP8 casts with DeepGEMM's names: 1x128 per-token, 128x1 per-channel and 128x128 per-block scales.

``use_ue8m0`` rounds each scale up to a power of two (UE8M0, DeepGEMM's SM100 format); ``gran_k=32`` gives
MXFP8's 1x32 (per-token) or 32x1 (per-channel) blocks, whose scales must be UE8M0; ``use_packed_ue8m0``
(per-token) returns them in DeepGEMM's packed int32 layout (``get_mn_major_tma_aligned_packed_ue8m0_tensor``).
"""

from __future__ import annotations

import torch

from accel import registry
from accel.registry import Case, VerifySpec
from deep_gemm import reference
from deep_gemm.utils import BLOCK, FP8, MX_BLOCK, calc_diff, get_mn_major_tma_aligned_packed_ue8m0_tensor

_FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16)


def _make_case(shape: dict, seed: int, device: torch.device) -> Case:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(shape["m"], shape["k"], generator=gen) * torch.exp(torch.randn(shape["m"], 1, generator=gen))
    x[0, :3] = torch.tensor([124.3, -0.001, 448.0])  # a carry into the exponent, a subnormal, the max
    return Case(args=(x.to(device=device, dtype=shape.get("dtype", torch.bfloat16)),))


def _compare(got, want) -> dict[str, tuple[float, float]]:
    """The fp8 values and scales must match the reference bit for bit (both round to nearest even)."""
    out = {}
    for name in got:
        g, w = got[name], want[name]
        if g.dtype == FP8:
            bad = (g.view(torch.uint8) != w.view(torch.uint8)).float().mean().item()
            out[name] = (bad, 0.0)
        else:
            out[name] = (calc_diff(g, w), 1e-12)  # scales: same amax/448 in fp32
    return out


def _spec() -> VerifySpec:
    return VerifySpec(
        make_case=_make_case,
        shapes=[{"m": 1, "k": 128}, {"m": 64, "k": 256}, {"m": 129, "k": 256, "dtype": torch.float32},
                {"m": 256, "k": 128}],
        bench_shapes=[{"m": 4096, "k": 7168}, {"m": 4096, "k": 2048}, {"m": 7168, "k": 16384}],
        tolerance=0.0,
        compare=_compare,
        bytes_moved=lambda s: s["m"] * s["k"] * 3.0,  # bf16 in, fp8 out (scales negligible)
    )


_per_token = registry.register("deep_gemm.per_token_cast_to_fp8", reference=reference.per_token_cast_reference,
                               triton="deep_gemm.kernels.cast:per_token_cast", verify=_spec())
_per_channel = registry.register("deep_gemm.per_channel_cast_to_fp8",
                                 reference=reference.per_channel_cast_reference,
                                 triton="deep_gemm.kernels.cast:per_channel_cast", verify=_spec())
_per_block = registry.register("deep_gemm.per_block_cast_to_fp8", reference=reference.per_block_cast_reference,
                               triton="deep_gemm.kernels.cast:per_block_cast", verify=_spec())


# The torch ops (docs/custom_ops.md); no autograd: e4m3 values carry no gradient.
@registry.torch_op(_per_token)
def _per_token_op(x: torch.Tensor, use_ue8m0: bool = False, gran_k: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    return _per_token(x, use_ue8m0, gran_k)


@registry.torch_op(_per_channel)
def _per_channel_op(x: torch.Tensor, use_ue8m0: bool = False,
                    gran_k: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    return _per_channel(x, use_ue8m0, gran_k)


@registry.torch_op(_per_block)
def _per_block_op(x: torch.Tensor, use_ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return _per_block(x, use_ue8m0)


def _check(name: str, x: object, dims: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOAT_INPUTS:
        got = str(x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a float32/bfloat16/float16 tensor, got {got}")
    if x.dim() not in dims:
        raise ValueError(f"{name} must be {' or '.join(f'{d}-D' for d in dims)}, got shape {list(x.shape)}")
    return x


def _check_gran(gran_k: object, use_ue8m0: bool) -> int:
    if gran_k not in (BLOCK, MX_BLOCK):
        raise ValueError(f"gran_k must be {BLOCK} (DeepSeek-V3's blocks) or {MX_BLOCK} (MXFP8), got {gran_k!r}")
    if gran_k == MX_BLOCK and not use_ue8m0:
        raise ValueError(f"gran_k={MX_BLOCK} (MXFP8) needs use_ue8m0=True: its scales are powers of two")
    return gran_k


def per_token_cast_to_fp8(x: torch.Tensor, use_ue8m0: bool = False, gran_k: int = BLOCK,
                          use_packed_ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations: ``x [m, k]`` (or ``[g, m, k]``) -> (e4m3 ``[m, k]``, fp32 scales ``[m, ceil(k/gran_k)]``).

    ``use_packed_ue8m0`` (needs ``use_ue8m0``): scales as DeepGEMM's packed int32 ``[m, ceil(k/gran_k/4)]``."""
    _check_gran(gran_k, use_ue8m0)
    if use_packed_ue8m0 and not use_ue8m0:
        raise ValueError("use_packed_ue8m0=True needs use_ue8m0=True (only power-of-two scales pack into bytes)")
    q, sf = _per_token_op(_check("x", x, (2, 3)), use_ue8m0, gran_k)
    return (q, get_mn_major_tma_aligned_packed_ue8m0_tensor(sf)) if use_packed_ue8m0 else (q, sf)


def per_channel_cast_to_fp8(x: torch.Tensor, use_ue8m0: bool = False,
                            gran_k: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduction along rows (wgrad operands): ``x [k, n]`` -> (e4m3 ``[k, n]``, scales ``[ceil(k/gran_k), n]``)."""
    _check_gran(gran_k, use_ue8m0)
    return _per_channel_op(_check("x", x, (2, 3)), use_ue8m0, gran_k)


def per_block_cast_to_fp8(x: torch.Tensor, use_ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights: ``w [n, k]`` (or ``[g, n, k]``) -> (e4m3 ``[n, k]``, scales ``[ceil(n/128), ceil(k/128)]``)."""
    return _per_block_op(_check("x", x, (2, 3)), use_ue8m0)
