"""Autotune-space sharding, so several processes can compile a kernel's configs in parallel.

With ``DSV3_AUTOTUNE_SHARD=i/n`` every kernel's autotuner keeps only its configs ``i, i + n, ...``
(the config ``i mod len`` when that leaves none). ``recipes.warm_kernels`` runs the kernel benchmarks
once per shard in ``n`` processes sharing Triton's on-disk cache: afterwards the full autotuner finds
every config already compiled (Triton's cache key is the kernel source, its specialisation and the
compile options, not which other configs exist).
"""

from __future__ import annotations

import os

SHARD_ENV = "DSV3_AUTOTUNE_SHARD"


def shard(configs: list) -> list:
    """This process's slice of an autotune config list (all of it unless ``DSV3_AUTOTUNE_SHARD`` is set)."""
    spec = os.environ.get(SHARD_ENV, "")
    if not spec or not configs:
        return configs
    try:
        i, n = (int(x) for x in spec.split("/"))
        if not 0 <= i < n:
            raise ValueError
    except ValueError:
        raise ValueError(f"{SHARD_ENV} must be 'i/n' with 0 <= i < n, got {spec!r}") from None
    return configs[i::n] or [configs[i % len(configs)]]
