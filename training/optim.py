"""Optimizer, LR schedule, gradient reduction and clipping for PP x EP x DP training.

- AdamW as DeepSeek-V3 (betas 0.9/0.95, weight decay 0.1); no decay on 1-D parameters (norm
  scales), as is standard. By default the parameters are the master weights (fp32, or fp64 for tests)
  and the moments are in their dtype (``torch.optim.AdamW``); with ``optim.moments_dtype = "bfloat16"``
  the moments are BF16 as V3 keeps them (``AdamW`` below: fp32 math, moments rounded to nearest when
  stored).
- BF16 working weights (``run.dtype = "bfloat16"`` with ``optim.master_dtype = "float32"``, V3 report
  3.3, Megatron-Core's distributed optimizer): the model's parameters are BF16, ``AdamW`` keeps an FP32
  ``master`` copy of each parameter in its per-parameter state (so ZeRO-1 shards it like the moments),
  updates it and writes bf16(master), rounded to nearest, into the parameter; gradients accumulate in
  FP32 ``main_grad`` buffers (``accel.grads``), which every function here reads.
- Parameter EMA (``optim.ema_decay``): kept in host memory in the optimizer's per-parameter state
  (so it is ZeRO-1 sharded, checkpointed by name and re-partitioned like the moments), updated on a
  worker thread from a host snapshot taken right after each update (V3 keeps it on the CPU).
- ZeRO-1: PyTorch's ``ZeroRedundancyOptimizer`` shards the states over the data-parallel ranks
  that hold the same parameters: dense parameters over the stage's ``dp`` group, expert parameters
  over the ``edp`` group (the replicas of the same expert shard), so two optimizers.
- Gradients: dense ones are averaged over ``dp``; expert ones are summed over ``edp`` and divided
  by ``dp`` (their all-to-all backward already summed the contributions of the ``ep`` ranks).
- Clipping at 1.0 on the global norm: every parameter counted exactly once over the whole world.
- LR: the run's schedule (``training.schedule``: stages by steps or tokens seen; by default linear warm-up, then
  cosine to ``min_lr``), set on every param group before each step.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch import nn

import accel
from accel import grads
from accel.flight import FlightRecorder, record_collective
from training.config import OptimConfig
from training.schedule import Schedule

STEP_CHUNK = 1 << 24  # elements ``AdamW`` updates at once: its fp32 temporaries stay at 3 x 64 MiB


class AdamW(torch.optim.Optimizer):
    """AdamW with its moments stored in ``moments_dtype``, an optional FP32 master copy and an optional host EMA.

    The update is ``torch.optim.AdamW``'s (same operations in the same order; with fp32 moments and
    fp32 parameters the results are bitwise equal), computed in fp32 on chunks of ``STEP_CHUNK``
    elements: each chunk's moments are widened, updated, used, and stored back rounded to nearest.
    With ``master_dtype`` the update applies to the ``master`` state (initialised from the parameter
    at the first step) and the parameter receives its rounding to the parameter's dtype; the gradient
    is ``accel.grads.grad(p)`` (the fp32 ``main_grad`` of a bf16 parameter). ``moments_dtype`` None:
    the master's dtype (the parameter's without a master). ``load_state_dict`` keeps every state in its
    own dtype (torch would cast them to the parameter's: a bf16 parameter would round its fp32 master
    and moments) and the EMA on the host.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, moments_dtype: torch.dtype | None = torch.bfloat16,
                 ema_decay: float = 0.0, master_dtype: torch.dtype | None = None):
        if not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"AdamW: ema_decay must be in [0, 1), got {ema_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.moments_dtype, self.ema_decay, self.master_dtype = moments_dtype, ema_decay, master_dtype
        self._staging: dict[int, torch.Tensor] = {}  # host snapshots of the parameters for the EMA
        self._ema_job: Future | None = None
        self._ema_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ema") if ema_decay else None

    def _state_placement(self, p: torch.Tensor, key: str) -> dict:
        """Device and dtype of the per-parameter state ``key`` of ``p``."""
        if key == "ema":
            return dict(device="cpu", dtype=torch.float32)
        master = self.master_dtype or p.dtype
        return dict(device=p.device, dtype=master if key == "master" else self.moments_dtype or master)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        snapshots = []
        self.wait_ema()  # the snapshot buffers are about to be rewritten
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                g = grads.grad(p)
                if g is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    if self.master_dtype is not None:
                        state["master"] = p.detach().to(**self._state_placement(p, "master"), copy=True)
                    for key in ("exp_avg", "exp_avg_sq"):
                        state[key] = torch.zeros_like(p, **self._state_placement(p, key),
                                                      memory_format=torch.preserve_format)
                state["step"] += 1
                step = float(state["step"])
                bias_correction1 = 1 - beta1**step
                bias_correction2_sqrt = math.sqrt(1 - beta2**step)
                step_size = lr / bias_correction1
                has_master = "master" in state
                target = state["master"] if has_master else p  # what the update applies to
                flat = [target.view(-1), g.reshape(-1), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1),
                        p.view(-1)]
                math_dtype = torch.promote_types(target.dtype, torch.float32)
                for lo in range(0, p.numel(), STEP_CHUNK):
                    master, grad, m_store, v_store, param = (t[lo:lo + STEP_CHUNK] for t in flat)
                    grad = grad.to(math_dtype)
                    work = master.to(math_dtype)
                    m, v = m_store.to(math_dtype), v_store.to(math_dtype)
                    work.mul_(1 - lr * wd)
                    m.lerp_(grad, 1 - beta1)
                    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                    denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
                    work.addcdiv_(m, denom, value=-step_size)
                    stores = ((master, work), (m_store, m), (v_store, v)) + (((param, work),) if has_master else ())
                    for store, value in stores:
                        if value is not store:
                            store.copy_(value)  # rounded to nearest into a narrower store
                if self.ema_decay:
                    snapshots.append((p, self._snapshot(p, target)))  # the EMA of the master weights
        if snapshots:
            self._ema_job = self._ema_pool.submit(self._update_ema, snapshots, _copy_done_event())
        return loss

    def _snapshot(self, p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """A host copy of ``value`` (``p`` or its master) as it is now (queued on the current stream: later
        updates come after it)."""
        buf = self._staging.get(id(p))
        if buf is None:
            buf = torch.empty(p.shape, dtype=torch.float32, pin_memory=p.device.type != "cpu"
                              and torch.cuda.is_available())
            self._staging[id(p)] = buf
        buf.copy_(value.detach(), non_blocking=p.device.type != "cpu")
        return buf

    def _update_ema(self, snapshots: list[tuple[torch.Tensor, torch.Tensor]], event) -> None:
        if event is not None:
            event.synchronize()
        for p, snap in snapshots:
            state = self.state[p]
            ema = state.get("ema")
            if ema is None:
                state["ema"] = snap.clone()
            else:
                if ema.device.type != "cpu":
                    state["ema"] = ema = ema.to("cpu", torch.float32)
                ema.lerp_(snap, 1 - self.ema_decay)

    def wait_ema(self) -> None:
        """Block until the last EMA update is applied (before reading or saving it)."""
        if self._ema_job is not None:
            self._ema_job.result()
            self._ema_job = None

    def state_dict(self):
        self.wait_ema()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        # torch casts every floating state but "step" to the parameter's dtype: hold the tensors back and
        # place them afterwards in their own dtype (the bf16 -> fp32 -> bf16 round trip of moments is exact)
        held = {i: {k: v for k, v in s.items() if k != "step" and torch.is_tensor(v)}
                for i, s in state_dict["state"].items()}
        super().load_state_dict({**state_dict, "state": {i: {k: v for k, v in s.items() if k not in held[i]}
                                                         for i, s in state_dict["state"].items()}})
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(saved_ids, params):
            for key, value in held.get(i, {}).items():
                self.state[p][key] = value.to(**self._state_placement(p, key))

    def ema_state(self) -> dict[torch.Tensor, torch.Tensor]:
        """Parameter -> its host EMA, for the parameters this optimizer (shard) updates."""
        self.wait_ema()
        return {p: s["ema"] for p, s in self.state.items() if "ema" in s}


def _copy_done_event():
    """A device event after the snapshot copies (None on a CPU, where they are synchronous)."""
    if accel.backend() == "cpu":
        return None
    event = accel.device_module().Event()
    event.record()
    return event


def is_expert_param(name: str) -> bool:
    """Routed-expert weights (sharded over EP); the model names them ``...experts.<weight>``."""
    return ".experts." in f".{name}"


def split_params(modules: Iterable[nn.Module]) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """(dense, expert) named trainable parameters of all ``modules``, each parameter once."""
    seen: set[int] = set()
    dense, expert = [], []
    for i, module in enumerate(modules):
        for name, p in module.named_parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            (expert if is_expert_param(name) else dense).append((f"{i}.{name}", p))
    return dense, expert


def _param_groups(named: list[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    decay = [p for _, p in named if p.ndim >= 2]
    no_decay = [p for _, p in named if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def optimizer_spec(cfg: OptimConfig) -> tuple[type[torch.optim.Optimizer], dict]:
    """(optimizer class, its keyword arguments but the parameters) for ``cfg``: PyTorch's AdamW unless the
    moments are BF16, an EMA is kept or FP32 master weights are (then ``AdamW`` above), PyTorch's SGD with
    momentum ``betas[0]``."""
    if cfg.name == "sgd":
        if cfg.moments_dtype != "param" or cfg.ema_decay or cfg.master_dtype != "param":
            raise ValueError(f"optim.name='sgd' cannot take optim.moments_dtype={cfg.moments_dtype!r}, "
                             f"optim.ema_decay={cfg.ema_decay} or optim.master_dtype={cfg.master_dtype!r}: "
                             "they need optim.name='adamw'")
        return torch.optim.SGD, dict(lr=cfg.lr, momentum=cfg.betas[0])
    kw = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    if cfg.moments_dtype == "param" and not cfg.ema_decay and cfg.master_dtype == "param":
        return torch.optim.AdamW, kw
    dtype = torch.bfloat16 if cfg.moments_dtype == "bfloat16" else None
    master = torch.float32 if cfg.master_dtype == "float32" else None
    return AdamW, {**kw, "moments_dtype": dtype, "ema_decay": cfg.ema_decay, "master_dtype": master}


class Optimizers:
    """The dense and expert AdamW optimizers (ZeRO-1 sharded when asked), stepped together.

    With ``optim.master_dtype = "float32"`` every parameter gets an fp32 gradient buffer
    (``accel.grads.keep_main_grads``) before anything accumulates into it.
    """

    def __init__(self, modules: list[nn.Module], cfg: OptimConfig, dp_group: dist.ProcessGroup | None,
                 edp_group: dist.ProcessGroup | None, zero1: bool):
        dense, expert = split_params(modules)
        self.dense_params = [p for _, p in dense]
        self.expert_params = [p for _, p in expert]
        optimizer_class, kw = optimizer_spec(cfg)
        if cfg.master_dtype == "float32":
            grads.keep_main_grads(self.dense_params + self.expert_params, torch.float32)
        self.optimizers: list[torch.optim.Optimizer] = []
        for named, group in ((dense, dp_group), (expert, edp_group)):
            if not named:
                continue
            groups = _param_groups(named, cfg.weight_decay)
            shard = zero1 and group is not None and dist.get_world_size(group) > 1
            if shard:
                # imported here: torch.distributed.optim pulls in FSDP, DTensor and sympy, seconds of start-up
                # that only a sharded run needs (every launcher's parent process and one-process run skip it)
                from torch.distributed.optim import ZeroRedundancyOptimizer

                opt = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=optimizer_class,
                                              process_group=group, weight_decay=groups[0]["weight_decay"], **kw)
                for g in groups[1:]:
                    opt.add_param_group(g)
            else:
                opt = optimizer_class(groups, **kw)
            self.optimizers.append(opt)

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def zero_grad(self) -> None:
        """Zero every gradient in place, allocating it first if needed (``accel.grads.zero_grad``: layers that
        accumulate deferred weight gradients outside autograd add into them in place)."""
        for p in self.dense_params + self.expert_params:
            grads.zero_grad(p)

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def state_dict(self) -> list[dict]:
        """This rank's optimizer states (ZeRO shards are consolidated by the checkpoint code if needed)."""
        return [split_zero(opt)[0].state_dict() for opt in self.optimizers]

    def load_state_dict(self, states: list[dict]) -> None:
        if len(states) != len(self.optimizers):
            raise ValueError(f"optimizer state has {len(states)} optimizers, this run has {len(self.optimizers)}")
        for opt, state in zip(self.optimizers, states):
            split_zero(opt)[0].load_state_dict(state)


def split_zero(optimizer: torch.optim.Optimizer) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer | None]:
    """(the optimizer holding this rank's states, the ZeroRedundancyOptimizer around it or None)."""
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")  # loaded by sharded runs only
    if zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer):
        return optimizer.optim, optimizer
    return optimizer, None


def lr_lambda(schedule: Schedule) -> Callable[[int, int], float]:
    """The LR of the step that starts after ``step`` steps and ``tokens`` tokens: the schedule's LR curve
    (``training.schedule``; the config's stages, or warm-up then cosine from ``optim``'s keys)."""
    return schedule.lr.at


class LRScheduler:
    """Sets every optimizer's LR (ZeRO-1's outer param groups, synced inward at its step) to the schedule's value
    for the step about to run. The position (step, tokens seen) is the trainer's state, so a resumed run
    continues the schedule exactly; ``state_dict`` keeps the last point for reference."""

    def __init__(self, optimizers: Optimizers, schedule: Schedule):
        self.optimizers, self.fn = optimizers, lr_lambda(schedule)
        self.last = {"step": 0, "tokens": 0, "lr": self.fn(0, 0)}

    def step(self, step: int, tokens: int) -> float:
        """Set the LR of step ``step`` (``tokens`` tokens seen before it) on every param group; return it."""
        lr = self.fn(step, tokens)
        for group in self.optimizers.param_groups:
            group["lr"] = lr
        self.last = {"step": step, "tokens": tokens, "lr": lr}
        return lr

    def get_last_lr(self) -> float:
        return self.last["lr"]

    def state_dict(self) -> dict:
        return dict(self.last)

    def load_state_dict(self, state: dict | list) -> None:
        if isinstance(state, dict) and "lr" in state:  # (older checkpoints hold LambdaLR states: nothing to take)
            self.last = {k: state[k] for k in ("step", "tokens", "lr")}


def _flat_all_reduce(params: list[nn.Parameter], group: dist.ProcessGroup | None, scale: float,
                     flight: FlightRecorder | None = None, label: str = "dp") -> None:
    present = [g for g in map(grads.grad, params) if g is not None]
    if not present:
        return
    if group is not None and dist.get_world_size(group) > 1:
        flat = torch.cat([g.reshape(-1) for g in present])
        with record_collective(flight, f"{label} gradients", label, group, flat.numel() * flat.element_size()):
            dist.all_reduce(flat, group=group)
        offset = 0
        for g in present:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
    if scale != 1.0:
        for g in present:
            g.mul_(scale)


@torch.no_grad()
def reduce_gradients(opt: Optimizers, dp_group: dist.ProcessGroup | None, edp_group: dist.ProcessGroup | None,
                     dp_size: int, flight: FlightRecorder | None = None) -> None:
    """Average dense gradients over dp; sum expert gradients over edp and divide by dp. ``flight``: the rank's
    flight recorder (each all-reduce is an entry)."""
    for p in opt.dense_params + opt.expert_params:
        if grads.grad(p) is None:  # a parameter this step never reached
            grads.zero_grad(p)
    _flat_all_reduce(opt.dense_params, dp_group, 1.0 / dp_size, flight, "dp")
    _flat_all_reduce(opt.expert_params, edp_group, 1.0 / dp_size, flight, "edp")


@torch.no_grad()
def clip_grad_norm(opt: Optimizers, max_norm: float, dp_size: int, ep_size: int, stage_copies: int = 1,
                   expert_row_weights: dict[int, torch.Tensor] | None = None,
                   flight: FlightRecorder | None = None) -> float:
    """Global gradient L2 norm over every rank (each parameter counted once); clip to ``max_norm`` (0 = no clip).

    After ``reduce_gradients`` dense gradients are replicated on the ``dp`` ranks of a stage and
    expert gradients on the ``dp / ep`` replicas, and DualPipe holds every stage twice
    (``stage_copies=2``), so one world all-reduce of the weighted squares gives the true norm.
    ``expert_row_weights`` (EPLB): ``id(param) -> [rows]`` weight of each expert slot's square (1 /
    copies of its logical expert, whose replicas hold the same summed gradient). ``flight``: the rank's flight
    recorder (the all-reduce is an entry).
    """
    weights = expert_row_weights or {}

    def expert_square(p: nn.Parameter) -> torch.Tensor:
        sq = grads.grad(p).double().square()
        w = weights.get(id(p))
        return sq.sum() if w is None else (sq.reshape(sq.shape[0], -1).sum(1) * w).sum()

    dense_sq = sum((grads.grad(p).double().square().sum() for p in opt.dense_params if grads.grad(p) is not None),
                   torch.zeros((), dtype=torch.float64))
    expert_sq = sum((expert_square(p) for p in opt.expert_params if grads.grad(p) is not None),
                    torch.zeros((), dtype=torch.float64))
    total = (dense_sq / dp_size + expert_sq / (dp_size // ep_size)) / stage_copies
    world = dist.get_world_size() if dist.is_initialized() else 1
    with record_collective(flight if world > 1 else None, "gradient norm", "world", None, 8):
        if world > 1:
            dist.all_reduce(total)
        norm = float(total.sqrt())  # with NCCL the host waits for the all-reduce here: inside the recorded span
    if max_norm > 0 and math.isfinite(norm) and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for g in map(grads.grad, opt.dense_params + opt.expert_params):
            if g is not None:
                g.mul_(coef)
    return norm
