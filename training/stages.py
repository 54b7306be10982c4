"""DeepSeek-V3 pipeline stages, built per rank on the meta device with only this rank's part allocated.

The whole ``Transformer`` is constructed on the ``meta`` device (no memory, even at 671B); each
rank then keeps the stages the schedule gives it and materialises only their modules, holding
only its expert-parallel slice of the routed experts. A stage is a contiguous run of blocks; the
first also embeds tokens; the last holds the final norm, the output head and the MTP modules, which
the step's criterion (``training.loss``) runs, so the loss is computed where the logits are. A
stage runs the blocks' own ``steps``: the forward is written once, in the model. Parameter names inside a stage are the
``Transformer``'s (``layers.3.attn.wq_a.weight``), so checkpoints of any layout line up.

Which stages a pipeline rank holds (``stage_ids``): one (``1f1b``, ``zb1p``), two in a V
(``dualpipev``, ``zbv``: stage ``r`` and ``2 pp - 1 - r``, so the embedding and the head/MTP share
rank 0 as in V3), or two mirrored (``dualpipe``: stage ``r`` and ``pp - 1 - r``, each held twice in
the world). MTP needs the embedding beside the head, so it is refused for ``1f1b``/``zb1p`` at pp > 1.

Initialisation does not depend on the layout: every tensor is drawn from a generator seeded by
(seed, parameter name[, global expert id]), so a 1-process and a PP x EP run start identical.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch import nn

from models.deepseek_v3 import ModelArgs, Transformer
from models.deepseek_v3.moe import Experts, MoE
from models.deepseek_v3.rope import rope_cos_sin
from models.deepseek_v3.steps import Cuts, Steps, backward_steps, drain, interleave
from training.config import pipeline_layout


def stage_ids(schedule: str, pp: int, pp_rank: int) -> list[int]:
    """The global stage numbers pipeline rank ``pp_rank`` holds, in local order (the schedule layout's parts)."""
    return list(pipeline_layout(schedule, pp).parts_of(pp_rank))


def num_model_stages(schedule: str, pp: int) -> int:
    """How many stages the schedule cuts the model into (the schedule layout's parts)."""
    return pipeline_layout(schedule, pp).num_parts


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
    norm, head and MTP run in the step's criterion, ``training.loss.StageLoss``). The blocks run their
    own ``steps`` (``models.deepseek_v3.steps``); a stage only strings them together.
    """

    def __init__(self, model: Transformer, stage_id: int, num_stages: int, layer_range: tuple[int, int]):
        super().__init__()
        self.args = model.args
        self.stage_id, self.num_stages = stage_id, num_stages
        self.is_first, self.is_last = stage_id == 0, stage_id == num_stages - 1
        self.start, self.end = layer_range
        self.embed = model.embed if (self.is_first or (self.is_last and model.args.n_mtp_layers)) else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(self.start, self.end)})
        if self.is_last:
            self.norm, self.head, self.mtp = model.norm, model.head, model.mtp

    def owned_modules(self) -> dict[str, nn.Module]:
        """Name -> module for everything this stage holds (what gets materialised)."""
        out: dict[str, nn.Module] = {f"layers.{i}": self.layers[str(i)] for i in range(self.start, self.end)}
        if self.embed is not None:
            out["embed"] = self.embed
        if self.is_last:
            out.update(norm=self.norm, head=self.head, mtp=self.mtp)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return drain(self.forward_steps(x))

    def forward_steps(self, x: torch.Tensor) -> Steps[torch.Tensor]:
        """The stage's forward as the blocks' steps, yielding where their all-to-alls are in flight.

        The exchanges are recorded (``Cuts``, autograd edges only) on the output, for ``backward_steps``.
        """
        cuts = Cuts(x)
        h = self.embed(x) if self.is_first else x
        if self.end > self.start:
            cos, sin = rope_cos_sin(self.args, torch.arange(h.shape[1], device=h.device))
            for i in range(self.start, self.end):
                h = yield from self.layers[str(i)].steps(h, cos, sin, cuts=cuts)
        if h is x:
            h = h.clone()  # a stage never returns its input (a view / alias of a pipeline buffer)
        setattr(h, _CUTS, cuts)
        return h

    @staticmethod
    def backward_steps(loss: torch.Tensor | None, outputs: list, grads: list) -> Steps[None]:
        """Backward of one micro-batch (from its loss on the last stage, else from the output gradients),
        yielding while each reverse all-to-all is in flight (``steps.backward_steps``)."""
        if loss is not None:
            yield from backward_steps(getattr(getattr(loss, _HIDDEN), _CUTS), [(loss, torch.ones_like(loss))])
            loss.detach_()
        elif outputs:
            yield from backward_steps(getattr(outputs[0], _CUTS), list(zip(outputs, grads)))

    @classmethod
    def overlapped_forward_backward(cls, module0: DeepSeekV3Stage, inputs0: list, criterion0, labels0: list,
                                    module1: DeepSeekV3Stage, loss1: torch.Tensor | None, outputs1: list,
                                    output_grads1: list) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward of one micro-batch on ``module0`` interleaved with the backward of another on
        ``module1`` (DualPipe's contract): while one's all-to-all is in flight (the forward's dispatch or
        combine, the backward's reverse exchanges), the other computes. Gradients equal a plain F then B."""
        def forward_and_loss() -> Steps[tuple[torch.Tensor, torch.Tensor | None]]:
            h = yield from module0.forward_steps(*inputs0)
            if criterion0 is None:
                return h, None
            return h, (yield from criterion0.steps(h, *labels0))  # the criterion (StageLoss) interleaves too

        return interleave(forward_and_loss(), module1.backward_steps(loss1, outputs1, output_grads1))


_CUTS = "_dsv3_cuts"  # stage output attribute: the Cuts its forward recorded
_HIDDEN = "_dsv3_hidden"  # loss attribute: the last hidden state the criterion started from


def cuts_of(h: torch.Tensor) -> Cuts | None:
    """The exchanges recorded by the forward that made stage output ``h`` (None for a plain forward's)."""
    return getattr(h, _CUTS, None)


def mark_loss(loss: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Tie a criterion's loss to the stage output it was computed from (where ``backward_steps`` starts)."""
    setattr(loss, _HIDDEN, hidden)
    return loss


def build_stages(args: ModelArgs, schedule: str, pp: int, pp_rank: int, ep_rank: int, ep_size: int,
                 device: torch.device, dtype: torch.dtype, seed: int, physical_experts: Sequence[int] | None = None
                 ) -> tuple[Transformer, list[DeepSeekV3Stage]]:
    """This rank's stages, materialised on ``device`` in ``dtype``; the rest of the model stays on meta.

    physical_experts: under EPLB, the logical expert of each physical slot this rank hosts in every
    MoE layer (replicas start as exact copies: experts are initialised per logical id).
    """
    num_stages = num_model_stages(schedule, pp)
    if args.n_mtp_layers and pp > 1 and schedule in ("1f1b", "zb1p"):
        raise ValueError(f"MTP (model n_mtp_layers={args.n_mtp_layers}) needs the embedding on the last stage's "
                         f"rank: use parallel.schedule dualpipev, zbv or dualpipe, or set "
                         "model.overrides.n_mtp_layers=0")
    ranges = split_layers(args, num_stages)
    experts = expert_range(args, ep_rank, ep_size) if ep_size > 1 else None
    with torch.device("meta"):
        model = Transformer(args, expert_ids=experts)
        if physical_experts is not None:
            for m in model.modules():
                if isinstance(m, MoE):
                    m.experts = Experts(args, physical_experts, recompute_swiglu=m.experts.recompute_swiglu)
    stages = [DeepSeekV3Stage(model, s, num_stages, ranges[s]) for s in stage_ids(schedule, pp, pp_rank)]
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
