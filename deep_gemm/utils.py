"""Helpers with DeepGEMM's names, and the argument checks every op shares.

The checks turn what DeepGEMM would assert in C++ (or silently compute wrong) into a
``ValueError`` that names the argument and what was expected.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
from collections.abc import Iterator, Sequence

import torch

import accel
from accel.numerics import calc_diff  # noqa: F401 - DeepGEMM public helper, one definition toolkit-wide

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
BLOCK = 128  # scale granularity along K (and along N for 128x128 weight blocks)
MX_BLOCK = 32  # MXFP8 (OCP microscaling): one UE8M0 scale per 32 elements along K
M_ALIGNMENT = 128  # rows per group in the contiguous grouped layout
CHECK_SCALES_ENV = "DSV3_DEEP_GEMM_CHECK_SCALES"

_num_sms: int | None = None
_scale_values_unchecked = 0  # > 0 inside unchecked_scale_values()


def cast_count_row(values: torch.Tensor, underflow: torch.Tensor, subnormal: torch.Tensor, tiles: torch.Tensor,
                   floored: torch.Tensor, hidden: torch.Tensor, log2_amax: torch.Tensor) -> torch.Tensor:
    """The FP8 health report's float64 row ``[values, underflow, subnormal, tiles, floored, hidden, sum log2 amax,
    min, max]`` (``deep_gemm.health.cast_counts``, and the FP4 casts' ``deep_gemm.mxfp4`` counts) from a cast's
    counts and the log2 amax of its tiles holding a nonzero value (min / max +-inf when there is none)."""
    log2 = log2_amax.double()
    big = torch.tensor(float("inf"), dtype=torch.float64, device=log2.device)
    return torch.stack([values.double(), underflow.double(), subnormal.double(), tiles.double(), floored.double(),
                        hidden.double(), log2.sum(), log2.min() if log2.numel() else big,
                        log2.max() if log2.numel() else -big])


def ceil_div(x: int, y: int) -> int:
    return (x + y - 1) // y


def align(x: int, y: int) -> int:
    return ceil_div(x, y) * y




def get_m_alignment_for_contiguous_layout() -> int:
    """Rows per group must be padded to this multiple in the contiguous grouped layout."""
    return M_ALIGNMENT


get_mk_alignment_for_contiguous_layout = get_m_alignment_for_contiguous_layout  # DeepGEMM v2 name


def set_num_sms(num_sms: int) -> None:
    """Cap the streaming multiprocessors the kernels plan for (as DeepGEMM's ``set_num_sms``)."""
    global _num_sms
    if not isinstance(num_sms, int) or num_sms <= 0:
        raise ValueError(f"num_sms must be a positive int, got {num_sms!r}")
    device_sms = _device_sms()
    if device_sms is not None and num_sms > device_sms:
        raise ValueError(f"num_sms={num_sms} exceeds the device's {device_sms} multiprocessors")
    _num_sms = num_sms


def get_num_sms() -> int:
    """The SM count set by ``set_num_sms``, else the device's (``accel.planning_for``'s inside it; 1 on the cpu)."""
    if _num_sms is not None:
        return _num_sms
    return _device_sms() or 1


def _device_sms() -> int | None:
    return accel.device_multiprocessors()


def get_mn_major_tma_aligned_tensor(x: torch.Tensor) -> torch.Tensor:
    """Scale factors in MN-major layout (stride 1 along M/N), as DeepGEMM's SM90 kernels want.

    Our Triton kernels read scales through their strides, so any layout works; we still return
    the MN-major layout DeepGEMM returns (padding the MN stride to 16 bytes) so code that inspects
    strides sees the same thing. 2-D ``[mn, k]`` or 3-D ``[g, mn, k]``.
    """
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be 2-D [mn, k] or 3-D [g, mn, k], got shape {tuple(x.shape)}")
    mn, k = x.shape[-2:]
    aligned_mn = align(mn, max(1, 16 // x.element_size()))
    if x.stride(-2) == 1 and x.stride(-1) == aligned_mn and (x.dim() == 2 or x.stride(0) == aligned_mn * k):
        return x
    out = torch.empty((*x.shape[:-2], k, aligned_mn), dtype=x.dtype, device=x.device)
    out[..., :mn].copy_(x.transpose(-1, -2))
    return out[..., :mn].transpose(-1, -2)


# ---------------------------------------------------------------- UE8M0 scales (power-of-two, SM100 / MXFP8)


def ceil_to_ue8m0(sf: torch.Tensor) -> torch.Tensor:
    """Round positive fp32 scales up to a power of two on the bits (DeepGEMM's ``use_ue8m0``): the exponent, plus
    one when any mantissa bit is set. Exact, unlike ``exp2(ceil(log2(x)))``, whose fp32 log2 can round
    ``2^k (1 + 2^-23)`` down to ``k``. Rounding a scale up never pushes ``x / scale`` past e4m3's 448."""
    bits = sf.float().contiguous().view(torch.int32)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exp.clamp(1, 254) << 23).view(torch.float32)


def is_ue8m0(sf: torch.Tensor) -> bool:
    """Whether every fp32 value is a positive finite power of two (a UE8M0 scale)."""
    bits = sf.float().contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    return bool(((bits & 0x807FFFFF) == 0).all() & (exp > 0).all() & (exp < 255).all())


def get_mn_major_tma_aligned_packed_ue8m0_tensor(sf: torch.Tensor) -> torch.Tensor:
    """DeepGEMM's SM100 scale layout: fp32 power-of-two scales ``[(g,) mn, sf_k]`` -> int32 ``[(g,) mn, ceil(sf_k/4)]``
    holding four UE8M0 exponent bytes each (byte j of column i: scale ``4i + j``; padding bytes 0), MN-major
    (stride 1 along mn, mn padded to 4 for TMA's 16-byte alignment). Same name and layout as upstream."""
    if not isinstance(sf, torch.Tensor) or sf.dtype != torch.float32 or sf.dim() not in (2, 3):
        raise ValueError(f"sf must be a 2-D or 3-D float32 scale tensor, got {getattr(sf, 'dtype', type(sf).__name__)}"
                         f" {list(getattr(sf, 'shape', []))}")
    if sf.numel() and not is_ue8m0(sf):
        raise ValueError("sf must hold powers of two (UE8M0 scales: cast with use_ue8m0=True)")
    return _pack_ue8m0(sf)


def _pack_ue8m0(sf: torch.Tensor) -> torch.Tensor:
    *batch, mn, sf_k = sf.shape
    packed_k = ceil_div(sf_k, 4)
    exps = ((sf.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    exps = torch.nn.functional.pad(exps, (0, packed_k * 4 - sf_k))
    packed = exps.view(torch.int32)  # little-endian: byte j is the low byte shifted by 8 j, on CPUs and GPUs alike
    aligned_mn = align(mn, 4)
    out = torch.empty((*batch, packed_k, aligned_mn), dtype=torch.int32, device=sf.device)
    out[..., :mn].copy_(packed.transpose(-1, -2))
    return out[..., :mn].transpose(-1, -2)


def unpack_ue8m0(packed: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of the packing along the last dim: int32 ``[..., ceil(count/4)]`` -> fp32 ``[..., count]`` scales."""
    shifts = torch.arange(0, 32, 8, dtype=torch.int32, device=packed.device)
    exps = (packed.unsqueeze(-1) >> shifts) & 0xFF
    return (exps.reshape(*packed.shape[:-1], -1)[..., :count].contiguous() << 23).view(torch.float32)


def kernel_scales(name: str, sf: object, k: int, k_dim: int, gran_k: int | None) -> tuple[object, bool]:
    """A public FP8 op's scale tensor in one of the two forms the kernels read, and whether it is MXFP8.

    fp32 with ``k/128`` entries along ``k_dim``: blockwise, as is. fp32 with ``k/32``: MXFP8, packed into
    DeepGEMM's int32 layout (values must be powers of two). int32 (already packed): MXFP8 when ``gran_k`` (the
    recipe's K granularity) is 32, else 1x128 UE8M0 scales (DeepGEMM's SM100 blockwise format), unpacked to fp32.
    Both forms have ``k/128`` entries along K. Anything else is returned unchanged for the shape check to name.
    """
    if not isinstance(sf, torch.Tensor) or sf.dim() == 0 or not k or k % BLOCK:
        return sf, False
    along_k = sf.shape[k_dim]
    moved = sf.movedim(k_dim, -1)
    if sf.dtype == torch.int32:
        if gran_k == MX_BLOCK:
            if sf.numel() and scale_values_checked(sf) and not is_ue8m0(unpack_ue8m0(moved, k // MX_BLOCK)):
                raise ValueError(f"{name}: packed UE8M0 exponents must lie in 1..254 (finite, non-zero scales)")
            return sf, True
        if along_k != ceil_div(k // BLOCK, 4):
            raise ValueError(f"{name}: packed UE8M0 scales with 1x{BLOCK} blocks must have {ceil_div(k // BLOCK, 4)} "
                             f"int32 along K = {k}, got {along_k} (MXFP8's 1x32 scales need recipe=(1, 1, 32))")
        return unpack_ue8m0(moved, k // BLOCK).movedim(-1, k_dim), False
    if sf.dtype == torch.float32 and along_k == k // MX_BLOCK:
        if scale_values_checked(sf) and not is_ue8m0(sf):
            raise ValueError(f"{name}: MXFP8 (1x32) scales must be powers of two (cast with use_ue8m0=True)")
        return _pack_ue8m0(moved).movedim(-1, k_dim), True
    return sf, False


def recipe_gran_k(recipe: object) -> int | None:
    """K granularity of a DeepGEMM ``recipe`` (``(1, 128, 128)``, ``(1, 1, 32)``...); None when none is given."""
    if recipe is None:
        return None
    if not (isinstance(recipe, (tuple, list)) and len(recipe) in (2, 3) and all(isinstance(r, int) for r in recipe)
            and recipe[-1] in (BLOCK, MX_BLOCK)):
        raise ValueError(f"recipe must be a tuple of ints ending in the K granularity {BLOCK} or {MX_BLOCK}, "
                         f"e.g. (1, 128, 128) or (1, 1, 32), got {recipe!r}")
    return recipe[-1]


def check_mx_pair(sfa_mx: bool, sfb_mx: bool, sfb_rows: int, b_rows: int) -> None:
    """MXFP8 scales both operands per row along K (1x32), or neither."""
    if sfa_mx != sfb_mx:
        raise ValueError("a[1] and b[1] must both be MXFP8 (1x32 UE8M0) scales or both blockwise (1x128 / 128x128), "
                         f"got {'MXFP8' if sfa_mx else 'blockwise'} a and {'MXFP8' if sfb_mx else 'blockwise'} b")
    if sfb_mx and sfb_rows != b_rows:
        raise ValueError(f"b[1]: MXFP8 scales are per row (1x32), need {b_rows} rows of B, got {sfb_rows}")


# ---------------------------------------------------------------- argument checks


def check_tensor(name: str, t: object, dtypes: Sequence[torch.dtype], shape: Sequence[int | None],
                 contiguous: bool = True) -> torch.Tensor:
    """``t`` must be a tensor of one of ``dtypes`` with ``shape`` (None = any size in that dim)."""
    want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    dts = " or ".join(str(d).replace("torch.", "") for d in dtypes)
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a {dts} tensor of shape {want}, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be {dts}, got {str(t.dtype).replace('torch.', '')}")
    if t.dim() != len(shape) or any(s is not None and s != got for s, got in zip(shape, t.shape)):
        raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (row-major {want}); call .contiguous() first")
    return t


def check_scale(name: str, sf: object, shapes: Sequence[Sequence[int | None]]) -> torch.Tensor:
    """Scale factors: float32 (or int32 packed UE8M0), one of ``shapes`` (any strides), every value finite and > 0."""
    if not isinstance(sf, torch.Tensor) or sf.dtype not in (torch.float32, torch.int32):
        got = str(sf.dtype) if isinstance(sf, torch.Tensor) else type(sf).__name__
        raise ValueError(f"{name} must be a float32 (or packed UE8M0 int32) scale tensor, got {got}")
    if not any(sf.dim() == len(s) and all(a is None or a == b for a, b in zip(s, sf.shape)) for s in shapes):
        wants = " or ".join("[" + ", ".join("*" if a is None else str(a) for a in s) + "]" for s in shapes)
        raise ValueError(f"{name} must have shape {wants}, got {list(sf.shape)}")
    if sf.dtype == torch.float32 and sf.numel() and scale_values_checked(sf) and not bool(
            torch.isfinite(sf).all() & (sf > 0).all()):
        raise ValueError(f"{name} holds NaN, Inf or non-positive scales; every scale must be finite and > 0")
    return sf


def scale_values_checked(sf: torch.Tensor) -> bool:
    """Whether to look at scale values (one host sync per call on a GPU).

    On unless ``DSV3_DEEP_GEMM_CHECK_SCALES=0`` (for latency-critical serving), and skipped while a
    CUDA graph is being captured, where a sync is illegal.
    """
    if _scale_values_unchecked or os.environ.get(CHECK_SCALES_ENV, "1") == "0":
        return False
    return not (sf.is_cuda and torch.cuda.is_current_stream_capturing())


@contextlib.contextmanager
def unchecked_scale_values() -> Iterator[None]:
    """Skip the scale value check inside this block (process-wide, so autograd's backward threads too).

    For a training step, whose scales all come from its own casts of its own tensors: there a NaN or Inf
    scale means NaN or Inf data, which must flow to the loss and the gradient norm, where the fault guard
    (``training/fault.py``) sees it and rolls back, as DeepGEMM's kernels would let it flow, instead of
    stopping the run with an argument error (and a host sync per GEMM on a GPU)."""
    global _scale_values_unchecked
    _scale_values_unchecked += 1
    try:
        yield
    finally:
        _scale_values_unchecked -= 1


def unpack_pair(name: str, pair: object) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
        raise ValueError(f"{name} must be a (fp8 tensor, float32 scales) pair, got {type(pair).__name__}")
    return pair[0], pair[1]


def check_k(name: str, k: int) -> None:
    if k % BLOCK:
        raise ValueError(f"{name}: K={k} must be a multiple of {BLOCK} (the scale block along K)")


def check_out(d: object, shape: Sequence[int], c: torch.Tensor | None, dtypes=(torch.bfloat16, torch.float32)):
    """The output ``d`` (and the optional accumulator ``c``): same shape, same dtype, contiguous."""
    check_tensor("d", d, dtypes, shape)
    if c is not None:
        check_tensor("c", c, (d.dtype,), shape)


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    if len(set(devices.values())) > 1:
        raise ValueError("all tensors must be on one device, got " + ", ".join(f"{k}: {v}" for k, v in devices.items()))


def dot_scaled_interpreter_gap() -> str | None:
    """Triton before 3.9 cannot interpret ``tl.dot_scaled`` with format strings (its interpreter fails with "'str'
    object has no attribute 'value'"); 3.9's can. The compiled kernel is checked on both (tests/test_kernel_compile)."""
    try:
        version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None
    if tuple(int(p) for p in version.split(".")[:2] if p.isdigit()) >= (3, 9):
        return None
    return f"Triton {version}'s interpreter cannot run tl.dot_scaled with format strings (3.9's can)"
