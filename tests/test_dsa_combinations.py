"""DeepSeek-V3.2's two DSA stages under the parallel layouts: a few combinations of issue 13's matrix (DualPipe
and DualPipeV, EP, FP8, MTP, recompute, overlapped F&B, ZeRO-1) train the dense warm-up (only the indexers
train) and the sparse stage (top-4 of up to 16 keys) on 4 gloo processes and equal one process, by
``test_combinations``' comparison and tolerances (the same derivation holds: the indexer adds fp32 GEMMs of
<= 64-term reductions and a KL over <= 16 keys, and its top-k picks from the same scores on both sides,
since the forward sees the same values; a dropped indexer gradient contribution moves its tensors by >= 10%).
Every run starts from one DeepSeek-V3 HF checkpoint through ``model.init_from`` (each rank loading its stages and
expert slice, the indexers freshly initialised), as a V3 -> V3.2 continuation does.
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


def _run(rank: int, world: int, combos: list, run_dir: str, extra: list[str]) -> list[dict]:
    """Inside a 4-process launch: each (stage, combination) in turn with fresh process groups."""
    import torch.distributed as dist

    from training.parallel import init_parallel

    os.environ.setdefault("DSV3_KERNEL_IMPL", "reference")
    torch.set_num_threads(1)
    out = []
    for i, (stage, c) in enumerate(combos):
        cfg = matrix.config(matrix.overrides(c) + STAGES[stage] + extra)
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

    from models.deepseek_v3 import Transformer, save_hf_checkpoint
    from tests.dist_utils import run_distributed
    from training.parallel import single_process
    from training.trainer import model_args

    # every run starts from one DeepSeek-V3 HF checkpoint (model.init_from; fresh indexers from the seed): each
    # rank loads its own stages and expert slice of it
    v3 = Transformer(model_args(matrix.config(matrix.reference_overrides((False, 1)))))
    with torch.no_grad():
        for name, prm in v3.named_parameters():
            if "norm" in name:
                prm.uniform_(0.5, 1.5)
    save_hf_checkpoint(v3, tmp_path / "v3")
    extra = [f"model.init_from={tmp_path / 'v3'}"]
    with ThreadPoolExecutor(1) as pool:
        launch = pool.submit(run_distributed, _run, matrix.WORLD, COMBOS, str(tmp_path), extra, timeout=600.0)
        refs = {}
        for stage, c in COMBOS:
            key = (stage, *matrix.reference_key(c))
            if key not in refs:
                cfg = matrix.config(matrix.reference_overrides(key[1:]) + STAGES[stage] + extra)
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
            loaded = v3.state_dict()
            common = [k for k in loaded if k in ref["initial"]]
            assert len(common) == len(loaded), "init_from: the V3 checkpoint's tensors are all in the V3.2 model"
            assert all(torch.equal(ref["initial"][k], loaded[k]) for k in common), "init_from"
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
