"""Per-rank memory model of a training layout: what each pipeline rank holds at its peak, without allocating.

``estimate(cfg, device="H800")`` is the public entry point (the dry run, ``recipes.memory_report`` and
the layout planner call it). Per pipeline rank (all data-parallel ranks of a stage are alike) it adds:

- **weights** and **gradients**: ``numel x bytes(run.dtype)`` of the stages the schedule puts there
  (DualPipe holds two mirrored stages, DualPipeV/ZBV two stages of a V), counted on a ``meta`` model
  built with one expert-parallel slice of the routed experts (EPLB's redundant slots included); with
  ``optim.master_dtype = "float32"`` (V3) the weights are BF16 (2 B) and the gradients FP32 (4 B,
  ``main_grad`` buffers);
- **optimizer**: AdamW's two moments in ``optim.moments_dtype`` (fp32, or bf16 as V3) per parameter; with
  ``optim.name = "muon"`` one momentum buffer for each parameter Muon updates (``training.optim.uses_muon``: the
  hidden matrices and every routed expert) and AdamW's two for the rest (the DSA warm-up's indexers are counted
  as AdamW's); plus the FP32 master copy (4 B) when ``optim.master_dtype = "float32"``, sharded by ZeRO-1 over the
  stage's ``dp``
  ranks (dense parameters) and the ``dp / ep`` expert replicas (experts), as an even split
  (``ZeroRedundancyOptimizer`` assigns whole tensors, so a shard can differ slightly);
- **activations**: the bytes each (stage, micro-batch) keeps for backward, *measured*: every block, MTP
  module and loss head of the stage runs forward and backward at the config's micro-batch shape on the
  ``meta`` device (``planner.memory_measure``: the model's own code, the GPU kernels' wrappers on an
  accelerator, the PyTorch references on a CPU; balanced routing), counting the storages still alive after
  its forward; summed over the (stage, micro-batch) pairs alive at once on the rank, walking each rank's
  schedule from ``dualpipe.schedules`` (1F1B: pp - rank, DualPipe: pp + 1, interleaved 1F1B: rank 0 holds
  2 (pp - 1) + (vpp - 1) pp + 1 chunk activations of 1/vpp of its share each, ...);
- **transient**: the most bytes alive on top of those while one piece runs (measured the same way: a GEMM's
  backward buffers, what recompute rebuilds, the loss head's chunked logits and its fp32 weight gradient),
  or the optimizer step's temporaries (``_optimizer_step_transient``: three fp32 tensors of the largest
  parameter or ``training.optim.STEP_CHUNK``, as ``torch.optim.AdamW`` and ``training.optim.AdamW`` update);
- **comm**: expert all-to-all send/receive buffers in flight and pipeline P2P buffers (``_comm_bytes``:
  sizes of the buffers ``expert_parallel`` and the pipeline runtime post, not measured: they are not
  autograd tensors of a piece);
- **margin**: a stated allocator margin on accelerators (``ALLOCATOR_MARGIN``): 10% of the dynamic
  part for the caching allocator's fragmentation plus 2 GiB for the CUDA/MUSA context, the
  communicator's buffers and library workspaces, none of which ``max_memory_allocated`` sees (an
  assumption, not measured: no GPU run has calibrated it).

Under context parallelism (``parallel.cp``) every piece is measured at the local length ``seq_len / cp``, each MLA
block adds the whole sequence's all-gathered latent (and DSA's indexer keys) and its exchange buffers
(``context_parallel_extra``, ``_comm_bytes``), and ZeRO-1 and EP span the cp x dp ranks of a stage.

The host holds the parameter EMA (``optim.ema_decay``) apart from the device. MoE rows assume
balanced routing (each expert ``T k / E`` rows per micro-batch, padded to the grouped GEMM's alignment).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from accel import specs
from dualpipe.ir import Overlap
from dualpipe.schedules import built, min_microbatches
from models.deepseek_v3 import ModelArgs, Transformer
from models.deepseek_v3.args import RECOMPUTE_KINDS
from models.deepseek_v3.indexer import Indexer
from models.deepseek_v4 import Transformer as V4Transformer
from models.deepseek_v4.model import Indexer as V4Indexer
from planner import memory_measure as measure
from planner import memory_v4
from planner.memory_measure import Measured
from planner.memory_v4 import is_v4
from training.config import TrainConfig, schedule_of
from training.optim import STEP_CHUNK, is_expert_param, uses_muon
from training.stages import expert_range, num_model_stages, split_layers, stage_ids
from training.trainer import model_args

GiB = 1024**3
_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2}
# bytes per FP8 activation value with its scale, per model.fp8_recipe: blockwise (V3) one fp32 scale per 1x128
# tile, mxfp8 one UE8M0 byte per 1x32 block -- the same 1/32 byte of scale per value either way
FP8_VALUE_BYTES = {"blockwise": 1 + 4 / 128, "mxfp8": 1 + 1 / 32}
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
    with torch.device("meta"):  # V4's model holds every routed expert: one EP rank's share is 1 / ep of them
        model = V4Transformer(args) if is_v4(args) else Transformer(args, expert_ids=experts)
    share = ep if is_v4(args) else 1

    def count(module: torch.nn.Module, prefix: str, muon: bool = False) -> tuple[int, int]:
        dense = expert = 0
        for name, prm in module.named_parameters(prefix=prefix):
            if muon and not uses_muon(name, prm):
                continue
            if is_expert_param(name):
                expert += prm.numel() // share
            else:
                dense += prm.numel()
        return dense, expert

    out = {}
    for muon in (False, True):  # "<module> muon": the part of it Muon updates (optim.name = "muon")
        tag = " muon" if muon else ""
        out.update({f"layers.{i}{tag}": count(layer, f"layers.{i}", muon) for i, layer in enumerate(model.layers)})
        for name in _TOP_MODULES:
            out[f"{name}{tag}"] = count(getattr(model, name), name, muon) if hasattr(model, name) else (0, 0)
    out["largest tensor"] = (max(prm.numel() // (share if is_expert_param(name) else 1)
                                 for name, prm in model.named_parameters()), 0)
    return out


_TOP_MODULES = ("embed", "norm", "head", "mtp", "hc_head")  # V4 collapses its streams by hc_head before the norm


def stage_param_counts(args: ModelArgs, cfg: TrainConfig, muon: bool = False) -> list[tuple[int, int]]:
    """(dense, expert) parameter counts of each global stage for one EP rank (EPLB's redundant slots
    included: ``(E + redundant) / ep`` slots per rank instead of ``E / ep``); ``muon``: of the parameters Muon
    updates only."""
    par = cfg.parallel
    num = num_model_stages(par.schedule, par.pp, par.vpp)
    counts = _module_param_counts(args, par.ep)
    scale = (args.n_routed_experts + cfg.eplb.redundant_experts) / args.n_routed_experts if cfg.eplb.enabled else 1
    out = []
    for s, (lo, hi) in enumerate(split_layers(args, num)):
        parts = [f"layers.{i}" for i in range(lo, hi)]
        if s == 0:
            parts.append("embed")
        if s == num - 1:
            parts += ["norm", "head", "mtp", "hc_head"]
            if s != 0 and args.n_mtp_layers and not par.layout.same_rank(0, s):
                parts.append("embed")  # a separate copy for MTP
        tag = " muon" if muon else ""
        dense = sum(counts[n + tag][0] for n in parts)
        expert = sum(counts[n + tag][1] for n in parts)
        out.append((dense, int(expert * scale)))
    return out


def stage_indexer_counts(args: ModelArgs, cfg: TrainConfig) -> list[int]:
    """Parameters of each global stage's lightning indexers (DeepSeek-V3.2; V4's CSA layers): what trains in the
    DSA warm-up."""
    per_layer = _indexer_params(args)
    mtp_stage = num_model_stages(cfg.parallel.schedule, cfg.parallel.pp, cfg.parallel.vpp) - 1
    return [sum(per_layer[lo:hi]) + (sum(per_layer[args.n_layers:]) if s == mtp_stage else 0)
            for s, (lo, hi) in enumerate(split_layers(args, mtp_stage + 1))]


def _indexer_params(args: ModelArgs) -> list[int]:
    """Each layer's (then each MTP layer's) indexer parameter count: V3.2's on every layer, V4's on CSA layers."""
    with torch.device("meta"):
        if is_v4(args):
            size = sum(p.numel() for p in V4Indexer(args).parameters())
            return [size if r == 4 else 0 for r in args.compress_ratios]
        size = sum(p.numel() for p in Indexer(args).parameters())
    return [size] * (args.n_layers + args.n_mtp_layers)


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

    @property
    def optim_bytes(self) -> int:
        return self.items["optimizer"]

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


def context_parallel_extra(args: ModelArgs, layer_id: int, micro_batch: int, seq: int, cp: int, act: float) -> Measured:
    """What one MLA block holds under context parallelism ``cp`` besides the block at its local length ``seq / cp``
    (``seq``: the whole sequence). Saved for backward: the all-gathered latent of the whole sequence
    (``kv_lora_rank + qk_rope_head_dim`` = 576 values per token for V3) and, with DSA, the all-gathered indexer
    keys (``index_head_dim`` per token); a block recomputed whole keeps neither (it gathers them again).
    Transient: the gathered latent's gradient before its reduce-scatter, and for dense attention (V3, DSA's
    warm-up) the per-head keys and values up-projected from the gathered latent for the whole sequence and their
    gradients (``n_heads x (qk_head_dim + v_head_dim)`` per token, one block at a time, rebuilt in backward);
    DSA's sparse attention reads the selected latent rows instead. 0 without CP."""
    if cp <= 1:
        return Measured(0, 0)
    tokens = micro_batch * seq
    latent = tokens * (args.kv_lora_rank + args.qk_rope_head_dim) * act
    keys = tokens * args.index_head_dim * act if args.index_topk else 0
    transient = latent
    if not args.sparse:
        transient += 2 * tokens * args.n_heads * (args.qk_head_dim + args.v_head_dim) * act
    if args.recomputes("block", layer_id):
        return Measured(0, int(transient + latent + keys))
    return Measured(int(latent + keys), int(transient))


def _layer(args: ModelArgs, layer_id: int, micro_batch: int, seq: int, p: Precision, slots: int,
           cp: int = 1) -> Measured:
    """One block as ``memory_measure`` measured it (all routed experts on the rank) at the local length ``seq``,
    with its routed experts swapped for one expert-parallel rank's ``slots`` (their rows and weight-gradient
    buffers differ), plus what context parallelism ``cp`` adds (``context_parallel_extra``)."""
    accelerator = p.attention == "flash"
    m = measure.block(args, layer_id, micro_batch, seq, p.act, accelerator)
    e = args.n_routed_experts
    if args.is_moe_layer(layer_id) and slots != e:
        tokens = micro_batch * seq
        out, into = (measure.experts(args, layer_id, tokens, n, p.act, accelerator) for n in (e, slots))
        if args.recomputes("block", layer_id):  # a recomputed block keeps only its input: the rest is transient
            out, into = Measured(0, out.saved + out.transient), Measured(0, into.saved + into.transient)
        m = m.swap(out, into)
    extra = context_parallel_extra(args, layer_id, micro_batch, seq * cp, cp, p.act)
    return Measured(m.saved + extra.saved, m.transient + extra.transient)


def _mtp(args: ModelArgs, depth: int, micro_batch: int, seq: int, p: Precision, slots: int, cp: int = 1) -> Measured:
    """MTP depth ``depth + 1``: its input projection, its block and its loss head, on ``seq`` positions
    (depth k really runs on ``seq - k``: at most ``k / seq`` less), its experts swapped as ``_layer``'s."""
    accelerator, layer_id = p.attention == "flash", args.n_layers + depth
    return (measure.mtp_projection(args, depth, micro_batch, seq, p.act, accelerator)
            .then(_layer(args, layer_id, micro_batch, seq, p, slots, cp))
            .then(measure.head(args, args.recomputes("norm", layer_id), micro_batch, seq, p.act, accelerator)))


def stage_activation_bytes(args: ModelArgs, cfg: TrainConfig, p: Precision) -> tuple[list[int], list[int], dict]:
    """(bytes one micro-batch keeps on each stage, the most bytes alive on top of those while one of its pieces
    runs, per-piece detail: the largest bytes one micro-batch keeps in each kind of piece), measured
    (``planner.memory_measure``) at the config's micro-batch shape, at the local length ``seq_len / cp`` under
    context parallelism (plus ``context_parallel_extra`` per block); the layers' pieces keep their own input
    (the block before hands it on), the last stage adds the loss heads and the MTP modules. DeepSeek-V4:
    ``planner.memory_v4.stage_activation_bytes``."""
    if is_v4(args):
        return memory_v4.stage_activation_bytes(args, cfg, p)
    par, data = cfg.parallel, cfg.data
    seq, mb, cp = data.seq_len // par.cp, data.micro_batch, par.cp
    num = num_model_stages(par.schedule, par.pp, par.vpp)
    slots = (args.n_routed_experts + (cfg.eplb.redundant_experts if cfg.eplb.enabled else 0)) // par.ep
    layers: dict[tuple, Measured] = {}  # layers alike (kind, recompute) measure alike

    def layer(i: int) -> Measured:
        key = (args.is_moe_layer(i), *(args.recomputes(k, i) for k in RECOMPUTE_KINDS))
        if key not in layers:
            layers[key] = _layer(args, i, mb, seq, p, slots, cp)
        return layers[key]

    accelerator = p.attention == "flash"
    stages = []
    for s, (lo, hi) in enumerate(split_layers(args, num)):
        pieces = [("MoE layer" if args.is_moe_layer(i) else "dense layer", layer(i)) for i in range(lo, hi)]
        if s == num - 1:
            recompute_norm = "norm" in args.recompute_kinds  # the main head's (``lm_losses_from_hidden``)
            pieces.append(("loss head", measure.head(args, recompute_norm, mb, seq, p.act, accelerator)))
            pieces += [(f"MTP depth {k + 1} (module + head)", _mtp(args, k, mb, seq, p, slots, cp))
                       for k in range(args.n_mtp_layers)]
        stages.append(pieces)
    return measure.stage_totals(stages)


def _live_activation_peak(cfg: TrainConfig, per_stage: list[int]) -> tuple[list[int], list[int]]:
    """Per rank: (peak bytes of the (stage, micro-batch) activations alive at once, how many at that peak),
    from the largest step's schedule (each rank's items in order)."""
    par = cfg.parallel
    if par.schedule == "none":
        return [per_stage[0]], [1]
    chunks = max(schedule_of(cfg).batch_sizes()) // (par.dp * cfg.data.micro_batch)
    peaks, counts = [], []
    for states in _live_states(par.schedule, par.pp, chunks, len(per_stage), par.vpp):
        peak = n_at_peak = 0
        for state in states:
            live = sum(c * per_stage[s] for s, c in state)
            if live > peak:
                peak, n_at_peak = live, sum(c for _, c in state)
        peaks.append(peak)
        counts.append(n_at_peak)
    return peaks, counts


@functools.lru_cache(maxsize=256)
def _live_states(schedule: str, pp: int, chunks: int, num: int, vpp: int = 1
                 ) -> tuple[tuple[tuple[tuple[int, int], ...], ...], ...]:
    """Per rank, the distinct (model stage, live count) states right after each forward, in order of first
    appearance: the peak of any per-stage sizes is among them. Memoised: a planner asks for thousands of
    layouts of the same few schedules."""
    out = []
    for items in built(schedule, pp, chunks, vpp).actions:  # a rank runs its items in order: no timing needed
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


def recipe_of(cfg: TrainConfig, override: str | None = None) -> str:
    """The FP8 recipe of ``cfg`` (``model.fp8_recipe``; "blockwise" where the config has no such field), or
    ``override``; ValueError for anything but the two recipes."""
    recipe = override or getattr(cfg.model, "fp8_recipe", "blockwise")
    if recipe not in FP8_VALUE_BYTES:
        raise ValueError(f"model.fp8_recipe: expected one of {sorted(FP8_VALUE_BYTES)}, got {recipe!r}")
    return recipe


def _comm_bytes(args: ModelArgs, cfg: TrainConfig, p: Precision, recipe: str = "blockwise") -> int:
    """Expert all-to-all buffers of one micro-batch in flight (dispatch send + receive, combine receive;
    two at once under DualPipe's overlap), pipeline P2P buffers (a send and a receive per direction), both of the
    local tokens under context parallelism, and its all-gather / reduce-scatter buffers (the whole sequence's
    latent, and DSA's indexer keys: one forward and one backward in flight). DeepSeek-V4: ``memory_v4.comm_bytes``."""
    par, data = cfg.parallel, cfg.data
    if is_v4(args):
        dispatch = FP8_VALUE_BYTES[recipe] if args.fp8 else p.act
        overlapped = par.overlap and _has_overlapped_chunks(par.schedule, par.pp, par.vpp)
        return memory_v4.comm_bytes(args, cfg, p, dispatch, overlapped)
    tokens = data.seq_len // par.cp * data.micro_batch
    d = args.dim
    out = 0.0
    if par.ep > 1 and args.has_moe:
        dispatch = FP8_VALUE_BYTES[recipe] if args.fp8 else p.act
        rows = tokens * args.n_activated_experts
        out += rows * d * (2 * dispatch + p.act)
        if par.overlap and _has_overlapped_chunks(par.schedule, par.pp, par.vpp):
            out *= 2
    if par.pp > 1:
        directions = par.layout.num_stages // par.pp  # chains through a rank: two for a V or mirrored pipeline
        out += 2 * directions * tokens * d * p.act
    if par.cp > 1:
        per_token = args.kv_lora_rank + args.qk_rope_head_dim + (args.index_head_dim if args.index_topk else 0)
        out += 2 * data.seq_len * data.micro_batch * per_token * p.act
    return int(out)


@functools.lru_cache(maxsize=64)
def _has_overlapped_chunks(schedule: str, pp: int, vpp: int = 1) -> bool:
    """Whether the schedule pairs a forward with a backward (two micro-batches' exchanges in flight at once)."""
    if schedule == "none":
        return False
    sched = built(schedule, pp, min_microbatches(schedule, pp), vpp)
    return any(isinstance(item, Overlap) for items in sched.actions for item in items)


def _optimizer_step_transient(args: ModelArgs, cfg: TrainConfig, p: Precision) -> int:
    """Temporaries of the optimizer step: three fp32 tensors of the largest parameter (torch's AdamW and
    SGD update one tensor at a time), or of one ``training.optim.STEP_CHUNK`` chunk for ``AdamW``."""
    largest = _module_param_counts(args, cfg.parallel.ep)["largest tensor"][0]
    if cfg.optim.moments_dtype == "bfloat16" or cfg.optim.ema_decay or cfg.optim.master_dtype != "param":
        largest = min(largest, STEP_CHUNK)
    return int(3 * 4 * largest)


def estimate(cfg: TrainConfig, args: ModelArgs | None = None, *, device: str | None = None,
             fp8_recipe: str | None = None) -> MemoryEstimate:
    """Per pipeline rank peak memory of ``cfg``'s layout at its largest batch, on ``device`` (a name
    ``accel.specs`` knows, e.g. "H800", or "cpu"/None: the CPU reference kernels, no capacity).

    ``args`` defaults to the config's model arguments (``training.trainer.model_args``); ``fp8_recipe``
    overrides ``model.fp8_recipe`` (the planner's ``--fp8-recipe``).
    """
    if args is None:
        args = model_args(cfg)
    name, capacity, accelerator = _device(device)
    p = precision(cfg, accelerator)
    par = cfg.parallel
    counts = stage_param_counts(args, cfg)
    # optim.name = "muon": one momentum buffer instead of AdamW's two on what Muon updates
    muon_counts = stage_param_counts(args, cfg, muon=True) if cfg.optim.name == "muon" else [(0, 0)] * len(counts)
    saved, work, detail = stage_activation_bytes(args, cfg, p)
    peaks, live = _live_activation_peak(cfg, saved)
    comm = _comm_bytes(args, cfg, p, recipe_of(cfg, override=fp8_recipe))
    step_transient = _optimizer_step_transient(args, cfg, p)
    shard_dense = par.cp * par.dp if par.zero1 else 1  # ZeRO-1 and EP span the cp x dp ranks of a stage
    shard_expert = (par.cp * par.dp // par.ep) if par.zero1 else 1
    ranks = []
    indexers = stage_indexer_counts(args, cfg) if getattr(args, "dsa_warmup", False) else None
    for r in range(par.pp):
        mine = stage_ids(par.schedule, par.pp, r, par.vpp)
        dense = sum(counts[s][0] for s in mine)
        expert = sum(counts[s][1] for s in mine)
        # the DSA warm-up trains the indexers only: nothing else has a gradient or optimizer state
        train_dense, train_expert = (sum(indexers[s] for s in mine), 0) if indexers else (dense, expert)
        muon_dense, muon_expert = (0, 0) if indexers else (sum(muon_counts[s][0] for s in mine),
                                                           sum(muon_counts[s][1] for s in mine))
        per_state = train_dense / shard_dense + train_expert / shard_expert  # master copy: every trained element
        moments = p.moments * per_state - (p.moments - 1) * (muon_dense / shard_dense + muon_expert / shard_expert)
        items = {
            "weights": (dense + expert) * p.param,
            "gradients": (train_dense + train_expert) * p.grad,
            "optimizer": int(moments * p.moment + p.master * per_state),
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
             f"fp8 {args.fp8} (activation caching {args.fp8_cache}), "
             f"micro-batch {cfg.data.micro_batch} x {cfg.data.seq_len} tokens"
             + (f", {cfg.data.seq_len // cfg.parallel.cp} per rank over cp {cfg.parallel.cp}" if cfg.parallel.cp > 1
                else "") + "; GiB):",
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
    par = cfg.parallel
    slots = (args.n_routed_experts + (cfg.eplb.redundant_experts if cfg.eplb.enabled else 0)) // par.ep
    pieces = memory_v4.pieces if is_v4(args) else measure.pieces
    parts = pieces(args, cfg.data.micro_batch, cfg.data.seq_len // par.cp, p.act, p.attention == "flash", slots)
    lines.append("measured per micro-batch, saved for backward (MiB; planner.memory_measure, on meta): " + ", ".join(
        f"{k} {m.saved / 2**20:.1f}" for k, m in parts.items()) + f" (routed experts: {slots} slots of one EP rank)")
    if est.capacity_bytes is not None:
        share, fixed = ALLOCATOR_MARGIN
        lines.append(f"margin = {share:.0%} of activations + transient + comm, + {fixed / GiB:.0f} GiB "
                     "(context, communicator buffers, workspaces)")
    lines.append("verdict: " + est.verdict())
    return "\n".join(lines)
