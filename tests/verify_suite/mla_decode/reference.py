"""FlashMLA decode (flash_mla_with_kvcache): absorbed MLA attention of a few query tokens over a paged latent
cache (576 = 512 latent + 64 rope per token; v = the first 512), varying sequence lengths, unused cache slots
NaN-poisoned and blocks permuted. Returns (out bf16 [b, s_q, h_q, 512], lse fp32 [b, h_q, s_q]).

Reference: the project's fp32 PyTorch reference. Vendor path: scaled_dot_product_attention per sequence.
"""

import torch
import torch.nn.functional as F
from torch import nn

from flash_mla.decode import flash_mla_with_kvcache_reference, make_paged_case
from flash_mla.metadata import BLOCK_SIZE, get_mla_metadata

batch, s_q, h_q, s_k = 2, 1, 16, 70
HEAD_DIM_V = 512


class Model(nn.Module):
    def __init__(self, head_dim_v: int):
        super().__init__()
        self.head_dim_v = head_dim_v

    def forward(self, q, cache, table, lens, meta, splits):
        return flash_mla_with_kvcache_reference(q, cache, table, lens, self.head_dim_v, meta, splits)


class ModelVendor(Model):
    def forward(self, q, cache, table, lens, meta, splits):
        outs = []
        for i, n in enumerate(lens.tolist()):
            kv = cache[table[i, : -(-n // BLOCK_SIZE)].long()].reshape(-1, cache.shape[-1])[:n]
            kv = kv[None].expand(q.shape[2], -1, -1)
            outs.append(F.scaled_dot_product_attention(q[i].transpose(0, 1), kv, kv[..., : self.head_dim_v]))
        return torch.stack(outs).transpose(1, 2)


def get_inputs():
    g = torch.Generator().manual_seed(int(torch.randint(2**31, (1,))))
    seqlens = [int(s_k * (0.5 + torch.rand(1).item())) for _ in range(batch)]
    q, cache, table, lens = make_paged_case(batch, s_q, h_q, 1, seqlens, False, g, torch.device("cpu"))
    meta, splits = get_mla_metadata(lens, s_q * h_q, 1)
    return [q, cache, table, lens, meta, splits]


def get_init_inputs():
    return [HEAD_DIM_V]
