"""DeepSeek-V3 pipeline stages, built per rank on the meta device with only this rank's part allocated.

The whole ``Transformer`` is constructed on the ``meta`` device (no memory, even at 671B); each
rank then keeps the stages the schedule gives it and materialises only their modules, holding
only its expert-parallel slice of the routed experts. A stage is a contiguous run of blocks; the
first also embeds tokens; the last holds the final norm, the output head and the MTP modules, which
the step's criterion (``training.loss``) runs, so the loss is computed where the logits are. A
stage runs the model's own layer loop (``model.run_layers``); the overlapped pipeline runs the same
layers as plan pieces (``models.deepseek_v3.plan``), so the forward is written once, in the model.
Parameter names inside a stage are the ``Transformer``'s (``layers.3.attn.wq_a.weight``), so
checkpoints of any layout line up.

Which stages a pipeline rank holds (``stage_ids``): one (``1f1b``, ``zb1p``), two in a V
(``dualpipev``, ``zbv``: stage ``r`` and ``2 pp - 1 - r``, so the embedding and the head/MTP share
rank 0 as in V3), or two mirrored (``dualpipe``: stage ``r`` and ``pp - 1 - r``, each held twice in
the world), or ``vpp`` model chunks (``interleaved1f1b``: stages ``r, r + pp, ...`` of ``pp x vpp`` equal
chunks, ``chunk_layers``). MTP needs the embedding beside the head, so it is refused for ``1f1b``/``zb1p`` at pp > 1.

A DeepSeek-V4 model (``models.deepseek_v4``, chosen by its ``ModelArgs``) gets ``DeepSeekV4Stage``s: the same
interface over its residual streams ``[b, s, hc, dim]``, which travel with the token ids; what the pipeline and
evaluation need of a stage's messages and head (``input_specs``, ``logits``, ``lm_losses``, ``loss_pieces``) is
asked of the stage, never assumed to be one ``[b, s, dim]`` tensor.

Initialisation does not depend on the layout: every tensor is drawn from a generator seeded by
(seed, parameter name[, global expert id]), so a 1-process and a PP x EP run start identical.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
from collections.abc import Callable, Sequence

import torch
from torch import nn

import models.deepseek_v4 as v4
from models.deepseek_v3 import ModelArgs, Transformer
from models.deepseek_v3.block import LayerWrap
from models.deepseek_v3.context_parallel import ContextParallel
from models.deepseek_v3.model import head_losses, lm_losses_from_hidden, run_layers
from models.deepseek_v3.moe import Experts, MoE
from models.deepseek_v3.mtp import mtp_pieces
from models.deepseek_v3.plan import Compute, Piece, Run, layer_pieces, overlapped
from models.deepseek_v3.rope import rope_cos_sin
from models.deepseek_v4 import plan as v4_plan
from training.config import pipeline_layout
from training.memory_policy import MemoryPolicy
from training.recompute import checkpointed


def stage_ids(schedule: str, pp: int, pp_rank: int, vpp: int = 1) -> list[int]:
    """The global stage numbers pipeline rank ``pp_rank`` holds, in local order (the schedule layout's parts)."""
    return list(pipeline_layout(schedule, pp, vpp).parts_of(pp_rank))


def num_model_stages(schedule: str, pp: int, vpp: int = 1) -> int:
    """How many stages the schedule cuts the model into (the schedule layout's parts)."""
    return pipeline_layout(schedule, pp, vpp).num_parts


def chunk_layers(args: ModelArgs, pp: int, vpp: int) -> list[tuple[int, int]]:
    """Trunk layers ``[start, end)`` of each of the ``pp x vpp`` model chunks of interleaved 1F1B, chunk ``c`` on
    pipeline rank ``c % pp``: as even as ``split_layers`` makes them (sizes differ by at most one layer, as
    Megatron-Bridge lays out DeepSeek-V3's 61 layers over 16 chunks). ValueError naming ``parallel.vpp`` when some
    chunk would hold no layer."""
    chunks = pp * vpp
    if chunks > args.n_layers + args.n_mtp_layers:
        raise ValueError(f"model has {args.n_layers} layers + {args.n_mtp_layers} MTP, too few for parallel.pp x "
                         f"parallel.vpp = {pp} x {vpp} = {chunks} model chunks of at least one layer; lower "
                         "parallel.vpp or raise model.overrides.n_layers")
    return split_layers(args, chunks)


def split_layers(args: ModelArgs, num_stages: int) -> list[tuple[int, int]]:
    """Trunk layers ``[start, end)`` of each stage: balanced, counting each MTP depth as one more layer
    of the last stage (it is a full MoE block). ValueError when a middle stage would be empty."""
    units = args.n_layers + args.n_mtp_layers
    if num_stages > units:
        raise ValueError(f"model has {args.n_layers} layers + {args.n_mtp_layers} MTP, too few for {num_stages} "
                         f"pipeline stages; raise model.overrides.n_layers or lower parallel.pp")
    base, extra = divmod(units, num_stages)
    sizes = [base + (1 if s < extra else 0) for s in range(num_stages)]
    sizes[-1] -= args.n_mtp_layers
    if sizes[-1] < 0:
        raise ValueError(f"{args.n_mtp_layers} MTP modules do not fit in one stage of {base + 1} layers")
    ranges, start = [], 0
    for s, n in enumerate(sizes):
        if n == 0 and 0 < s < num_stages - 1:
            raise ValueError(f"pipeline stage {s} would hold no layer; raise model.overrides.n_layers")
        ranges.append((start, start + n))
        start += n
    return ranges


def expert_range(args: ModelArgs, ep_rank: int, ep_size: int) -> range:
    if args.n_routed_experts % ep_size:
        raise ValueError(f"parallel.ep={ep_size} must divide the {args.n_routed_experts} routed experts")
    per = args.n_routed_experts // ep_size
    return range(ep_rank * per, (ep_rank + 1) * per)


def _seed_for(seed: int, name: str, index: int = -1) -> int:
    digest = hashlib.sha256(f"{seed}/{name}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_deterministic(model: Transformer, modules: dict[str, nn.Module], seed: int) -> None:
    """Initialise ``modules`` (name -> module of ``model``) independently of the parallel layout.

    Non-expert modules go through the model's own ``init_weights`` under an RNG seeded by their
    name; routed experts are drawn per *global* expert id, so an EP slice equals the same rows of
    the full tensor.
    """
    for prefix, root in modules.items():
        for name, m in root.named_modules(prefix=prefix):
            if isinstance(m, Experts):
                for local, expert in enumerate(m.expert_ids):
                    for pname, p in (("w13", m.w13), ("w2", m.w2)):
                        g = torch.Generator(device="cpu").manual_seed(_seed_for(seed, f"{name}.{pname}", expert))
                        p[local].copy_(torch.randn(p.shape[1:], generator=g, dtype=torch.float32) * model.args.init_std)
            elif next(m.parameters(recurse=False), None) is not None or list(m.buffers(recurse=False)):
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(_seed_for(seed, name))
                    model.init_weights(_Leaf(m))


class _Leaf(nn.Module):
    """Wraps one module so ``init_weights`` visits it but not its children (they are seeded separately)."""

    def __init__(self, m: nn.Module):
        super().__init__()
        self._m = [m]

    def modules(self):  # noqa: D401 - nn.Module API
        return iter(self._m)


class DeepSeekV3Stage(nn.Module):
    """Stage ``stage_id``: [embedding] -> blocks ``[start, end)``, a slice of the ``Transformer``.

    ``forward(x)`` takes tokens ``[b, s]`` on the first stage, hidden states ``[b, s, dim]`` after it,
    and returns hidden states (the last stage returns the state before the final norm; the final
    norm, head and MTP run in the step's criterion, ``training.loss.StageLoss``). ``forward_run`` /
    ``backward_run`` / ``overlapped_forward_backward`` run a micro-batch as plan pieces for the pipeline
    runtime, which hands each forward's ``Run`` to its backward.
    """

    def __init__(self, model: Transformer, stage_id: int, num_stages: int, layer_range: tuple[int, int],
                 policy: MemoryPolicy | None = None):
        """``policy``: what backward keeps of the forwards this stage runs (``training.memory_policy``)."""
        super().__init__()
        self.args = model.args
        self.policy = policy
        self.stage_id, self.num_stages = stage_id, num_stages
        self.is_first, self.is_last = stage_id == 0, stage_id == num_stages - 1
        self.start, self.end = layer_range
        self.embed = model.embed if (self.is_first or (self.is_last and model.args.n_mtp_layers)) else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(self.start, self.end)})
        if self.is_last:
            self.norm, self.head, self.mtp = model.norm, model.head, model.mtp
        self.cp: ContextParallel | None = None  # context parallelism: set once by ``wire_context_parallel``

    def positions(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """Global positions of a micro-batch's ``seq_len`` rows here: ``0..seq_len-1``, or this CP rank's chunks."""
        if self.cp is None:
            return torch.arange(seq_len, device=device)
        if seq_len != self.cp.local_len:
            raise ValueError(f"context parallelism: a stage input of {seq_len} rows, expected this rank's "
                             f"{self.cp.local_len} of the run's data.seq_len={self.cp.seq_len}")
        return self.cp.positions(device)

    def owned_modules(self) -> dict[str, nn.Module]:
        """Name -> module for everything this stage holds (what gets materialised)."""
        out: dict[str, nn.Module] = {f"layers.{i}": self.layers[str(i)] for i in range(self.start, self.end)}
        if self.embed is not None:
            out["embed"] = self.embed
        if self.is_last:
            out.update(norm=self.norm, head=self.head, mtp=self.mtp)
        return out

    @property
    def wrap(self) -> LayerWrap | None:
        """How this stage runs a layer: the policy's whole-block recompute (``MemoryPolicy.recomputed``), if any."""
        return None if self.policy is None else self.policy.recomputed

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The last stage's logits of its output ``h`` (evaluation and sampling)."""
        return self.head(self.norm(h))

    def input_specs(self, tokens: torch.Tensor, dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of each tensor this (non-first) stage takes for ``tokens [b, s]``: the hidden state."""
        return [((*tokens.shape, self.args.dim), dtype)]

    def lm_losses(self, args: ModelArgs, h: torch.Tensor, tokens: torch.Tensor, labels: torch.Tensor,
                  positions: torch.Tensor | None = None) -> dict:
        """The last stage's losses from its output ``h`` (``args``: the model's, with the step's MTP weight);
        ``positions``: ``h``'s rows' global positions under context parallelism."""
        return lm_losses_from_hidden(args, self.norm, self.head, self.mtp, self.embed, h, tokens, labels,
                                     wrap=self.wrap, positions=positions)

    def loss_pieces(self, args: ModelArgs, tokens: torch.Tensor, labels: torch.Tensor,
                    positions: torch.Tensor | None = None
                    ) -> tuple[list[Piece], tuple[str, ...], Callable[..., dict]]:
        """``lm_losses`` as plan pieces after the stage's: the MTP pieces, the names they write, and the heads'
        losses of ``(h, *those values)``."""
        pieces, hidden = mtp_pieces(args, self.mtp, self.embed, tokens, wrap=self.wrap, positions=positions)
        return pieces, tuple(hidden), lambda h, *mtp: head_losses(args, self.norm, self.head, self.mtp, h, mtp, labels,
                                                                  positions=positions)

    def applied(self) -> contextlib.AbstractContextManager:
        """The memory policy's context for a forward of this stage's modules (nothing without a policy)."""
        return contextlib.nullcontext() if self.policy is None else self.policy.applied()

    def under_policy(self, pieces: list[Piece]) -> list[Piece]:
        """``pieces`` with each compute piece run inside ``applied()``."""
        return [dataclasses.replace(p, fn=self._applied_to(p.fn)) if isinstance(p, Compute) else p for p in pieces]

    def _applied_to(self, fn):
        def run(*args):
            with self.applied():
                return fn(*args)

        return run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.applied():
            h = self.embed(x) if self.is_first else x
            positions = None if self.cp is None else self.positions(h.shape[1], h.device)
            h = run_layers(self.args, [self.layers[str(i)] for i in range(self.start, self.end)], h, wrap=self.wrap,
                           positions=positions)
        return h.clone() if h is x else h  # a stage never returns its input (a view / alias of a pipeline buffer)

    # ---- the overlapped pipeline's interface (``dualpipe.runtime``): a micro-batch's pass as a ``plan.Run`` ----
    def pieces(self, seq_len: int, device: torch.device) -> list[Piece]:
        """The stage's forward as plan pieces, from ``tokens`` (first stage) or ``h`` to ``h``."""
        pieces: list[Piece] = []
        if self.is_first:
            pieces.append(Compute("embed", lambda tokens: {"h": self.embed(tokens)}, ("tokens",), ("h",)))
        cos, sin = rope_cos_sin(self.args, self.positions(seq_len, device))
        for i in range(self.start, self.end):
            pieces += layer_pieces(self.layers[str(i)], cos, sin, wrap=self.wrap)
        return self.under_policy(pieces)

    def start_run(self, inputs: list, criterion=None, labels: Sequence = ()) -> Run:
        """One micro-batch's pass, not yet run: the stage's pieces, then the criterion's (``StageLoss.pieces``)."""
        (x,) = inputs
        pieces = self.pieces(x.shape[1], x.device)
        if criterion is not None:
            pieces += criterion.pieces(*labels)
        return Run(pieces, **{"tokens" if self.is_first else "h": x})

    @staticmethod
    def run_result(run: Run) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(stage output, loss or None) of a finished forward."""
        h = run.values["h"]
        return (h if "h" in run.made else h.clone()), run.values.get("loss")

    def forward_run(self, inputs: list, criterion=None, labels: Sequence = ()
                    ) -> tuple[torch.Tensor, torch.Tensor | None, Run]:
        """The forward of one micro-batch as a ``Run`` (for ``backward_run`` or an overlapped chunk)."""
        run = self.start_run(inputs, criterion, labels)
        run.forward()
        return *self.run_result(run), run

    @staticmethod
    def backward_run(run: Run, loss: torch.Tensor | None, grads: list) -> None:
        """The backward of ``run``: from its loss (last stage) or from the gradient of its output."""
        run.backward(**_output_grads(loss, grads))

    @classmethod
    def overlapped_forward_backward(cls, module0: DeepSeekV3Stage, inputs0: list, criterion0, labels0: list,
                                    run1: Run, loss1: torch.Tensor | None, output_grads1: list
                                    ) -> tuple[torch.Tensor, torch.Tensor | None, Run]:
        """Forward of one micro-batch on ``module0`` interleaved with the backward of ``run1`` (another
        micro-batch's forward on this rank), DualPipe's overlapped chunk: while one's all-to-all is in flight
        the other computes (``plan.overlapped``). Gradients equal a plain F then B."""
        run0 = module0.start_run(inputs0, criterion0, labels0)
        overlapped(run0, run1, **_output_grads(loss1, output_grads1))
        return *module0.run_result(run0), run0


class DeepSeekV4Stage(DeepSeekV3Stage):
    """A stage of a DeepSeek-V4 ``Transformer`` (``models.deepseek_v4``): the same interface, over V4's residual.

    The residual is ``hc_mult`` streams ``[b, s, hc, dim]`` and the first ``n_hash_layers`` layers route by token
    id, so every stage but the last passes on ``(streams, tokens)`` and every stage but the first takes them; the
    first embeds tokens into streams, the last holds ``hc_head``, the final norm, the head and the MTP blocks.
    The per-layer plan's pieces are ``models.deepseek_v4.plan``'s. No memory policy (V4 recomputes whole blocks).
    """

    def __init__(self, model: v4.Transformer, stage_id: int, num_stages: int, layer_range: tuple[int, int]):
        super().__init__(model, stage_id, num_stages, layer_range, None)
        if self.is_last:
            self.hc_head = model.hc_head

    @property
    def wrap(self) -> LayerWrap:
        """Whole-block recompute where the layer asks for it (``recompute = ["block"]``), as V3's policy does."""
        return lambda layer, fn: (functools.partial(checkpointed, fn, layer)
                                  if self.args.recomputes("block", layer.layer_id) else fn)

    def owned_modules(self) -> dict[str, nn.Module]:
        out = super().owned_modules()
        if self.is_last:
            out["hc_head"] = self.hc_head
        return out

    def forward(self, x: torch.Tensor, tokens: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``x``: tokens ``[b, s]`` (first stage) or streams ``[b, s, hc, dim]`` with their ``tokens``."""
        if self.is_first:
            tokens, h = x, v4_plan.embed_streams(self.args, self.embed, x)
        else:
            h = x
        h = v4_plan.run_layers(self.args, [self.layers[str(i)] for i in range(self.start, self.end)], h, tokens,
                               self.wrap)
        h = h.clone() if h is x else h
        return h if self.is_last else (h, tokens.clone())  # (a fresh tokens tensor: never a micro-batch's view)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.hc_head(h)))

    def input_specs(self, tokens: torch.Tensor, dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return [((*tokens.shape, self.args.hc_mult, self.args.dim), dtype), (tuple(tokens.shape), tokens.dtype)]

    def lm_losses(self, args: v4.ModelArgs, h: torch.Tensor, tokens: torch.Tensor, labels: torch.Tensor,
                  positions: None = None) -> dict:  # (V4 runs without context parallelism: check_layout)
        return v4_plan.lm_losses_from_hidden(args, self.hc_head, self.norm, self.head, self.mtp, self.embed, h,
                                             tokens, labels, wrap=self.wrap)

    def loss_pieces(self, args: v4.ModelArgs, tokens: torch.Tensor, labels: torch.Tensor, positions: None = None
                    ) -> tuple[list[Piece], tuple[str, ...], Callable[..., dict]]:
        pieces, hidden = v4_plan.mtp_pieces(args, self.mtp, self.embed, tokens, wrap=self.wrap)
        return pieces, tuple(hidden), lambda h, *mtp: v4_plan.head_losses(args, self.hc_head, self.norm, self.head,
                                                                          self.mtp, h, mtp, labels)

    def pieces(self, seq_len: int, device: torch.device) -> list[Piece]:
        pieces: list[Piece] = []
        if self.is_first:
            pieces.append(Compute("embed", lambda tokens: {"h": v4_plan.embed_streams(self.args, self.embed, tokens)},
                                  ("tokens",), ("h",)))
        rope = v4_plan.angles(self.args, seq_len, device)
        for i in range(self.start, self.end):
            pieces += v4_plan.layer_pieces(self.layers[str(i)], rope, wrap=self.wrap)
        return pieces

    def start_run(self, inputs: list, criterion=None, labels: Sequence = ()) -> Run:
        x, tokens = (inputs[0], inputs[0]) if self.is_first else inputs
        pieces = self.pieces(x.shape[1], x.device)
        if criterion is not None:
            pieces += criterion.pieces(*labels)
        given = {"tokens": tokens} if self.is_first else {"h": x, "tokens": tokens}
        return Run(pieces, keep=("h", "loss", "tokens"), **given)

    def run_result(self, run: Run) -> tuple[torch.Tensor | tuple[torch.Tensor, torch.Tensor], torch.Tensor | None]:
        h, loss = super().run_result(run)
        return (h if self.is_last else (h, run.values["tokens"].clone())), loss


def _output_grads(loss: torch.Tensor | None, grads: list) -> dict[str, torch.Tensor]:
    if loss is not None:
        return {"loss": torch.ones_like(loss)}
    return {"h": grads[0]} if grads else {}


def build_stages(args: ModelArgs, schedule: str, pp: int, pp_rank: int, ep_rank: int, ep_size: int,
                 device: torch.device, dtype: torch.dtype, seed: int, physical_experts: Sequence[int] | None = None,
                 vpp: int = 1, memory_policy: bool = True) -> tuple[Transformer, list[DeepSeekV3Stage]]:
    """This rank's stages, materialised on ``device`` in ``dtype``; the rest of the model stays on meta.

    memory_policy: the stages run under ``training.memory_policy`` (false under ``run.compile``: its saved-tensor
    hooks are eager machinery, and ``training.compile.check_compile`` has refused every setting that needs them).

    physical_experts: under EPLB, the logical expert of each physical slot this rank hosts in every
    MoE layer (replicas start as exact copies: experts are initialised per logical id).
    """
    num_stages = num_model_stages(schedule, pp, vpp)
    if args.n_mtp_layers and not pipeline_layout(schedule, pp, vpp).same_rank(0, num_stages - 1):
        raise ValueError(f"MTP (model n_mtp_layers={args.n_mtp_layers}) needs the embedding on the last stage's "
                         f"rank: use parallel.schedule dualpipev, zbv or dualpipe, or set "
                         "model.overrides.n_mtp_layers=0")
    ranges = chunk_layers(args, pp, vpp) if vpp > 1 else split_layers(args, num_stages)
    experts = expert_range(args, ep_rank, ep_size) if ep_size > 1 else None
    v4_model = isinstance(args, v4.ModelArgs)
    with torch.device("meta"):
        model = (v4.Transformer if v4_model else Transformer)(args, expert_ids=experts)
        if physical_experts is not None:  # V4's MoE is V3's subclass, its Experts V3's with the clamped SwiGLU
            for m in model.modules():
                if isinstance(m, MoE):
                    m.experts = type(m.experts)(args, physical_experts)
    held = stage_ids(schedule, pp, pp_rank, vpp)
    if v4_model:
        stages = [DeepSeekV4Stage(model, s, num_stages, ranges[s]) for s in held]
    else:
        policy = MemoryPolicy(model, args) if memory_policy else None
        stages = [DeepSeekV3Stage(model, s, num_stages, ranges[s], policy) for s in held]
    owned: dict[str, nn.Module] = {}
    for st in stages:
        owned.update(st.owned_modules())
    for m in owned.values():
        m.to_empty(device=device)
        for t in list(m.parameters()) + list(m.buffers()):
            if t.is_floating_point():
                t.data.fill_(float("nan"))  # anything the init misses shows up below
    init_deterministic(model, owned, seed)
    for prefix, m in owned.items():
        for name, t in list(m.named_parameters(prefix=prefix)) + list(m.named_buffers(prefix=prefix)):
            if t.is_floating_point() and not torch.isfinite(t).all():
                raise RuntimeError(f"build_stages: {name} was not initialised (the model's init_weights missed it)")
    for m in owned.values():
        for p in m.parameters():
            p.data = p.data.to(dtype)
    return model, stages
