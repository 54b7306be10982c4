"""DeepSeek-V3.2's two DSA stages under the parallel layouts: a few combinations of issue 13's matrix (DualPipe
and DualPipeV, EP, FP8, MTP, recompute, overlapped F&B, ZeRO-1) train the dense warm-up (only the indexers
train) and the sparse stage (top-4 of up to 16 keys) on 4 gloo processes and equal one process, by
``test_combinations``' comparison and tolerances (the same derivation holds: the indexer adds fp32 GEMMs of
<= 64-term reductions and a KL over <= 16 keys, and its top-k picks from the same scores on both sides,
since the forward sees the same values; a dropped indexer gradient contribution moves its tensors by >= 10%).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests import matrix
from tests.test_combinations import _compare

DSA = ["model.overrides.index_topk=4", "model.overrides.index_n_heads=4", "model.overrides.index_head_dim=16"]
STAGES = {"warmup": DSA + ["model.overrides.dsa_warmup=true"], "sparse": DSA}
# (stage, combination): each stage under DualPipe-family schedules with EP, MTP and a recompute kind, one with
# FP8; together they cover both schedules with mirrored or V stages, FP8 on and off, and three recompute kinds.
COMBOS = [
    ("warmup", dict(schedule="dualpipev", ep=2, fp8=True, mtp=1, recompute="v3", overlap=True, eplb=False,
                    zero1=True)),
    ("sparse", dict(schedule="dualpipe", ep=2, fp8=False, mtp=1, recompute="block", overlap=True, eplb=False,
                    zero1=True)),
    ("sparse", dict(schedule="zbv", ep=1, fp8=True, mtp=1, recompute="v3", overlap=False, eplb=False,
                    zero1=False)),
]


def _run(rank: int, world: int, combos: list, run_dir: str) -> list[dict]:
    """Inside a 4-process launch: each (stage, combination) in turn with fresh process groups."""
    import torch.distributed as dist

    from training.parallel import init_parallel

    os.environ.setdefault("DSV3_KERNEL_IMPL", "reference")
    torch.set_num_threads(1)
    out = []
    for i, (stage, c) in enumerate(combos):
        cfg = matrix.config(matrix.overrides(c) + STAGES[stage])
        ps = init_parallel(cfg.parallel, cfg.run.timeout_s)
        try:
            out.append(matrix.train(cfg, ps, Path(run_dir) / f"c{i}"))
        except Exception as exc:  # noqa: BLE001 - reported per combination
            out.append({"error": f"{type(exc).__name__}: {exc}"})
        for g in {id(g): g for g in ps.groups.values() if g is not None}.values():
            dist.destroy_process_group(g)
    return out


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(900)
def test_dsa_stages_under_parallel_layouts_match_one_process(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from tests.dist_utils import run_distributed
    from training.parallel import single_process

    with ThreadPoolExecutor(1) as pool:
        launch = pool.submit(run_distributed, _run, matrix.WORLD, COMBOS, str(tmp_path), timeout=600.0)
        refs = {}
        for stage, c in COMBOS:
            key = (stage, *matrix.reference_key(c))
            if key not in refs:
                cfg = matrix.config(matrix.reference_overrides(key[1:]) + STAGES[stage])
                refs[key] = matrix.train(cfg, single_process(cfg.parallel), tmp_path / "-".join(map(str, key)),
                                         keep_initial=True)
        results = launch.result()
    failures = []
    for i, (stage, c) in enumerate(COMBOS):
        got = [results[rank][i] for rank in range(matrix.WORLD)]
        errors = [g["error"] for g in got if "error" in g]
        ref = refs[(stage, *matrix.reference_key(c))]
        try:
            assert not errors, errors[0]
            _compare(c, got, ref)
            if stage == "warmup":  # only the indexers moved, in every layout and in the reference
                for r in got + [ref]:
                    moved = [k for k, w in r["state"].items() if w.is_floating_point() and ".indexer." not in k
                             and not k.endswith("e_score_correction_bias")
                             and not torch.equal(w, ref["initial"][k][slice(*r["expert_rows"][k])
                                                                      if k in r["expert_rows"] else slice(None)])]
                    assert not moved, moved[:3]
        except AssertionError as exc:
            failures.append(f"{stage} {matrix.name(c)}: {exc}")
    assert not failures, "\n".join(failures)
