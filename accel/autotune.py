"""Autotune spaces: per-architecture config lists, and sharding so several processes compile them in parallel.

``for_capability(lists, capability)`` picks a kernel's list for a GPU generation (``{90: hopper_list, 100:
blackwell_list}``: the entry with the largest key at or below the capability), so a kernel lists tiles per
architecture only where the best tile differs, and the offline compile table builds the list the GPU would use.

With ``DSV3_AUTOTUNE_SHARD=i/n`` every kernel's autotuner keeps only its configs ``i, i + n, ...``
(the config ``i mod len`` when that leaves none). ``recipes.warm_kernels`` runs the kernel benchmarks
once per shard in ``n`` processes sharing Triton's on-disk cache: afterwards the full autotuner finds
every config already compiled (Triton's cache key is the kernel source, its specialisation and the
compile options, not which other configs exist).
"""

from __future__ import annotations

import os

SHARD_ENV = "DSV3_AUTOTUNE_SHARD"


def capability_number(capability: tuple[int, int] | int | None) -> int | None:
    """``(10, 0)`` -> 100, ``90`` -> 90, None -> None (no CUDA device)."""
    if isinstance(capability, tuple):
        return capability[0] * 10 + capability[1]
    return capability


def for_capability(lists: dict[int, list], capability: tuple[int, int] | int | None) -> list:
    """The list for ``capability`` (``(9, 0)``, ``100``...): the entry with the largest key <= it; the smallest
    key's for None (the CPU, MUSA) or an older GPU."""
    cap = capability_number(capability)
    fitting = [k for k in lists if cap is not None and k <= cap]
    return lists[max(fitting) if fitting else min(lists)]


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
