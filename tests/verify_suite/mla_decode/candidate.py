"""flash_mla's Triton decode: split-KV programs over the paged cache, then a combine kernel."""

from torch import nn

import flash_mla  # noqa: F401 - registers the op
from accel import registry


class ModelNew(nn.Module):
    def __init__(self, head_dim_v: int):
        super().__init__()
        self.head_dim_v = head_dim_v

    def forward(self, q, cache, table, lens, meta, splits):
        return registry.get("flash_mla.flash_mla_with_kvcache").triton(q, cache, table, lens, self.head_dim_v, meta,
                                                                        splits)
