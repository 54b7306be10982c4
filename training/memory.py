"""Dry-run memory estimate per pipeline rank, without allocating the model.

The model is built on the ``meta`` device with one expert-parallel slice of the routed experts,
so parameter counts per stage are exact (the same modules training builds) even at 671B, on a
laptop. Per rank:

- parameters and gradients: ``numel x bytes(run.dtype)`` for the stages the schedule puts there
  (DualPipe holds two mirrored stages, DualPipeV/ZBV two stages of a V);
- AdamW states (two moments, in the parameter dtype): sharded by ZeRO-1 over the stage's ``dp``
  ranks for dense parameters and over the ``dp / ep`` expert replicas for expert parameters;
- activations: the elements each layer keeps for backward per token (formula in
  ``activation_elems_per_token``; bf16 on GPU with autocast, else ``run.dtype``) times tokens per
  micro-batch, times the peak number of live (stage, micro-batch) activations on the rank from
  ``dualpipe.simulator`` (1F1B: pp - rank, DualPipe: pp + 1, ...).

Recompute options, FP8-cached activations and allocator fragmentation are not modelled: it is an
estimate to check a layout fits, not a promise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.deepseek_v3 import ModelArgs, Transformer
from training.config import TrainConfig
from training.optim import is_expert_param
from training.stages import expert_range, num_model_stages, split_layers, stage_ids

GiB = 1024**3
_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2}


def activation_elems_per_token(args: ModelArgs, layer_id: int) -> int:
    """Elements one block saves for backward per token (no recompute).

    Attention: block input, normed input, q latent and its norm, kv latent (+rope) and its norm,
    q, k, v, attention output (+ lse per head). FFN: input, normed input; dense: gate/up output,
    SwiGLU output; MoE: router logits and scores (fp32, counted twice), top-k dispatched copies of
    the input, their gate/up and SwiGLU outputs, expert outputs, and the shared experts' as dense.
    """
    d, h = args.dim, args.n_heads
    attn = 2 * d + 2 * args.q_lora_rank + 2 * (args.kv_lora_rank + args.qk_rope_head_dim)
    attn += h * (2 * args.qk_head_dim + 2 * args.v_head_dim + 1)
    if not args.is_moe_layer(layer_id):
        return attn + 2 * d + 3 * args.inter_dim
    k, inter = args.n_activated_experts, args.moe_inter_dim
    moe = 2 * d + 4 * args.n_routed_experts + k * (2 * d + 3 * inter)
    moe += args.n_shared_experts * 3 * inter
    return attn + moe


@dataclass
class RankEstimate:
    pp_rank: int
    stages: list[int]
    params: int
    expert_params: int
    param_bytes: int
    grad_bytes: int
    optim_bytes: int
    act_bytes: int
    peak_microbatches: int

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optim_bytes + self.act_bytes


def _module_counts(args: ModelArgs, ep: int) -> dict[str, tuple[int, int]]:
    """(dense, expert) parameter counts of each top-level module (``layers.i``, ``embed``, ``norm``, ``head``,
    ``mtp``) with one EP rank's experts, from the meta-device model. Memoised per (model, ep): a planner asks
    for thousands of layouts of one model."""
    key = (repr(args), ep)
    if key not in _COUNTS:
        experts = expert_range(args, 0, ep) if ep > 1 else None
        with torch.device("meta"):
            model = Transformer(args, expert_ids=experts)
        modules = {f"layers.{i}": layer for i, layer in enumerate(model.layers)}
        modules.update(embed=model.embed, norm=model.norm, head=model.head, mtp=model.mtp)
        counts = {}
        for prefix, module in modules.items():
            dense = expert = 0
            for name, p in module.named_parameters(prefix=prefix):
                if is_expert_param(name):
                    expert += p.numel()
                else:
                    dense += p.numel()
            counts[prefix] = (dense, expert)
        _COUNTS[key] = counts
    return _COUNTS[key]


_COUNTS: dict[tuple[str, int], dict[str, tuple[int, int]]] = {}


def _stage_param_counts(args: ModelArgs, cfg: TrainConfig) -> list[tuple[int, int]]:
    """(dense, expert) parameter counts of each global stage, for one EP rank's experts (with EPLB's redundant
    slots)."""
    par = cfg.parallel
    num = num_model_stages(par.schedule, par.pp)
    ranges = split_layers(args, num)
    counts = _module_counts(args, par.ep)
    out = []
    for s, (lo, hi) in enumerate(ranges):
        parts = [f"layers.{i}" for i in range(lo, hi)]
        if s == 0:
            parts.append("embed")
        if s == num - 1:
            parts += ["norm", "head", "mtp"]
            if s != 0 and args.n_mtp_layers and not any(0 in stage_ids(par.schedule, par.pp, r) and
                                                         s in stage_ids(par.schedule, par.pp, r)
                                                         for r in range(par.pp)):
                parts.append("embed")  # a separate copy for MTP
        dense = sum(counts[p][0] for p in parts)
        expert = sum(counts[p][1] for p in parts)
        if cfg.eplb.enabled:  # (E + redundant) / ep physical slots per rank instead of E / ep
            expert = expert * (args.n_routed_experts + cfg.eplb.redundant_experts) // args.n_routed_experts
        out.append((dense, expert))
    return out


def _peak_microbatches(cfg: TrainConfig, chunks: int) -> list[int]:
    par = cfg.parallel
    if par.schedule == "none":
        return [1]
    from dualpipe.simulator import schedule_peaks

    return list(schedule_peaks(par.schedule, par.pp, chunks))


def estimate(cfg: TrainConfig, args: ModelArgs, accelerator: bool = True) -> list[RankEstimate]:
    """Per pipeline rank (all data-parallel ranks of a stage are alike) at the largest batch of the run."""
    par = cfg.parallel
    pbytes = _BYTES[cfg.run.dtype]
    abytes = 2 if (accelerator and cfg.run.autocast_bf16) else pbytes
    counts = _stage_param_counts(args, cfg)
    chunks = cfg.microbatches_at(cfg.run.steps - 1)
    peaks = _peak_microbatches(cfg, chunks)
    num = num_model_stages(par.schedule, par.pp)
    ranges = split_layers(args, num)
    tokens = cfg.data.micro_batch * cfg.data.seq_len
    stage_act = []
    for s, (lo, hi) in enumerate(ranges):
        elems = sum(activation_elems_per_token(args, i) for i in range(lo, hi))
        if s == num - 1:
            elems += sum(activation_elems_per_token(args, args.n_layers + k) + 3 * args.dim
                         for k in range(args.n_mtp_layers))
            elems += (1 + args.n_mtp_layers) * args.vocab_size * 2  # logits and their fp32 softmax
        stage_act.append(elems * tokens * abytes)
    out = []
    for r in range(par.pp):
        mine = stage_ids(par.schedule, par.pp, r)
        dense = sum(counts[s][0] for s in mine)
        expert = sum(counts[s][1] for s in mine)
        optim = 2 * pbytes * (dense / (par.dp if par.zero1 else 1) + expert / ((par.dp // par.ep) if par.zero1 else 1))
        peak = peaks[r] if len(peaks) > r else 1
        act = peak * max(stage_act[s] for s in mine)
        out.append(RankEstimate(r, mine, dense + expert, expert, (dense + expert) * pbytes, (dense + expert) * pbytes,
                                int(optim), int(act), peak))
    return out


def format_estimate(cfg: TrainConfig, args: ModelArgs, rows: list[RankEstimate]) -> str:
    counts = args.param_counts()
    lines = [f"model {cfg.model.preset}: {counts['total'] / 1e9:.1f}B parameters, "
             f"{counts['activated'] / 1e9:.1f}B activated per token (MTP excluded, as published)",
             f"per-rank memory estimate (params/grads in {cfg.run.dtype}, AdamW moments ZeRO-1 "
             f"{'on' if cfg.parallel.zero1 else 'off'}, micro-batch {cfg.data.micro_batch} x {cfg.data.seq_len} "
             "tokens):",
             f"{'pp rank':>7} {'stages':>8} {'params':>10} {'experts':>10} {'param GiB':>10} {'grad GiB':>9} "
             f"{'optim GiB':>10} {'live mb':>7} {'act GiB':>8} {'total GiB':>10}"]
    for e in rows:
        lines.append(f"{e.pp_rank:>7} {','.join(map(str, e.stages)):>8} {e.params / 1e9:>9.2f}B "
                     f"{e.expert_params / 1e9:>9.2f}B {e.param_bytes / GiB:>10.2f} {e.grad_bytes / GiB:>9.2f} "
                     f"{e.optim_bytes / GiB:>10.2f} {e.peak_microbatches:>7} {e.act_bytes / GiB:>8.2f} "
                     f"{e.total_bytes / GiB:>10.2f}")
    return "\n".join(lines)
