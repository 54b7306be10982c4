"""The time model: per-operation FLOPs and bytes of DeepSeek-V3 layers, roofline durations, communication.

Every operation of a layer (MLA projections, attention core, router, grouped expert GEMMs, shared
experts, norms, RoPE, SwiGLU, the head and the MTP module) gets forward FLOPs and bytes from the
model's real shapes and is split into forward (F), input-gradient (I) and weight-gradient (W)
parts, so zero-bubble schedules can place W on their own:

- a GEMM ``[m, k] x [k, n]`` costs ``2 m n k`` FLOPs in each of F, I (dgrad) and W (wgrad);
- the causal attention core costs ``2 s^2 h (d_qk + d_v) / 2`` per sequence forward and 2.5x that
  backward (FlashAttention's five GEMMs against two), all in I; DeepSeek-V3.2's sparse core ``2 s k h
  (576 + 512)`` (O(s k)) plus its lightning indexer, whose FP8 logits stay O(s^2) (``dsa_ops``);
- memory-bound ops (norms, RoPE, SwiGLU, the MoE permute/unpermute, cross-entropy) move their bytes
  forward and twice that backward, plus the system's fixed cost per kernel (``memory_latency_us``) in each
  pass; permutes and cross-entropy have their own kernel classes (their index gathers and vocabulary-wide
  softmax run well below a plain copy's bandwidth).

Duration = max(FLOPs / (peak x efficiency), bytes / (HBM bandwidth x efficiency)) with the system
file's efficiency for the kernel class, or for the shape and pass (F, I, W) where its tables have it.
FP8 GEMMs (``model.fp8``: the attention projections and every expert/FFN Linear) run at the FP8 peak
with the recipe's efficiency class (``blockwise``: V3's 1x128 / 128x128 scales, ``fp8_*``; ``mxfp8``:
1x32 blocks with UE8M0 scales, ``mxfp8_*``) and pay a quantisation pass (read BF16, write E4M3 and
scales) over their input forward and their output gradient backward; the router, the head and the
attention core stay BF16 as in V3.

Communication per MoE layer and micro-batch: dispatch (FP8 with ``fp8``, 1 byte + the recipe's scale
bytes per value) and combine (BF16), the same volumes again backward, each call paying the system's
fixed all-to-all cost for its group size. Inside a node the volume is ``tokens x top-k x (ep-1)/ep x
dim`` over NVLink; across nodes each token crosses InfiniBand once per distinct remote node it is
routed to (node-limited routing caps that at ``max_nodes``) and is forwarded over NVLink inside the
node, both at once, as DeepSeek's dispatch does.
Context parallelism (``Workload.cp``): each rank computes its ``seq_len / cp`` positions (2 x cp chunks, rank r
holding r and 2cp-1-r, so every rank has the same causal work) against the whole sequence's keys; per MLA layer
the latent (576 values per token) is all-gathered forward and its gradient reduce-scattered backward, behind
the query projections (``context_parallel_seconds``), and dense attention up-projects the gathered latent to
per-head keys and values (``context_parallel_ops``).

Optimizer (``optim.name = "muon"``): Newton-Schulz on each matrix Muon updates (``newton_schulz_flops``), once per
matrix on the rank owning its ZeRO-1 state; its collectives are AdamW's (the owner's updated parameters reach the
other ranks as ZeRO-1's all-gather does), its state one momentum buffer (``planner.memory``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from models.deepseek_v3 import ModelArgs, Transformer
from models.deepseek_v3.args import RECOMPUTE_ALIASES
from models.deepseek_v4 import ModelArgs as V4Args
from models.deepseek_v4 import Transformer as V4Transformer
from planner import costs_v4
from planner.system import System
from training.optim import is_expert_param, muon_matrices, newton_schulz_flops, uses_muon
from training.stages import expert_range

BF16 = 2
# scale bytes per FP8 value of an activation: blockwise one fp32 per 1x128 tile, MXFP8 one UE8M0 byte per 1x32 block
FP8_SCALE_BYTES = {"blockwise": 4 / 128, "mxfp8": 1 / 32}
FP8_BYTES = 1 + FP8_SCALE_BYTES["blockwise"]  # E4M3 value plus its scale (the same under MXFP8: 1/32 byte per value)
MEMORY_KINDS = ("memory", "permute", "cross_entropy")  # memory-bound ops, each kind its own efficiency class
# planner policy -> model.overrides.recompute names ("v3" = every RMSNorm and the MLA up-projections)
RECOMPUTE_POLICIES = {"none": (), "v3": ("v3",), "block": ("block",)}


def recompute_kinds(policy: str) -> tuple[str, ...]:
    """The ModelArgs.recompute kinds a policy re-runs in backward (aliases expanded)."""
    return tuple(k for name in RECOMPUTE_POLICIES[policy] for k in RECOMPUTE_ALIASES.get(name, (name,)))


@dataclass(frozen=True)
class Op:
    """One operation of a layer at a given number of tokens."""

    name: str
    kind: str  # gemm | grouped_gemm | attention | memory | permute | cross_entropy
    flops: float = 0.0  # forward
    nbytes: float = 0.0  # forward memory traffic
    shape: str | None = None  # "MxNxK" per group, the calibration key
    fp8: bool = False
    quant_bytes: tuple[float, float] = (0.0, 0.0)  # FP8 quantisation traffic forward, backward
    recompute_kind: str | None = None  # the ModelArgs.recompute kind that re-runs this op in backward


def gemm(name: str, m: float, n: int, k: int, fp8: bool = False, groups: int = 1,
         recompute_kind: str | None = None) -> Op:
    """``m`` rows (all groups together) times a ``[k, n]`` weight per group."""
    eb = 1 if fp8 else BF16
    nbytes = m * k * eb + groups * n * k * eb + m * n * BF16
    kind = "grouped_gemm" if groups > 1 else "gemm"
    quant = (m * k * (BF16 + FP8_BYTES), m * n * (BF16 + FP8_BYTES)) if fp8 else (0.0, 0.0)
    return Op(name, kind, 2.0 * m * n * k, nbytes, f"{max(1, round(m / groups))}x{n}x{k}", fp8, quant, recompute_kind)


def memory_op(name: str, nbytes: float, recompute_kind: str | None = None, kind: str = "memory") -> Op:
    return Op(name, kind, nbytes=nbytes, recompute_kind=recompute_kind)


def attention_ops(args: ModelArgs, tokens: int, fp8: bool) -> list[Op]:
    """MLA for ``tokens`` tokens: projections, norms, RoPE, the causal core, the output projection."""
    d, h, t = args.dim, args.n_heads, tokens
    qk = args.qk_head_dim
    ops = [memory_op("attn_norm", 2 * t * d * BF16, "norm")]
    if args.q_lora_rank:
        ops += [gemm("wq_a", t, args.q_lora_rank, d, fp8),
                memory_op("q_norm", 2 * t * args.q_lora_rank * BF16, "norm"),
                gemm("wq_b", t, h * qk, args.q_lora_rank, fp8, recompute_kind="mla_up")]
    else:
        ops.append(gemm("wq", t, h * qk, d, fp8))
    ops += [gemm("wkv_a", t, args.kv_lora_rank + args.qk_rope_head_dim, d, fp8),
            memory_op("kv_norm", 2 * t * args.kv_lora_rank * BF16, "norm"),
            gemm("wkv_b", t, h * (args.qk_nope_head_dim + args.v_head_dim), args.kv_lora_rank, fp8,
                 recompute_kind="mla_up"),
            memory_op("rope", 2 * t * (h + 1) * args.qk_rope_head_dim * BF16)]
    return ops


def attention_core(args: ModelArgs, tokens: int, seq_len: int) -> Op:
    """Causal attention over sequences of ``seq_len``: each token attends to (s+1)/2 keys on average."""
    h = args.n_heads
    flops = 2.0 * tokens * (seq_len + 1) / 2 * h * (args.qk_head_dim + args.v_head_dim)
    nbytes = tokens * h * (2 * args.qk_head_dim + 2 * args.v_head_dim) * BF16
    return Op("attention", "attention", flops, nbytes, f"{seq_len}x{h}x{args.qk_head_dim}")


def mean_keys(seq_len: int, topk: int | None = None) -> float:
    """Keys a causal query attends to on average over a sequence of ``seq_len``, at most ``topk`` each."""
    if topk is None or topk >= seq_len:
        return (seq_len + 1) / 2
    return (topk * (topk + 1) / 2 + (seq_len - topk) * topk) / seq_len


def dsa_ops(args: ModelArgs, tokens: int, seq_len: int, fp8: bool) -> list[Op]:
    """DeepSeek-V3.2's attention core with its lightning indexer, per micro-batch (``args.index_topk > 0``).

    The indexer: ``wq_b`` / ``wk`` / ``weights_proj`` GEMMs, and its causal logits ``2 s^2/2 H_I D_I`` (O(s^2))
    in FP8 (``fp8_mqa_logits``, a forward only: no gradient flows through the selection); its loss scores the
    candidates again, indexer and main side (``h x 576`` per key), in fp32. The main attention: dense in the
    warm-up (the core V3 has), else the absorbed MQA over each query's top-k latents, O(s k): ``2 k h (576 +
    512)`` per token forward (2.5x backward), plus folding ``wkv_b`` into q and out (whose per-token expansion
    it replaces: ``block_durations`` drops that GEMM)."""
    h, hi, di, t = args.n_heads, args.index_n_heads, args.index_head_dim, tokens
    latent = args.kv_lora_rank + args.qk_rope_head_dim
    dense = mean_keys(seq_len)
    ops = [gemm("index_wq_b", t, hi * di, args.q_lora_rank), gemm("index_wk", t, di, args.dim),
           gemm("index_weights", t, hi, args.dim)]
    candidates = dense if args.dsa_warmup else mean_keys(seq_len, args.index_topk)
    if args.sparse:
        ops.append(Op("index_logits", "indexer", 2.0 * t * dense * hi * di, t * (hi + 1) * di * FP8_BYTES + t * 4,
                      f"{seq_len}x{hi}x{di}", fp8=True))
        keys = candidates
        core_flops = 2.0 * t * keys * h * (latent + args.kv_lora_rank)
        core_bytes = t * h * (latent + args.kv_lora_rank) * BF16 + t * keys * latent * BF16
        ops += [Op("attention", "attention", core_flops, core_bytes, f"{seq_len}x{h}x{latent}"),
                gemm("absorb_uk", t * h, args.kv_lora_rank, args.qk_nope_head_dim),
                gemm("absorb_uv", t * h, args.v_head_dim, args.kv_lora_rank)]
    else:
        ops.append(attention_core(args, tokens, seq_len))
    loss_flops = 2.0 * t * candidates * (hi * di + h * latent)
    ops.append(Op("index_loss", "attention", loss_flops, t * candidates * (di + latent) * 4, f"{seq_len}x{hi}x{di}"))
    return ops


def ffn_ops(args: ModelArgs, layer_id: int, tokens: int, ep: int, fp8: bool, imbalance: float) -> list[Op]:
    """The FFN of ``layer_id``: dense SwiGLU, or router + routed experts of this EP rank + shared experts."""
    d, t = args.dim, tokens
    ops = [memory_op("ffn_norm", 2 * t * d * BF16, "norm"), memory_op("residual", 6 * t * d * BF16)]
    if not args.is_moe_layer(layer_id):
        i = args.inter_dim
        return ops + [gemm("w13", t, 2 * i, d, fp8), memory_op("swiglu", 3 * t * i * BF16, "swiglu"),
                      gemm("w2", t, d, i, fp8)]
    e, k, i = args.n_routed_experts, args.n_activated_experts, args.moe_inter_dim
    rows = t * k * imbalance  # token copies this rank's experts process (balanced: t x k, the EP average)
    groups = max(1, e // ep)
    ops += [gemm("router", t, e, d), memory_op("topk", 3 * t * e * 4),
            memory_op("permute", 2 * rows * d * BF16, kind="permute"),
            gemm("experts_w13", rows, 2 * i, d, fp8, groups),
            memory_op("experts_swiglu", 3 * rows * i * BF16, "swiglu"),
            gemm("experts_w2", rows, d, i, fp8, groups), memory_op("unpermute", 2 * rows * d * BF16, kind="permute")]
    if args.n_shared_experts:
        s = args.n_shared_experts * i
        ops += [gemm("shared_w13", t, 2 * s, d, fp8), memory_op("shared_swiglu", 3 * t * s * BF16, "swiglu"),
                gemm("shared_w2", t, d, s, fp8)]
    return ops


def head_ops(args: ModelArgs, tokens: int) -> list[Op]:
    """Final norm, output head (BF16) and cross-entropy (fp32 softmax over the vocabulary)."""
    d, v = args.dim, args.vocab_size
    return [memory_op("final_norm", 2 * tokens * d * BF16), gemm("head", tokens, v, d),
            memory_op("cross_entropy", tokens * v * (BF16 + 2 * 4), kind="cross_entropy")]


def mtp_extra_ops(args: ModelArgs, tokens: int) -> list[Op]:
    """One MTP depth besides its block and the shared head: the two norms, the embedding lookup, eh_proj."""
    d = args.dim
    return [memory_op("mtp_norms", 4 * tokens * d * BF16), memory_op("mtp_embed", 2 * tokens * d * BF16),
            gemm("eh_proj", tokens, d, 2 * d)]


@dataclass(frozen=True)
class Durations:
    """Seconds of one model part (stage) for one micro-batch, compute and exposed communication apart.

    ``head_*`` / ``tail_*``: the compute before the part's first and after its last all-to-all, forward
    (``f``) and full backward (``b``, I + W, in backward order). No exchange hides them: an overlapped F&B
    chunk is bound below by a head, its exchanges end to end on the wire, and a tail (``StageCosts``).
    """

    f: float = 0.0  # forward compute
    i: float = 0.0  # input-gradient compute (incl. recompute)
    w: float = 0.0  # weight-gradient compute
    comm_f: float = 0.0  # forward all-to-all (counts, dispatch, combine)
    comm_b: float = 0.0  # backward all-to-all (incl. a recomputed block's forward one)
    flops: float = 0.0  # model FLOPs (F + I + W, no recompute), for MFU
    head_f: float = 0.0  # forward compute before the first exchange
    tail_f: float = 0.0  # forward compute after the last exchange
    head_b: float = 0.0  # backward compute before its first exchange (the forward's last, reversed)
    tail_b: float = 0.0  # backward compute after its last exchange

    @property
    def exchanges(self) -> bool:
        return self.comm_f > 0 or self.comm_b > 0

    def __add__(self, o: Durations) -> Durations:
        """``self`` then ``o`` in forward order (so ``o``'s backward runs first): totals add; a head or tail
        reaches into the neighbour when the part on that side has no exchange."""
        a, b = self, o
        if not a.exchanges or not b.exchanges:
            lone, other = (a, b) if not a.exchanges else (b, a)
            if not other.exchanges:  # no exchange anywhere: heads and tails stay 0
                head_f = tail_f = head_b = tail_b = 0.0
            elif lone is a:  # a runs before b's first exchange and after b's backward's last
                head_f, tail_f, head_b, tail_b = a.f + b.head_f, b.tail_f, b.head_b, b.tail_b + a.i + a.w
            else:
                head_f, tail_f, head_b, tail_b = a.head_f, a.tail_f + b.f, b.i + b.w + a.head_b, a.tail_b
        else:
            head_f, tail_f, head_b, tail_b = a.head_f, b.tail_f, b.head_b, a.tail_b
        return Durations(a.f + b.f, a.i + b.i, a.w + b.w, a.comm_f + b.comm_f, a.comm_b + b.comm_b,
                         a.flops + b.flops, head_f, tail_f, head_b, tail_b)


class OpTimer:
    """Roofline durations of ops on one system, FP8 GEMMs in ``fp8_recipe`` (``blockwise`` or ``mxfp8``)."""

    def __init__(self, system: System, fp8_recipe: str = "blockwise"):
        if fp8_recipe not in FP8_SCALE_BYTES:
            raise ValueError(f"fp8_recipe: expected one of {sorted(FP8_SCALE_BYTES)}, got {fp8_recipe!r}")
        if system.fp8_tflops > 0 and fp8_recipe == "mxfp8" and not system.efficiency["mxfp8_gemm"]:
            raise ValueError(f"fp8_recipe 'mxfp8': {system.name} has no MXFP8 tensor-core path "
                             "(efficiency.mxfp8_gemm is 0 in its system file); use 'blockwise'")
        self.system = system
        self.recipe = fp8_recipe
        self.low = "mxfp8_" if fp8_recipe == "mxfp8" else "fp8_"  # the FP8 GEMMs' efficiency classes

    def _seconds(self, flops: float, nbytes: float, kind: str, shape: str | None, fp8: bool, pass_: str) -> float:
        s = self.system
        mem = nbytes / (s.memory_gbps * 1e9 * s.kernel_efficiency(kind if kind in MEMORY_KINDS else "memory"))
        if kind in MEMORY_KINDS or flops == 0.0:  # a memory-bound kernel: its bytes and its fixed cost
            return mem + s.memory_latency_us * 1e-6 if nbytes else 0.0
        if kind == "attention_bwd" or kind == "attention_fwd":
            peak = s.bf16_tflops
        else:
            peak = s.fp8_tflops if fp8 else s.bf16_tflops
            kind = f"{self.low}{kind}" if fp8 else kind
        return max(flops / (peak * 1e12 * s.kernel_efficiency(kind, shape, pass_)), mem)

    def op(self, op: Op) -> tuple[float, float, float]:
        """(F, I, W) seconds of ``op``."""
        if op.kind in MEMORY_KINDS:  # backward moves twice the bytes, in one kernel
            f = self._seconds(0.0, op.nbytes, op.kind, None, False, "f")
            return f, self._seconds(0.0, 2 * op.nbytes, op.kind, None, False, "i"), 0.0
        if op.kind == "indexer":  # the top-k selection's logits: forward only
            return self._seconds(op.flops, op.nbytes, "gemm", op.shape, op.fp8, "f"), 0.0, 0.0
        if op.kind == "attention":
            return (self._seconds(op.flops, op.nbytes, "attention_fwd", op.shape, False, "f"),
                    self._seconds(2.5 * op.flops, 2 * op.nbytes, "attention_bwd", op.shape, False, "f"), 0.0)
        f, i, w = (self._seconds(op.flops, op.nbytes, op.kind, op.shape, op.fp8, p) for p in ("f", "i", "w"))
        qf, qb = (self._seconds(0.0, b, "memory", None, False, "f") for b in op.quant_bytes)
        return f + qf, i + qb, w


def _remote_nodes(k: int, nodes: int, max_nodes: int | None) -> float:
    """Expected distinct nodes other than its own that one token's top-k experts sit on."""
    if nodes <= 1:
        return 0.0
    distinct = nodes * (1.0 - (1.0 - 1.0 / nodes) ** k)
    if max_nodes:
        distinct = min(distinct, float(max_nodes))
    return distinct * (nodes - 1) / nodes


def all_to_all_seconds(args: ModelArgs, tokens: int, ep: int, system: System, dispatch_bytes: float,
                       max_nodes: int | None, imbalance: float) -> float:
    """One all-to-all (dispatch or combine) of ``tokens`` tokens of this rank over an EP group of ``ep``: the
    links' time for its bytes plus the system's fixed cost of one call over ``ep`` ranks (launch, hand-shakes,
    the wait for the group: ``System.all_to_all_latency``)."""
    if ep <= 1:
        return 0.0
    g = system.gpus_per_node
    eff = system.collective_efficiency["all_to_all"]
    k, d = args.n_activated_experts, args.dim
    copies = tokens * k * imbalance
    fixed = system.all_to_all_latency(ep)
    if ep <= g:
        return fixed + system.intra_node.seconds(copies * (ep - 1) / ep * d * dispatch_bytes, eff)
    nodes = math.ceil(ep / g)
    ib = system.inter_node.seconds(tokens * imbalance * _remote_nodes(k, nodes, max_nodes) * d * dispatch_bytes, eff)
    nvlink = system.intra_node.seconds(copies * (g - 1) / g * d * dispatch_bytes, eff)
    return fixed + max(ib, nvlink)


@dataclass(frozen=True)
class Workload:
    """What one model part computes per micro-batch: tokens, sequence length and the switches."""

    micro_batch: int
    seq_len: int
    ep: int
    fp8: bool
    recompute: tuple[str, ...]
    max_nodes: int | None = None
    imbalance: float = 1.0
    cp: int = 1  # context-parallel ranks sharing each sequence: each computes seq_len / cp of its positions

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on this rank (its share of each sequence under context parallelism)."""
        return self.micro_batch * self.seq_len // self.cp


# Where each op of a MoE block runs relative to its exchanges (``MoE.steps``): before the dispatch is posted,
# while it travels (the shared experts), between dispatch and combine (the routed experts), after the combine.
_PHASE = {"shared_w13": "hidden", "shared_swiglu": "hidden", "shared_w2": "hidden", "experts_w13": "mid",
          "experts_swiglu": "mid", "experts_w2": "mid", "unpermute": "post"}


_QUERY_PROJECTIONS = ("wq_a", "q_norm", "wq_b", "wq")  # what the context-parallel latent exchange hides behind


def block_durations(timer: OpTimer, args: ModelArgs, layer_id: int, w: Workload) -> Durations:
    """One block (attention + FFN) of ``layer_id`` for one micro-batch, with its all-to-alls: per MoE layer the
    count exchange (a latency), dispatch and combine forward, their two reverses backward. Heads and tails
    (``Durations``) from where each op runs: before the dispatch (attention, router, permute: the forward's head,
    and with the shared experts the backward's tail) or after the combine (unpermute)."""
    fp8 = w.fp8 and timer.system.fp8_tflops > 0
    if isinstance(args, V4Args):  # DeepSeek-V4: window / CSA / HCA attention, mHC, MoE on every layer
        ops = costs_v4.block_ops(args, layer_id, w.tokens, w.seq_len, w.ep, fp8, w.imbalance)
    else:
        core = (dsa_ops(args, w.tokens, w.seq_len, fp8) if args.index_topk
                else [attention_core(args, w.tokens, w.seq_len)])
        ops = [op for op in attention_ops(args, w.tokens, fp8) if not (args.sparse and op.name == "wkv_b")]
        ops += core + [gemm("wo", w.tokens, args.dim, args.n_heads * args.v_head_dim, fp8)]
        ops += context_parallel_ops(args, w, fp8)
        ops += ffn_ops(args, layer_id, w.tokens, w.ep, fp8, w.imbalance)
    full_block = "block" in w.recompute
    f = i = wg = flops = q_f = q_b = 0.0
    phase_f, phase_b = dict.fromkeys(("pre", "hidden", "mid", "post"), 0.0), dict.fromkeys(("pre", "hidden", "mid",
                                                                                             "post"), 0.0)
    for op in ops:
        of, oi, ow = timer.op(op)
        if full_block or (op.recompute_kind is not None and op.recompute_kind in w.recompute):
            oi += of
        f, i, wg = f + of, i + oi, wg + ow
        flops += op.flops * (3.5 if op.kind == "attention" else 1.0 if op.kind == "indexer" else 3.0)
        phase = _PHASE.get(op.name, "pre")
        phase_f[phase] += of
        phase_b[phase] += oi + ow - (of if full_block else 0.0)  # a block's re-run forward runs before its backward
        if op.name in _QUERY_PROJECTIONS:
            q_f, q_b = q_f + of, q_b + oi + ow
    # context parallelism: the latent's all-gather (forward) and its gradient's reduce-scatter (backward) run
    # behind the query projections, which do not need them; what they do not cover waits in the layer
    cp_comm = context_parallel_seconds(timer, args, w)
    cp_f, cp_b = max(0.0, cp_comm - q_f), max(0.0, cp_comm - q_b) + (cp_comm if full_block else 0.0)
    f, i = f + cp_f, i + cp_b
    phase_f["pre"] += cp_f
    phase_b["pre"] += cp_b
    if not (_is_moe_layer(args, layer_id) and w.ep > 1):
        return Durations(f, i, wg, flops=flops)
    dispatch = 1 + FP8_SCALE_BYTES[timer.recipe] if fp8 else BF16
    comm = sum(all_to_all_seconds(args, w.tokens, w.ep, timer.system, b, w.max_nodes, w.imbalance)
               for b in (dispatch, BF16))
    link = timer.system.intra_node if w.ep <= timer.system.gpus_per_node else timer.system.inter_node
    comm_f = link.latency_us * 1e-6 + comm  # the per-expert counts travel first: a latency, their bytes are few
    head_b = phase_f["pre"] if full_block else phase_b["post"]
    return Durations(f, i, wg, comm_f, comm + (comm_f if full_block else 0.0), flops, head_f=phase_f["pre"],
                     tail_f=phase_f["post"], head_b=head_b, tail_b=phase_b["pre"] + phase_b["hidden"])


def _is_moe_layer(args: ModelArgs | V4Args, layer_id: int) -> bool:
    return isinstance(args, V4Args) or args.is_moe_layer(layer_id)  # V4: every layer is MoE


def _layer_key(args: ModelArgs | V4Args, layer_id: int) -> tuple:
    """What a block's durations depend on besides the workload: dense or MoE (V3); compress ratio, hash routing
    and MTP (V4)."""
    if isinstance(args, V4Args):
        return args.compress_ratios[layer_id], layer_id < args.n_hash_layers
    return (args.is_moe_layer(layer_id),)


def context_parallel_ops(args: ModelArgs, w: Workload, fp8: bool) -> list[Op]:
    """The work context parallelism adds to an MLA block on one rank: the per-head keys and values of the other
    ranks' positions, up-projected from the all-gathered latent (``wkv_b`` on ``(cp - 1) / cp`` of the sequence,
    re-run in backward with V3's MLA up-projection recompute); none for DSA's sparse attention, which reads the
    selected latent rows (absorbed form). The attention core needs nothing more: ``tokens`` local queries over
    the whole sequence's causal keys is the whole sequence's core / cp (the balanced 2 x cp chunk split)."""
    if w.cp <= 1 or args.sparse:
        return []
    remote = w.micro_batch * w.seq_len * (w.cp - 1) / w.cp
    return [gemm("wkv_b_gathered", remote, args.n_heads * (args.qk_nope_head_dim + args.v_head_dim),
                 args.kv_lora_rank, fp8, recompute_kind="mla_up")]


def context_parallel_seconds(timer: OpTimer, args: ModelArgs, w: Workload) -> float:
    """One ring all-gather of the whole sequence's latent (``kv_lora_rank + qk_rope_head_dim`` = 576 values per
    token, BF16; with DSA also the indexer keys) over the ``cp`` ranks of a sequence, forward; its gradient's
    reduce-scatter backward moves the same bytes. The cp ranks of a sequence are adjacent (one node while cp <=
    GPUs per node)."""
    if w.cp <= 1:
        return 0.0
    s = timer.system
    link = s.intra_node if w.cp <= s.gpus_per_node else s.inter_node
    per_token = args.kv_lora_rank + args.qk_rope_head_dim + (args.index_head_dim if args.index_topk else 0)
    nbytes = w.micro_batch * w.seq_len * (w.cp - 1) / w.cp * per_token * BF16
    return (w.cp - 1) * link.latency_us * 1e-6 + nbytes / (link.bandwidth_gb_s * 1e9
                                                           * s.collective_efficiency["ring"])


def ops_durations(timer: OpTimer, ops: list[Op]) -> Durations:
    f = i = w = flops = 0.0
    for op in ops:
        of, oi, ow = timer.op(op)
        f, i, w = f + of, i + oi, w + ow
        flops += 3.0 * op.flops
    return Durations(f, i, w, flops=flops)


def part_durations(timer: OpTimer, args: ModelArgs, layers: tuple[int, int], first: bool, last: bool,
                   w: Workload, block_cache: dict) -> Durations:
    """A pipeline stage: blocks ``[lo, hi)``, the embedding on the first, head + MTP on the last.
    ``block_cache`` memoises per-block durations by (dense/MoE) and workload: the inner loop of a search."""
    def block(layer_id: int) -> Durations:
        key = (*_layer_key(args, layer_id), w)
        if key not in block_cache:
            block_cache[key] = block_durations(timer, args, layer_id, w)
        return block_cache[key]

    total = Durations()
    if first:
        total = total + ops_durations(timer, [memory_op("embed", 2 * w.tokens * args.dim * BF16)])
    for layer in range(*layers):
        total = total + block(layer)
    if last:  # the criterion runs the MTP depths first, then the shared head for the trunk and each depth
        v4 = isinstance(args, V4Args)
        extra, heads = (costs_v4.mtp_extra_ops, costs_v4.head_ops) if v4 else (mtp_extra_ops, head_ops)
        for k in range(args.n_mtp_layers):
            total = total + ops_durations(timer, extra(args, w.tokens)) + block(args.n_layers + k)
        total = total + ops_durations(timer, heads(args, w.tokens) * (1 + args.n_mtp_layers))
    return total


_MUON: dict[tuple[str, int, int], tuple[float, float]] = {}


def muon_flops_per_param(args: ModelArgs, ep: int, steps: int = 5) -> tuple[float, float]:
    """(dense, expert) Newton-Schulz FLOPs per parameter of one optimizer step, over the whole model (one EP
    rank's experts; dense: per dense parameter, the AdamW-kept embedding, head, router and norms included, so
    a rank's FLOPs are this times its dense parameters). Counted on a ``meta`` model with the optimizer's own
    matrix split (each expert, each half of a fused ``w13``)."""
    key = (repr(args), ep, steps)
    if key not in _MUON:
        with torch.device("meta"):  # (V4's model holds every expert: the per-parameter average is the same)
            model = (V4Transformer(args) if isinstance(args, V4Args)
                     else Transformer(args, expert_ids=expert_range(args, 0, ep) if ep > 1 else None))
        flops, params = [0.0, 0.0], [0, 0]
        for name, p in model.named_parameters():
            kind = int(is_expert_param(name))
            params[kind] += p.numel()
            if uses_muon(name, p):
                count, rows, cols = muon_matrices(name, p)
                flops[kind] += count * newton_schulz_flops(rows, cols, steps)
        _MUON[key] = (flops[0] / max(params[0], 1), flops[1] / max(params[1], 1))
    return _MUON[key]
