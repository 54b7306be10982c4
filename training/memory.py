"""Per-rank memory model of a training layout: what each pipeline rank holds at its peak, without allocating.

``estimate(cfg, device="H800")`` is the public entry point (the dry run, ``recipes.memory_report`` and
the layout planner call it). Per pipeline rank (all data-parallel ranks of a stage are alike) it adds:

- **weights** and **gradients**: ``numel x bytes(run.dtype)`` of the stages the schedule puts there
  (DualPipe holds two mirrored stages, DualPipeV/ZBV two stages of a V), counted on a ``meta`` model
  built with one expert-parallel slice of the routed experts (EPLB's redundant slots included); with
  ``optim.master_dtype = "float32"`` (V3) the weights are BF16 (2 B) and the gradients FP32 (4 B,
  ``main_grad`` buffers);
- **optimizer**: AdamW's two moments in ``optim.moments_dtype`` (fp32, or bf16 as V3), plus the FP32
  master copy (4 B) when ``optim.master_dtype = "float32"``, sharded by ZeRO-1 over the stage's ``dp``
  ranks (dense parameters) and the ``dp / ep`` expert replicas (experts), as an even split
  (``ZeroRedundancyOptimizer`` assigns whole tensors, so a shard can differ slightly);
- **activations**: the bytes each (stage, micro-batch) keeps for backward (``saved_per_token``: every
  tensor autograd saves, item by item, under the recompute policy, FP8 activation caching, the
  attention implementation and the criterion), summed over the (stage, micro-batch) pairs alive at
  once on the rank, walking the schedule's timeline from ``dualpipe.simulator`` (1F1B: pp - rank,
  DualPipe: pp + 1, ...);
- **transient**: the largest working set on top of that (the criterion's logits and their gradient,
  one block recomputed in backward, the optimizer step's temporaries);
- **comm**: expert all-to-all send/receive buffers in flight and pipeline P2P buffers;
- **margin**: a stated allocator margin on accelerators (``ALLOCATOR_MARGIN``): 10% of the dynamic
  part for the caching allocator's fragmentation plus 2 GiB for the CUDA/MUSA context, the
  communicator's buffers and library workspaces, none of which ``max_memory_allocated`` sees.

The host holds the parameter EMA (``optim.ema_decay``) apart from the device. MoE rows assume
balanced routing (each expert ``T k / E`` rows per micro-batch, padded to the grouped GEMM's alignment).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from accel import specs
from dualpipe.schedules import built
from models.deepseek_v3 import ModelArgs, Transformer
from training.config import TrainConfig
from training.optim import STEP_CHUNK, is_expert_param
from training.stages import expert_range, num_model_stages, split_layers, stage_ids
from training.trainer import model_args

GiB = 1024**3
_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2}
FP8_BYTES = 1 + 4 / 128  # e4m3 value + one fp32 scale per 1x128 tile
INDEX_BYTES = 8  # int64 indices
ALIGNMENT = 128  # rows per expert block of the contiguous grouped GEMM layout (deep_gemm)
ALLOCATOR_MARGIN = (0.10, 2 * GiB)  # (share of the dynamic bytes, fixed bytes) on an accelerator; 0 on a CPU


@dataclass(frozen=True)
class Precision:
    """Bytes per element of what a step keeps: ``act`` activations (bf16 under autocast on an accelerator,
    else ``run.dtype``), ``param`` weights, ``moment`` each of the ``moments`` optimizer states, ``master`` the
    optimizer's master copy (0: the parameters are the master weights)."""

    act: float
    param: int
    moment: int
    moments: int  # optimizer states per parameter (AdamW 2, SGD with momentum 1)
    attention: str  # "flash" (saves q, k, v, out, lse) or "reference" (the CPU path: keeps block probabilities)
    master: int = 0

    @property
    def grad(self) -> int:
        """Gradient bytes per parameter: the master's (FP32 ``main_grad`` buffers) when there is a master copy."""
        return self.master or self.param


# ---- activations ------------------------------------------------------------------------------------

def _recomputes(args: ModelArgs, kind: str, layer_id: int) -> bool:
    """``args.recomputes`` (``v3`` = norm + mla_up; ``block`` turns the finer kinds off in its layers)."""
    return args.recomputes(kind, layer_id)


def _fp8_cache(args: ModelArgs) -> bool:
    """FP8 activation caching: GEMM inputs kept only as e4m3 + 1x128 scales (``ModelArgs.fp8_cache``)."""
    return bool(args.fp8 and getattr(args, "fp8_cache", False))


def fp8_cached_row(k: int) -> float:
    """Bytes of one row of an FP8 Linear's cached input: e4m3 values padded to 128 columns, one fp32 scale
    per 128."""
    return -(-k // 128) * (128 + 4)


def fp8_stash_row(k: int) -> float:
    """Bytes of one row of an FP8-stashed SwiGLU input (not padded), one fp32 scale per 128 columns."""
    return k + 4 * -(-k // 128)


def linear_out_cols(args: ModelArgs, n: int, grouped: bool = False, act: float = 4) -> int:
    """Columns of the storage behind an ``[*, n]`` Linear output: the FP8 GEMMs write ``n`` padded to 128
    and return a view of it when the output dtype is the GEMM's (bf16, fp32; grouped: bf16 only)."""
    if args.fp8 and (not grouped or act == 2):
        return -(-n // 128) * 128
    return n


def attention_saved(args: ModelArgs, layer_id: int, seq_len: int, micro_batch: int, p: Precision) -> dict[str, float]:
    """Bytes per token the pre-norm MLA half of a block keeps for backward, by tensor.

    The q/kv latents (before their norms) are always kept; the normed latents, the norm statistics
    and the attn_norm output only without ``norm`` recompute; q, k, v only without ``mla_up``
    recompute (then the up-projections are re-run from the latents and the rotated rope key). The
    flash kernel keeps its output and log-sum-exp (the output doubles as wo's input); the CPU
    reference recomputes them. Under FP8 caching each FP8 GEMM keeps its own e4m3 copy of its input.
    """
    d, h, a = args.dim, args.n_heads, p.act
    qk, v, nope = args.qk_head_dim, args.v_head_dim, args.qk_nope_head_dim
    ql, kvl, rope = args.q_lora_rank, args.kv_lora_rank, args.qk_rope_head_dim
    norm, up = _recomputes(args, "norm", layer_id), _recomputes(args, "mla_up", layer_id)
    cache = _fp8_cache(args)
    out: dict[str, float] = {"block input": d * a}
    if not norm:
        out["norm rstd"] = 4 + (0 if up else (2 if ql else 1) * 4)  # q_norm/kv_norm re-run with the up-projections
        out["attn_norm out"] = 2 * fp8_cached_row(d) if cache else d * a  # input of wq_a (or wq) and wkv_a
    if ql:
        out["q latent"] = linear_out_cols(args, ql) * a  # wq_a out, q_norm's input
    out["kv latent"] = linear_out_cols(args, kvl + rope) * a  # wkv_a out: kv_norm's input and the rope key
    if not up:
        for name, k in (("q latent normed", ql), ("kv latent normed", kvl)):
            if k:  # wq_b / wkv_b inputs (a recomputed norm's output is released)
                out[name] = 0.0 if norm else (fp8_cached_row(k) if cache else k * a)
        out["q, k"] = 2 * h * qk * a
        out["v"] = linear_out_cols(args, h * (nope + v)) * a  # a view of wkv_b's output
    else:
        out["rotated rope key"] = rope * a
    out["rope cos/sin"] = (1 if up else 2) * rope * 4 / micro_batch  # complex64 [s, rope/2] per rotation
    if p.attention == "flash":  # wo saves this same output (``flash_mla.keeps_output``): no copy of its own
        out["attention out + lse"] = h * v * a + h * 4
    else:
        out["wo input"] = fp8_cached_row(h * v) if cache else h * v * a
    return out


def _mlp_saved(args: ModelArgs, rows: float, inter: int, a: float, recompute_swiglu: bool,
               grouped: bool = False) -> dict[str, float]:
    """Bytes a SwiGLU MLP keeps for ``rows`` rows after ``w13``'s input (counted by the caller). The SwiGLU
    keeps only its input (``layers.swiglu``); the routed experts' also keeps each row's routing weight."""
    out = {"routing weight per row": rows * 4} if grouped else {}
    if args.fp8 and _fp8_cache(args):  # SwiGLU input stashed in FP8, its output recomputed for w2
        out["SwiGLU input (fp8)"] = rows * fp8_stash_row(2 * inter)
        return out
    out["w13 out"] = rows * linear_out_cols(args, 2 * inter, grouped, a) * a  # the SwiGLU's input
    if not recompute_swiglu:
        out["w2 input"] = rows * inter * a
    return out


def expert_rows(args: ModelArgs, tokens: int, slots: int) -> int:
    """Rows of the grouped expert GEMMs on one EP rank (balanced routing): each of the ``ep`` ranks sends
    ``tokens k`` rows spread over all ``slots x ep`` expert slots, so each local slot gets ``tokens k / slots``
    rows, padded to ``ALIGNMENT``."""
    per_expert = tokens * args.n_activated_experts / slots if slots else 0.0
    return slots * ALIGNMENT * max(1, math.ceil(per_expert / ALIGNMENT)) if per_expert else 0


def ffn_saved(args: ModelArgs, layer_id: int, tokens: int, micro_batch: int, p: Precision, ep: int = 1,
              slots: int | None = None) -> dict[str, float]:
    """Bytes per token the FFN half of a block keeps for backward (``tokens`` per micro-batch), by tensor."""
    d, a = args.dim, p.act
    norm = _recomputes(args, "norm", layer_id)
    swiglu = _recomputes(args, "swiglu", layer_id)
    cache = _fp8_cache(args)
    out: dict[str, float] = {"ffn input": d * a}

    def add(prefix: str, items: dict[str, float]) -> None:
        out.update({f"{prefix} {k}": v for k, v in items.items()})

    if not args.is_moe_layer(layer_id):
        if not norm:
            out["ffn_norm out + rstd"] = (fp8_cached_row(d) if cache else d * a) + 4
        add("dense", _mlp_saved(args, 1, args.inter_dim, a, swiglu))
        return out
    e, k = args.n_routed_experts, args.n_activated_experts
    slots = e // ep if slots is None else slots
    rows = expert_rows(args, tokens, slots) / tokens
    if not norm:  # the router and the shared experts' w13 read it (the latter as its FP8 copy when caching)
        out["ffn_norm out + rstd"] = d * a + 4 + (fp8_cached_row(d) if cache and args.n_shared_experts else 0)
    groups = args.n_expert_groups if args.n_expert_groups > 1 else 0
    # scores; top-k weights and their sum; top-k and row indices; group top-2 and mask
    out["router"] = e * 4 + (k + 1) * 4 + 3 * k * INDEX_BYTES + groups * (2 * INDEX_BYTES + 1)
    # the grouped rows (as w13's FP8 copy when caching), their source index and expert id
    out["expert rows in"] = rows * ((fp8_cached_row(d) if cache else d * a) + INDEX_BYTES + 4)
    add("experts", _mlp_saved(args, rows, args.moe_inter_dim, a, swiglu, grouped=True))
    if args.n_shared_experts:
        add("shared", _mlp_saved(args, 1, args.n_shared_experts * args.moe_inter_dim, a, swiglu))
    return out


def block_saved(args: ModelArgs, layer_id: int, seq_len: int, micro_batch: int, p: Precision, ep: int = 1,
                slots: int | None = None) -> float:
    """Bytes per token one block keeps for backward; a block recomputed whole keeps only its input."""
    if _recomputes(args, "block", layer_id):
        return args.dim * p.act
    tokens = seq_len * micro_batch
    return (sum(attention_saved(args, layer_id, seq_len, micro_batch, p).values())
            + sum(ffn_saved(args, layer_id, tokens, micro_batch, p, ep, slots).values()))


def gemm_backward_working_set(args: ModelArgs, rows: float, n: int, k: int, groups: int, p: Precision) -> float:
    """Bytes alive while one (grouped) GEMM ``[rows, k] x [groups, n, k]^T`` runs backward, besides what was
    saved: the output and input gradients, the weight gradient before it is added to ``.grad``, and for FP8
    the casts of the gradient, the input and the weight. On a CPU the reference casts hold about three
    fp32 copies of the tile-padded operand they quantize (padded copy, scaled tiles, rounded values)."""
    a = p.act
    np_, kp = -(-n // 128) * 128, -(-k // 128) * 128
    ws = rows * (n + k) * a + groups * n * k * 4
    if args.fp8:
        ws += rows * k * 4 if _fp8_cache(args) else 0  # the cached input, dequantized for the wgrad
        if p.attention == "reference":  # CPU reference casts
            ws += 3 * 4 * max(rows * max(np_, kp), groups * np_ * kp)
        else:
            ws += rows * (np_ + kp) + groups * np_ * kp
    return ws


def block_working_set(args: ModelArgs, layer_id: int, seq_len: int, micro_batch: int, p: Precision, ep: int = 1,
                      slots: int | None = None) -> float:
    """Bytes per token alive on top of the saved ones while one block runs backward: the largest GEMM
    backward (``gemm_backward_working_set``) with the residual stream's gradient, and what recompute rebuilds
    there (a whole block: everything it would otherwise have kept)."""
    tokens = seq_len * micro_batch
    d, h = args.dim, args.n_heads
    gemms = [(1, args.n_heads * args.v_head_dim, d, 1), (1, d, args.n_heads * args.v_head_dim, 1),
             (1, h * (args.qk_nope_head_dim + args.v_head_dim), args.kv_lora_rank, 1)]
    if args.q_lora_rank:
        gemms.append((1, h * args.qk_head_dim, args.q_lora_rank, 1))
    if args.is_moe_layer(layer_id):
        slots = args.n_routed_experts // ep if slots is None else slots
        rows = expert_rows(args, tokens, slots) / tokens
        inter = args.moe_inter_dim
        gemms += [(rows, 2 * inter, d, slots), (rows, d, inter, slots)]
        if args.n_shared_experts:
            si = args.n_shared_experts * inter
            gemms += [(1, 2 * si, d, 1), (1, d, si, 1)]
    else:
        gemms += [(1, 2 * args.inter_dim, d, 1), (1, d, args.inter_dim, 1)]
    # per token: the rows scale with tokens, the weight-sized parts do not
    ws = max(gemm_backward_working_set(args, r * tokens, n, k, g, p) for r, n, k, g in gemms) / tokens
    ws += 2 * d * p.act  # the residual stream's gradient, flowing and accumulated
    # what recompute (and the recomputed SwiGLU of FP8 caching) rebuilds in this layer's backward
    full = args.replace(recompute=(), fp8_cache_activations=False) if hasattr(args, "fp8_cache_activations") \
        else args.replace(recompute=())
    ws += max(0.0, block_saved(full, layer_id, seq_len, micro_batch, p, ep, slots)
              - block_saved(args, layer_id, seq_len, micro_batch, p, ep, slots))
    return ws


def criterion_saved(args: ModelArgs, fused: bool, p: Precision, micro_batch: int) -> float:
    """Bytes per token the last stage's loss keeps: final norm and head input, the fp32 log-probabilities
    of the head and of each MTP depth (none with a fused cross-entropy), the MTP modules' own inputs."""
    d, a, v = args.dim, p.act, args.vocab_size
    heads = 1 + args.n_mtp_layers
    out = heads * (2 * d * a + 4)  # norm input/out + rstd per head
    out += 0 if fused else heads * v * 4
    # embedding out, enorm/hnorm rstd, eh_proj input (eh_proj is a BF16 GEMM even under FP8: no padded output)
    out += args.n_mtp_layers * (d * a + 2 * 4 + 2 * d * a)
    return out


def criterion_working_set(args: ModelArgs, fused: bool, p: Precision, tokens: int) -> float:
    """Bytes per token alive on top of the saved ones around the loss: the logits of every head and
    their fp32 copy in forward, a logits gradient and its input in backward; a fused loss keeps one
    chunk of logits (no larger than the hidden states) at a time."""
    v = args.vocab_size
    if fused:  # a chunk of logits and of their gradient, each no larger than the hidden states (fused_ce)
        return 3 * args.dim * 4
    heads = 1 + args.n_mtp_layers
    return max(heads * v * p.act, 2 * v * 4)  # forward: every head's logits; backward: dlogp and dlogits


def fused_cross_entropy(args: ModelArgs) -> bool:
    """The trainer's loss is ``fused_ce.linear_cross_entropy`` (logits made a chunk of rows at a time)."""
    return True


# ---- parameters ---------------------------------------------------------------------------------------

_COUNTS: dict[tuple[str, int], dict[str, tuple[int, int]]] = {}  # (repr(args), ep) -> counts: planners call often


def _module_param_counts(args: ModelArgs, ep: int) -> dict[str, tuple[int, int]]:
    """(dense, expert) parameter counts of every module a stage can hold (``layers.i``, ``embed``, ``norm``,
    ``head``, ``mtp``), for one EP rank's experts."""
    key = (repr(args), ep)
    if key not in _COUNTS:
        _COUNTS[key] = _count_modules(args, ep)
    return _COUNTS[key]


def _count_modules(args: ModelArgs, ep: int) -> dict[str, tuple[int, int]]:
    experts = expert_range(args, 0, ep) if ep > 1 else None
    with torch.device("meta"):
        model = Transformer(args, expert_ids=experts)

    def count(module: torch.nn.Module, prefix: str) -> tuple[int, int]:
        dense = expert = 0
        for name, prm in module.named_parameters(prefix=prefix):
            if is_expert_param(name):
                expert += prm.numel()
            else:
                dense += prm.numel()
        return dense, expert

    out = {f"layers.{i}": count(layer, f"layers.{i}") for i, layer in enumerate(model.layers)}
    for name in ("embed", "norm", "head", "mtp"):
        out[name] = count(getattr(model, name), name)
    out["largest tensor"] = (max(prm.numel() for prm in model.parameters()), 0)
    return out


def stage_param_counts(args: ModelArgs, cfg: TrainConfig) -> list[tuple[int, int]]:
    """(dense, expert) parameter counts of each global stage for one EP rank (EPLB's redundant slots
    included: ``(E + redundant) / ep`` slots per rank instead of ``E / ep``)."""
    par = cfg.parallel
    num = num_model_stages(par.schedule, par.pp)
    counts = _module_param_counts(args, par.ep)
    scale = (args.n_routed_experts + cfg.eplb.redundant_experts) / args.n_routed_experts if cfg.eplb.enabled else 1
    out = []
    for s, (lo, hi) in enumerate(split_layers(args, num)):
        parts = [f"layers.{i}" for i in range(lo, hi)]
        if s == 0:
            parts.append("embed")
        if s == num - 1:
            parts += ["norm", "head", "mtp"]
            shares_embed = any(0 in stage_ids(par.schedule, par.pp, r) and s in stage_ids(par.schedule, par.pp, r)
                               for r in range(par.pp))
            if s != 0 and args.n_mtp_layers and not shares_embed:
                parts.append("embed")  # a separate copy for MTP
        dense = sum(counts[n][0] for n in parts)
        expert = sum(counts[n][1] for n in parts)
        out.append((dense, int(expert * scale)))
    return out


# ---- the estimate ---------------------------------------------------------------------------------------

@dataclass
class RankMemory:
    """One pipeline rank's peak: ``items`` name -> bytes (weights, gradients, optimizer, activations,
    transient, comm, margin); ``detail`` the activation bytes per item of one micro-batch of each stage."""

    pp_rank: int
    stages: list[int]
    params: int
    expert_params: int
    peak_microbatches: int
    items: dict[str, int]
    host: dict[str, int] = field(default_factory=dict)
    detail: dict[str, int] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(self.items.values())

    # names kept from the first version of this module
    @property
    def param_bytes(self) -> int:
        return self.items["weights"]

    @property
    def grad_bytes(self) -> int:
        return self.items["gradients"]

    @property
    def optim_bytes(self) -> int:
        return self.items["optimizer"]

    @property
    def act_bytes(self) -> int:
        return self.items["activations"]

    def largest(self, n: int = 3) -> list[tuple[str, int]]:
        return sorted(self.items.items(), key=lambda kv: -kv[1])[:n]


@dataclass
class MemoryEstimate:
    """Every pipeline rank's ``RankMemory`` on ``device`` (capacity in bytes, None when unknown); iterating
    gives the ranks."""

    device: str
    capacity_bytes: int | None
    ranks: list[RankMemory]
    precision: Precision

    def __iter__(self):
        return iter(self.ranks)

    def __len__(self) -> int:
        return len(self.ranks)

    def __getitem__(self, i: int) -> RankMemory:
        return self.ranks[i]

    @property
    def peak_bytes(self) -> int:
        return max(r.total_bytes for r in self.ranks)

    @property
    def worst(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.total_bytes)

    @property
    def fits(self) -> bool | None:
        """Whether every rank fits the device (margin included); None without a known capacity."""
        return None if self.capacity_bytes is None else self.peak_bytes <= self.capacity_bytes

    def verdict(self) -> str:
        w = self.worst
        big = ", ".join(f"{k} {v / GiB:.1f} GiB" for k, v in w.largest())
        if self.capacity_bytes is None:
            return (f"no device capacity known ({self.device}): largest rank {w.pp_rank} needs "
                    f"{w.total_bytes / GiB:.1f} GiB")
        cap = self.capacity_bytes / GiB
        if self.fits:
            return (f"FITS on {self.device} ({cap:.1f} GiB): largest rank {w.pp_rank} needs "
                    f"{w.total_bytes / GiB:.1f} GiB ({big})")
        over = [r.pp_rank for r in self.ranks if r.total_bytes > self.capacity_bytes]
        return (f"DOES NOT FIT on {self.device} ({cap:.1f} GiB): {len(over)} of {len(self.ranks)} pipeline ranks "
                f"exceed it; rank {w.pp_rank} needs {w.total_bytes / GiB:.1f} GiB, largest items: {big}")


def precision(cfg: TrainConfig, accelerator: bool) -> Precision:
    pbytes = _BYTES[cfg.run.dtype]
    master = _BYTES[cfg.optim.master_dtype] if cfg.optim.master_dtype != "param" else 0
    act = 2 if (accelerator and cfg.run.autocast_bf16 and cfg.run.dtype != "float64") else pbytes
    moment = 2 if cfg.optim.moments_dtype == "bfloat16" else master or pbytes
    moments = 1 if cfg.optim.name == "sgd" else 2
    return Precision(act=act, param=pbytes, moment=moment, moments=moments,
                     attention="flash" if accelerator else "reference", master=master)


def _device(device: str | None) -> tuple[str, int | None, bool]:
    """(name, capacity bytes or None, is an accelerator) for a device name from ``accel.specs`` or "cpu"."""
    if device is None or device.lower() == "cpu":
        return "cpu", None, False
    spec = specs.lookup(device)
    if spec is None:
        raise ValueError(f"--device {device!r}: unknown device; expected cpu or one of "
                         f"{', '.join(specs.known_devices())}")
    return spec.name, int(spec.memory_gib * GiB) if spec.memory_gib else None, True


def stage_activation_bytes(args: ModelArgs, cfg: TrainConfig, p: Precision) -> tuple[list[int], list[int], dict]:
    """(bytes one micro-batch keeps on each stage, the stage's working set on top, per-item detail)."""
    par, data = cfg.parallel, cfg.data
    seq, mb = data.seq_len, data.micro_batch
    tokens = seq * mb
    num = num_model_stages(par.schedule, par.pp)
    slots = None
    if cfg.eplb.enabled:
        slots = (args.n_routed_experts + cfg.eplb.redundant_experts) // par.ep
    fused = fused_cross_entropy(args)
    saved, work = [], []
    detail: dict[str, float] = {}
    for s, (lo, hi) in enumerate(split_layers(args, num)):
        per_token = sum(block_saved(args, i, seq, mb, p, par.ep, slots) for i in range(lo, hi))
        ws = max((block_working_set(args, i, seq, mb, p, par.ep, slots) for i in range(lo, hi)), default=0.0)
        if s == 0:
            per_token += 0  # the embedding's backward keeps only the token ids
        if s == num - 1:
            per_token += criterion_saved(args, fused, p, mb)
            per_token += sum(block_saved(args, args.n_layers + k, seq, mb, p, par.ep, slots)
                             for k in range(args.n_mtp_layers))
            ws = max(ws, criterion_working_set(args, fused, p, tokens))
        if lo < hi:
            for k, v in attention_saved(args, lo, seq, mb, p).items():
                detail[f"attention: {k}"] = max(detail.get(f"attention: {k}", 0), v * tokens)
            for k, v in ffn_saved(args, hi - 1, tokens, mb, p, par.ep, slots).items():
                detail[f"ffn: {k}"] = max(detail.get(f"ffn: {k}", 0), v * tokens)
        saved.append(int(per_token * tokens))
        work.append(int(ws * tokens))
    return saved, work, {k: int(v) for k, v in detail.items()}


def _live_activation_peak(cfg: TrainConfig, per_stage: list[int]) -> tuple[list[int], list[int]]:
    """Per rank: (peak bytes of the (stage, micro-batch) activations alive at once, how many at that peak),
    from the largest step's schedule (each rank's items in order)."""
    par = cfg.parallel
    if par.schedule == "none":
        return [per_stage[0]], [1]
    chunks = max(cfg.microbatches_at(s) for s in {0, cfg.data.batch_ramp_steps, cfg.run.steps - 1})
    peaks, counts = [], []
    for states in _live_states(par.schedule, par.pp, chunks, len(per_stage)):
        peak = n_at_peak = 0
        for state in states:
            live = sum(c * per_stage[s] for s, c in state)
            if live > peak:
                peak, n_at_peak = live, sum(c for _, c in state)
        peaks.append(peak)
        counts.append(n_at_peak)
    return peaks, counts


@functools.lru_cache(maxsize=256)
def _live_states(schedule: str, pp: int, chunks: int, num: int) -> tuple[tuple[tuple[tuple[int, int], ...], ...], ...]:
    """Per rank, the distinct (model stage, live count) states right after each forward, in order of first
    appearance: the peak of any per-stage sizes is among them. Memoised: a planner asks for thousands of
    layouts of the same few schedules."""
    out = []
    for items in built(schedule, pp, chunks).actions:  # a rank runs its items in order: no timing needed
        live: dict[int, int] = {}
        seen: dict[tuple[tuple[int, int], ...], None] = {}
        for item in items:
            for act in item.parts:
                s = act.stage % num
                if act.kind == "F":
                    live[s] = live.get(s, 0) + 1
                    seen.setdefault(tuple(sorted(live.items())), None)
                elif act.kind in ("B", "W"):
                    live[s] -= 1
        out.append(tuple(seen))
    return tuple(out)


def _comm_bytes(args: ModelArgs, cfg: TrainConfig, p: Precision) -> int:
    """Expert all-to-all buffers of one micro-batch in flight (dispatch send + receive, combine receive;
    two at once under DualPipe's overlap) and pipeline P2P buffers (a send and a receive per direction)."""
    par, data = cfg.parallel, cfg.data
    tokens = data.seq_len * data.micro_batch
    d = args.dim
    out = 0.0
    if par.ep > 1 and args.has_moe:
        dispatch = FP8_BYTES if args.fp8 else p.act
        rows = tokens * args.n_activated_experts
        out += rows * d * (2 * dispatch + p.act)
        if par.schedule in ("dualpipe", "dualpipev") and par.overlap:
            out *= 2
    if par.pp > 1:
        directions = 2 if par.schedule in ("dualpipe", "dualpipev", "zbv") else 1
        out += 2 * directions * tokens * d * p.act
    return int(out)


def _optimizer_step_transient(args: ModelArgs, cfg: TrainConfig, p: Precision) -> int:
    """Temporaries of the optimizer step: three fp32 tensors of the largest parameter (torch's AdamW and
    SGD update one tensor at a time), or of one ``training.optim.STEP_CHUNK`` chunk for ``AdamW``."""
    largest = _module_param_counts(args, cfg.parallel.ep)["largest tensor"][0]
    if cfg.optim.moments_dtype == "bfloat16" or cfg.optim.ema_decay or cfg.optim.master_dtype != "param":
        largest = min(largest, STEP_CHUNK)
    return int(3 * 4 * largest)


def estimate(cfg: TrainConfig, args: ModelArgs | None = None, *, device: str | None = None) -> MemoryEstimate:
    """Per pipeline rank peak memory of ``cfg``'s layout at its largest batch, on ``device`` (a name
    ``accel.specs`` knows, e.g. "H800", or "cpu"/None: the CPU reference kernels, no capacity).

    ``args`` defaults to the config's model arguments (``training.trainer.model_args``).
    """
    if args is None:
        args = model_args(cfg)
    name, capacity, accelerator = _device(device)
    p = precision(cfg, accelerator)
    par = cfg.parallel
    counts = stage_param_counts(args, cfg)
    saved, work, detail = stage_activation_bytes(args, cfg, p)
    peaks, live = _live_activation_peak(cfg, saved)
    comm = _comm_bytes(args, cfg, p)
    step_transient = _optimizer_step_transient(args, cfg, p)
    shard_dense = par.dp if par.zero1 else 1
    shard_expert = (par.dp // par.ep) if par.zero1 else 1
    ranks = []
    for r in range(par.pp):
        mine = stage_ids(par.schedule, par.pp, r)
        dense = sum(counts[s][0] for s in mine)
        expert = sum(counts[s][1] for s in mine)
        items = {
            "weights": (dense + expert) * p.param,
            "gradients": (dense + expert) * p.grad,
            "optimizer": int((p.moments * p.moment + p.master) * (dense / shard_dense + expert / shard_expert)),
            "activations": peaks[r],
        }
        items["transient"] = max(max(work[s] for s in mine), step_transient - items["activations"], 0)
        items["comm"] = comm
        if accelerator:
            share, fixed = ALLOCATOR_MARGIN
            items["margin"] = int(share * (items["activations"] + items["transient"] + comm) + fixed)
        # the EMA and its snapshot buffer, of this rank's ZeRO-1 shard
        host = {"ema": int(2 * 4 * (dense / shard_dense + expert / shard_expert))} if cfg.optim.ema_decay else {}
        ranks.append(RankMemory(r, mine, dense + expert, expert, live[r], {k: int(v) for k, v in items.items()},
                                host, detail))
    return MemoryEstimate(name, capacity, ranks, p)


def format_estimate(cfg: TrainConfig, args: ModelArgs, est: MemoryEstimate) -> str:
    """The dry run's table: one line per pipeline rank (GiB), then the verdict."""
    counts = args.param_counts()
    p = est.precision
    act = {2: "bf16", 4: "fp32", 8: "fp64"}[int(p.act)]
    moments = {2: "bf16", 4: "fp32", 8: "fp64"}[p.moment]
    weights = (f"weights {cfg.run.dtype} {p.param} B/param, grads {cfg.optim.master_dtype} {p.grad} B/param, "
               f"{cfg.optim.master_dtype} master weights {p.master} B/param in the optimizer (/ZeRO-1 shards)"
               if p.master else f"weights/grads {cfg.run.dtype}")
    lines = [f"model {cfg.model.preset}: {counts['total'] / 1e9:.1f}B parameters, "
             f"{counts['activated'] / 1e9:.1f}B activated per token (MTP excluded, as published)",
             f"device: {est.device}" + (f" ({est.capacity_bytes / GiB:.1f} GiB)" if est.capacity_bytes else
                                        " (no capacity: pass --device, e.g. --device H800)"),
             f"per-rank memory ({weights}, AdamW moments {moments} ZeRO-1 "
             f"{'on' if cfg.parallel.zero1 else 'off'}, activations {act}, recompute {list(args.recompute) or 'none'}, "
             f"fp8 {args.fp8} (activation caching {_fp8_cache(args)}), fused CE {fused_cross_entropy(args)}, "
             f"micro-batch {cfg.data.micro_batch} x {cfg.data.seq_len} tokens; GiB):",
             f"{'pp rank':>7} {'stages':>7} {'params':>8} {'weights':>8} {'grads':>7} {'optim':>7} {'live mb':>7} "
             f"{'act':>7} {'transnt':>7} {'comm':>6} {'margin':>7} {'total':>7}"]
    for e in est.ranks:
        it = e.items
        lines.append(f"{e.pp_rank:>7} {','.join(map(str, e.stages)):>7} {e.params / 1e9:>7.2f}B "
                     f"{it['weights'] / GiB:>8.2f} {it['gradients'] / GiB:>7.2f} {it['optimizer'] / GiB:>7.2f} "
                     f"{e.peak_microbatches:>7} {it['activations'] / GiB:>7.2f} {it['transient'] / GiB:>7.2f} "
                     f"{it['comm'] / GiB:>6.2f} {it.get('margin', 0) / GiB:>7.2f} {e.total_bytes / GiB:>7.2f}")
    if est.ranks and est.ranks[0].host:
        lines.append(f"host (not on the device): parameter EMA {est.ranks[0].host['ema'] / GiB:.2f} GiB per rank")
    if est.capacity_bytes is not None:
        share, fixed = ALLOCATOR_MARGIN
        lines.append(f"margin = {share:.0%} of activations + transient + comm, + {fixed / GiB:.0f} GiB "
                     "(context, communicator buffers, workspaces)")
    lines.append("verdict: " + est.verdict())
    return "\n".join(lines)
