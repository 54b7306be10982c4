"""Where each (token, slot) assignment of a top-k routing lands in the grouped GEMM's contiguous layout.

DeepGEMM's "contiguous" layout: each expert's rows form one block padded to ``alignment`` rows, pad rows
carry expert -1. Index math on ``[T, k]`` integers only (no activations): plain torch. The row movement
itself is the ``fused_ops.permute_*`` / ``unpermute_*`` kernels, which read ``assign`` and ``rows``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Grouping:
    rows: torch.Tensor  # [T * k] int64: grouped row of assignment (t, j), at index t * k + j
    assign: torch.Tensor  # [M] int64: assignment t * k + j held by each grouped row, -1 on padding
    m_indices: torch.Tensor  # [M] int32: expert of each grouped row, -1 on padding
    tokens_per_expert: torch.Tensor  # [E] int64, unpadded
    num_tokens: int
    k: int


def grouping(indices: torch.Tensor, num_experts: int, alignment: int) -> Grouping:
    """The layout for ``indices [T, k]`` (expert ids in ``[0, num_experts)``), blocks padded to ``alignment``."""
    if indices.dim() != 2 or indices.is_floating_point():
        raise ValueError(f"grouping: indices must be an integer [tokens, k] tensor, got {indices.dtype} "
                         f"{list(indices.shape)}")
    if alignment < 1:
        raise ValueError(f"grouping: alignment must be >= 1, got {alignment}")
    num_tokens, k = indices.shape
    flat = indices.reshape(-1)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + alignment - 1) // alignment * alignment
    order = flat.argsort(stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(flat.numel(), device=flat.device) - (counts.cumsum(0) - counts)[sorted_experts]
    rows = torch.empty_like(flat)
    rows[order] = (padded.cumsum(0) - padded)[sorted_experts] + rank
    total = int(padded.sum())
    assign = torch.full((total,), -1, dtype=torch.long, device=flat.device)
    assign[rows] = torch.arange(flat.numel(), device=flat.device)
    m_indices = torch.full((total,), -1, dtype=torch.int32, device=flat.device)
    m_indices[rows] = flat.to(torch.int32)
    return Grouping(rows=rows, assign=assign, m_indices=m_indices, tokens_per_expert=counts, num_tokens=num_tokens,
                    k=k)
