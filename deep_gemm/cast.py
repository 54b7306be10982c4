"""FP8 casts with DeepGEMM's names: 1x128 per-token, 128x1 per-channel and 128x128 per-block scales."""

from __future__ import annotations

import torch

from accel import registry
from accel.registry import Case, VerifySpec
from deep_gemm import reference
from deep_gemm.utils import FP8, calc_diff

_FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16)


def _triton(tile_rows: int, tile_cols: int):
    def run(x: torch.Tensor, use_ue8m0: bool = False):
        from deep_gemm.kernels import cast

        return cast.cast_tiles(x, tile_rows, tile_cols, use_ue8m0)

    return run


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
                               triton=_triton(1, 128), verify=_spec())
_per_channel = registry.register("deep_gemm.per_channel_cast_to_fp8",
                                 reference=reference.per_channel_cast_reference, triton=_triton(128, 1), verify=_spec())
_per_block = registry.register("deep_gemm.per_block_cast_to_fp8", reference=reference.per_block_cast_reference,
                               triton=_triton(128, 128), verify=_spec())


def _check(name: str, x: object, dims: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOAT_INPUTS:
        got = str(x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a float32/bfloat16/float16 tensor, got {got}")
    if x.dim() not in dims:
        raise ValueError(f"{name} must be {' or '.join(f'{d}-D' for d in dims)}, got shape {list(x.shape)}")
    return x


def per_token_cast_to_fp8(x: torch.Tensor, use_ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations: ``x [m, k]`` (or ``[g, m, k]``) -> (e4m3 ``[m, k]``, fp32 scales ``[m, ceil(k/128)]``)."""
    return _per_token(_check("x", x, (2, 3)), use_ue8m0)


def per_channel_cast_to_fp8(x: torch.Tensor, use_ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduction along rows (wgrad operands): ``x [k, n]`` -> (e4m3 ``[k, n]``, scales ``[ceil(k/128), n]``)."""
    return _per_channel(_check("x", x, (2, 3)), use_ue8m0)


def per_block_cast_to_fp8(x: torch.Tensor, use_ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights: ``w [n, k]`` (or ``[g, n, k]``) -> (e4m3 ``[n, k]``, scales ``[ceil(n/128), ceil(k/128)]``)."""
    return _per_block(_check("x", x, (2, 3)), use_ue8m0)
