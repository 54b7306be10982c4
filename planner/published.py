"""Public real training runs of DeepSeek-architecture models the planner can express, and its prediction of each.

Every row is a measured step time published by someone else, with its source, and the layout in the planner's
terms. ``predict`` evaluates a row with a shipped system file exactly as ``recipes.plan --fix`` would; nothing
here is fitted to the rows: the system files' figures come from kernel and collective measurements (their
``sources``), so every row is held out. ``benchmarks/planner.md`` has the table, ``tests/test_planner_published.py``
checks each row stays within ``TOLERANCE``.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.search import Evaluation, Layout, Request, evaluate
from planner.system import load_system
from training.config import TrainConfig

TOLERANCE = 0.15  # |predicted - measured| / measured, the bar for a plan a user can size a job with

SIMUMAX_B200 = ("SimuMax v1.2 (MooreThreads/SimuMax 4dcaae5) docs/b200/b200_release_v1.2_summary.md: Megatron-Core "
                "on one 8-GPU B200 node, BF16, seq 4096, micro-batch 1, ZeRO-1, 1F1B, fused cross-entropy, "
                "'real ms' of case {case}")
# DeepSeek-V3 report sec. 1 and 3: 180K H800 GPU-hours per trillion tokens (1e12 / (180e3 x 3600 s) = 1543.2
# tokens/s per GPU) on 2048 H800s, PP16 DualPipe x EP64 (8 nodes) x ZeRO-1 DP, FP8 blockwise, recompute of the
# RMSNorms and MLA up-projections, batch 15360 sequences of 4096 tokens (the batch it reaches after its ramp).
V3_TOKENS_PER_GPU_S = 1e12 / (180e3 * 3600)
V3_STEP_MS = 15360 * 4096 / (V3_TOKENS_PER_GPU_S * 2048) * 1e3

# the 4-layer proxies of SimuMax's B200 rows (its configs/models/*.json with dense_layers 1, no MTP)
V3_PROXY = ["model.overrides.n_layers=4", "model.overrides.n_dense_layers=1", "model.overrides.n_mtp_layers=0"]
V2_PROXY = V3_PROXY + ["model.overrides.vocab_size=102400", "model.overrides.dim=5120",
                       "model.overrides.inter_dim=12288", "model.overrides.moe_inter_dim=1536",
                       "model.overrides.n_routed_experts=160", "model.overrides.n_shared_experts=2",
                       "model.overrides.n_activated_experts=6", "model.overrides.n_expert_groups=1",
                       "model.overrides.n_limited_groups=1", "model.overrides.score_func=softmax",
                       "model.overrides.route_scale=1.0", "model.overrides.norm_topk_prob=false"]


@dataclass(frozen=True)
class PublishedRun:
    name: str
    gpu: str  # a shipped system file
    gpus: int
    model_sets: tuple[str, ...]  # recipes.train --set overrides on the deepseek_v3_671b preset
    layout: Layout
    seq_len: int
    measured_ms: float
    source: str

    @property
    def global_batch(self) -> int:
        return self.layout.dp * self.layout.micro_batch * self.layout.microbatches


def _simumax(model: str, sets: list[str], ep: int, pp: int, mbc: int, real_ms: float) -> PublishedRun:
    case = f"{model}_l4_tp1_ep{ep}_pp{pp}_dp{8 // pp}_mbc{mbc}_cef" if model == "deepseekv3" else \
        f"{model}_tp1_ep{ep}_pp{pp}_dp{8 // pp}_l4_mbc{mbc}_cef"
    lay = Layout(pp, 8 // pp, ep, "1f1b" if pp > 1 else "none", 1, mbc, "none", fp8=False, moments="param")
    return PublishedRun(case, "B200", 8, tuple(sets), lay, 4096, real_ms, SIMUMAX_B200.format(case=case))


RUNS: tuple[PublishedRun, ...] = (
    _simumax("deepseekv3", V3_PROXY, 8, 1, 4, 603.2), _simumax("deepseekv3", V3_PROXY, 4, 2, 4, 452.2),
    _simumax("deepseekv3", V3_PROXY, 8, 1, 8, 1101.7), _simumax("deepseekv3", V3_PROXY, 4, 2, 8, 771.6),
    _simumax("deepseekv3", V3_PROXY, 8, 1, 32, 4141.2), _simumax("deepseekv3", V3_PROXY, 4, 2, 32, 2718.6),
    _simumax("deepseekv2", V2_PROXY, 8, 1, 4, 366.6), _simumax("deepseekv2", V2_PROXY, 4, 2, 4, 282.1),
    _simumax("deepseekv2", V2_PROXY, 8, 1, 8, 676.2), _simumax("deepseekv2", V2_PROXY, 4, 2, 8, 492.6),
    _simumax("deepseekv2", V2_PROXY, 8, 1, 32, 2721.3), _simumax("deepseekv2", V2_PROXY, 4, 2, 32, 1727.7),
    PublishedRun("DeepSeek-V3 pre-training", "H800", 2048, (),
                 Layout(16, 128, 64, "dualpipe", 1, 120, "v3", fp8=True), 4096, V3_STEP_MS,
                 "DeepSeek-V3 technical report (arXiv 2412.19437) sec. 1: 180K H800 GPU-hours per trillion tokens "
                 "(1543 tokens/s per GPU) on 2048 H800s, PP16 DualPipe x EP64 x ZeRO-1, FP8; sec. 4.2: batch 15360 "
                 "x 4096 tokens"),
)


def request(run: PublishedRun, base: TrainConfig) -> Request:
    return Request(base, load_system(run.gpu), run.gpus, run.seq_len, run.global_batch)


def predict(run: PublishedRun, base: TrainConfig) -> Evaluation:
    """The planner's evaluation of ``run``'s layout (``base``: the run's model as a training config)."""
    return evaluate(request(run, base), run.layout)
