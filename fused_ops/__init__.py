"""fused_ops: the memory-bound steps of a DeepSeek-V3 layer, each fused into one Triton kernel (CUDA and MUSA).

RMSNorm with the residual add (and the next GEMM's 1x128 FP8 cast), SwiGLU (with its FP8 cast), rotary
embedding in place (MLA's interleaved pairs, the V3.2 indexer's halves), MoE permute / unpermute (FP8 values
with their scales, and the routing weights) and the router's sigmoid + bias + group-limited top-k; DeepSeek-V4's
indexer logits, compressor pool and mHC Sinkhorn (``indexer_logits``, ``gated_pool``, ``sinkhorn``; their own
modules, docs/v4_kernels.md). Each kernel op has a PyTorch reference in ``accel.registry`` (``fused_ops.ops``)
and is the custom op ``torch.ops.dsv3.<name>`` (``fused_ops.custom``); ``fused_ops.functions`` is the public,
differentiable API; ``fused_ops.dispatch`` is the model's entry to each fusion (the kernel where it runs, else a
torch path with the same rounding points). A kernel package: it imports only ``accel`` (and torch, triton).
"""

from fused_ops.dispatch import (
    Permuted,
    kernels_run,
    permute_tokens,
    rms_norm,
    rotary,
    rotary_tail_,
    send_layout,
    silu_and_mul,
)
from fused_ops.functions import (
                                 apply_rope,
                                 gather_rows,
                                 pack_rows_fp8,
                                 permute,
                                 regroup_rows,
                                 regroup_rows_fp8,
                                 rmsnorm,
                                 rope_,
                                 route,
                                 route_softmax,
                                 swiglu,
                                 swiglu_fp8,
                                 unpermute,
)
from fused_ops.gated_pool import gated_pool
from fused_ops.grouping import Grouping, grouping
from fused_ops.indexer_logits import indexer_logits
from fused_ops.sinkhorn import sinkhorn

__all__ = [
    "Grouping",
    "Permuted",
    "apply_rope",
    "gated_pool",
    "gather_rows",
    "grouping",
    "indexer_logits",
    "kernels_run",
    "pack_rows_fp8",
    "permute",
    "permute_tokens",
    "regroup_rows",
    "regroup_rows_fp8",
    "rms_norm",
    "rmsnorm",
    "rope_",
    "rotary",
    "rotary_tail_",
    "route",
    "route_softmax",
    "send_layout",
    "silu_and_mul",
    "sinkhorn",
    "swiglu",
    "swiglu_fp8",
    "unpermute",
]
