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
  over the ``edp`` group (the replicas of the same expert shard), so two optimizers. Muon
  (``optim.name = "muon"``, docs/muon.md) shards the same way with whole matrices balanced by their
  Newton-Schulz FLOPs (``MatrixOwners``).
- Gradients: dense ones are averaged over ``dp``; expert ones are summed over ``edp`` and divided
  by ``dp`` (their all-to-all backward already summed the contributions of the ``ep`` ranks).
- Clipping at 1.0 on the global norm: every parameter counted exactly once over the whole world.
- LR: the run's schedule (``training.schedule``: stages by steps or tokens seen; by default linear warm-up, then
  cosine to ``min_lr``), set on every param group before each step.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable, Iterable, Sequence
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
            for p in group["params"]:
                g = grads.grad(p)
                if g is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    if self.master_dtype is not None:
                        state["master"] = p.detach().to(**self._state_placement(p, "master"), copy=True)
                    for key in self._moment_keys(group):
                        state[key] = torch.zeros_like(p, **self._state_placement(p, key),
                                                      memory_format=torch.preserve_format)
                state["step"] += 1
                target = state["master"] if "master" in state else p  # what the update applies to
                self._update(group, p, g, state, target)
                if self.ema_decay:
                    snapshots.append((p, self._snapshot(p, target)))  # the EMA of the master weights
        if snapshots:
            self._ema_job = self._ema_pool.submit(self._update_ema, snapshots, _copy_done_event())
        return loss

    def _moment_keys(self, group: dict) -> tuple[str, ...]:
        """The per-parameter moment states of a parameter in ``group``."""
        return ("exp_avg", "exp_avg_sq")

    def _update(self, group: dict, p: torch.Tensor, g: torch.Tensor, state: dict, target: torch.Tensor) -> None:
        """One AdamW update of ``target`` (``p`` or its master; ``p`` gets the master's rounding) from ``g``."""
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        step = float(state["step"])
        bias_correction1 = 1 - beta1**step
        bias_correction2_sqrt = math.sqrt(1 - beta2**step)
        step_size = lr / bias_correction1
        has_master = target is not p
        flat = [target.view(-1), g.reshape(-1), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1), p.view(-1)]
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


MUON_ADJUST_LR = ("match_rms_adamw", "original")


def newton_schulz(g: torch.Tensor, ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
                  ns_steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """The orthogonalised ``g`` (2-D) as ``torch.optim.Muon`` computes it: ``ns_steps`` quintic Newton-Schulz
    iterations in bfloat16 on ``g / ||g||_F``, on the wide orientation (same operations in the same order, so
    the same bits); returns bfloat16."""
    a, b, c = ns_coefficients
    x = g.bfloat16()
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def muon_lr_ratio(adjust_lr_fn: str, update_rms: float, rows: int, cols: int) -> float:
    """Scale of the LR of a ``rows`` x ``cols`` matrix: ``update_rms * sqrt(max(rows, cols))`` makes the
    orthogonalised update's RMS ``update_rms`` (Moonlight's 0.2 gives AdamW's typical RMS, so AdamW's LR and
    weight decay carry over: torch's ``match_rms_adamw``); ``original``: Keller Jordan's ``sqrt(max(1, rows /
    cols))``."""
    if adjust_lr_fn == "original":
        return math.sqrt(max(1.0, rows / cols))
    return update_rms * math.sqrt(max(rows, cols))


def newton_schulz_flops(rows: int, cols: int, steps: int = 5) -> float:
    """FLOPs of ``newton_schulz`` on one ``rows x cols`` matrix: per iteration ``X X^T`` (2 m^2 n), the quintic's
    ``gram @ gram`` (2 m^3) and ``poly @ X`` (2 m^2 n), on the wide orientation (m = min, n = max)."""
    m, n = sorted((rows, cols))
    return float(steps * (4 * m * m * n + 2 * m**3))


def muon_matrices(name: str, p: torch.Tensor) -> tuple[int, int, int]:
    """(count, rows, cols) of the matrices Muon orthogonalises one at a time in ``p``: a 3-D grouped expert
    weight ``[experts, out, in]`` is one matrix per expert; a fused ``w13`` (``[w1; w3]`` along the output rows)
    is its two matrices, as the model they come from trains them."""
    lead = p.shape[0] if p.ndim == 3 else 1
    rows, cols = p.shape[-2], p.shape[-1]
    if name.rsplit(".", 2)[-1] == "w13" or name.endswith("w13.weight"):
        return 2 * lead, rows // 2, cols
    return lead, rows, cols


class Muon(AdamW):
    """Muon for the hidden matrices, AdamW for everything else (``use_muon`` per parameter group), one optimizer.

    A Muon group's update is ``torch.optim.Muon``'s, matrix by matrix (``matrices``: ``id(param) -> (count,
    rows, cols)``; the parameter is viewed as ``count`` matrices, each orthogonalised alone, see
    ``muon_matrices``): momentum ``buf = lerp(buf, g, 1 - momentum)``, Nesterov ``lerp(g, buf, momentum)``,
    ``newton_schulz``, decoupled decay ``lr * weight_decay`` and the step ``lr * muon_lr_ratio``. The momentum
    buffer is the group's only state (``momentum_buffer``, in ``moments_dtype`` like AdamW's moments). Master
    weights, BF16 moments and the host EMA are ``AdamW``'s, for both kinds of group. Under ZeRO-1 each rank's
    ``Muon`` holds the parameters it owns whole (``MatrixOwners``), so each matrix's Newton-Schulz runs once, on
    the rank owning its state, and the updated parameters are broadcast from it.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.1, moments_dtype: torch.dtype | None = None, ema_decay: float = 0.0,
                 master_dtype: torch.dtype | None = None, matrices: dict[int, tuple[int, int, int]] | None = None,
                 use_muon: bool = False, momentum: float = 0.95, nesterov: bool = True,
                 ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315), ns_steps: int = 5,
                 ns_eps: float = 1e-7, adjust_lr_fn: str = "match_rms_adamw", update_rms: float = 0.2):
        if adjust_lr_fn not in MUON_ADJUST_LR:
            raise ValueError(f"Muon: adjust_lr_fn must be one of {', '.join(MUON_ADJUST_LR)}, got {adjust_lr_fn!r}")
        self.matrices = dict(matrices or {})
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, moments_dtype=moments_dtype,
                         ema_decay=ema_decay, master_dtype=master_dtype)
        self.defaults.update(use_muon=use_muon, momentum=momentum, nesterov=nesterov,
                             ns_coefficients=tuple(ns_coefficients), ns_steps=ns_steps, ns_eps=ns_eps,
                             adjust_lr_fn=adjust_lr_fn, update_rms=update_rms)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            if group["lr"] <= 0 and group["use_muon"]:
                raise ValueError(f"Muon: the Muon group's lr must be > 0, got {group['lr']}")
            if group["use_muon"]:
                for p in group["params"]:
                    if p.ndim not in (2, 3):
                        raise ValueError(f"Muon: a Muon parameter must be a matrix or a stack of them, got shape "
                                         f"{tuple(p.shape)}")

    def add_param_group(self, param_group: dict) -> None:
        for key, value in getattr(self, "defaults", {}).items():
            param_group.setdefault(key, value)
        super().add_param_group(param_group)

    def _moment_keys(self, group: dict) -> tuple[str, ...]:
        return ("momentum_buffer",) if group["use_muon"] else super()._moment_keys(group)

    def _update(self, group: dict, p: torch.Tensor, g: torch.Tensor, state: dict, target: torch.Tensor) -> None:
        if not group["use_muon"]:
            return super()._update(group, p, g, state, target)
        count, rows, cols = self.matrices.get(id(p), (p.numel() // (p.shape[-2] * p.shape[-1]),) + tuple(p.shape[-2:]))
        store = state["momentum_buffer"]
        math_dtype = torch.promote_types(target.dtype, torch.float32)
        grad = g if g.dtype == math_dtype else g.to(math_dtype)
        buf = store if store.dtype == math_dtype else store.to(math_dtype)
        buf.lerp_(grad, 1 - group["momentum"])
        if buf is not store:
            store.copy_(buf)
        update = grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
        ortho = torch.stack([newton_schulz(m, group["ns_coefficients"], group["ns_steps"], group["ns_eps"])
                             for m in update.reshape(count, rows, cols)]).view(p.shape)
        lr = group["lr"]
        target.mul_(1 - lr * group["weight_decay"])
        target.add_(ortho, alpha=-lr * muon_lr_ratio(group["adjust_lr_fn"], group["update_rms"], rows, cols))
        if target is not p:
            p.copy_(target)  # bf16(master), rounded to nearest


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


ADAMW_MATRICES = ("embed", "head", "gate")  # 2-D parameters Muon leaves to AdamW (V4: embedding, head, router)
ADAMW_BIASES = ("bias", "ape")  # added to activations, not applied to them (``ape``: V4 compressor's position bias)


def uses_muon(name: str, p: torch.Tensor) -> bool:
    """Whether Muon updates the parameter ``name``: the hidden matrices (attention, indexer, compressor and FFN
    projections, dense, shared and routed experts, MTP's projections, mHC's dynamic mixing projections); AdamW
    keeps the embedding, the output head, the router gate, norm weights, mHC's static biases and gating factors,
    and biases, 2-D ones included (DeepSeek-V4's split)."""
    parts = name.split(".")
    module = parts[-2] if parts[-1] in ("weight", "bias") and len(parts) > 1 else parts[-1]
    return p.ndim >= 2 and parts[-1] not in ADAMW_BIASES and module not in ADAMW_MATRICES


def _param_groups(named: list[tuple[str, nn.Parameter]], cfg: OptimConfig) -> list[dict]:
    """AdamW groups with and without decay (1-D parameters); with ``optim.name = "muon"`` first a Muon group of
    the hidden matrices with their own LR and weight decay (every group says ``use_muon``)."""
    muon = cfg.name == "muon"
    matrices = [p for name, p in named if muon and uses_muon(name, p)]
    taken = {id(p) for p in matrices}
    rest = [p for _, p in named if id(p) not in taken]
    groups = [{"params": [p for p in rest if p.ndim >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0}]
    if muon:
        groups = [{"params": matrices, "weight_decay": cfg.muon_weight_decay, "lr": cfg.muon_lr, "use_muon": True}] + [
            {**g, "lr": cfg.lr, "use_muon": False} for g in groups]
    return [g for g in groups if g["params"]]


def optimizer_spec(cfg: OptimConfig) -> tuple[type[torch.optim.Optimizer], dict]:
    """(optimizer class, its keyword arguments but the parameters) for ``cfg``: PyTorch's AdamW unless the
    moments are BF16, an EMA is kept or FP32 master weights are (then ``AdamW`` above), PyTorch's SGD with
    momentum ``betas[0]``; ``Muon`` (with AdamW groups) for ``muon``."""
    if cfg.name == "muon":
        dtype = torch.bfloat16 if cfg.moments_dtype == "bfloat16" else None
        master = torch.float32 if cfg.master_dtype == "float32" else None
        return Muon, dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, moments_dtype=dtype, ema_decay=cfg.ema_decay,
                          master_dtype=master, momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov,
                          ns_steps=cfg.muon_ns_steps, adjust_lr_fn=cfg.muon_adjust_lr, update_rms=cfg.muon_update_rms)
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


def owners_by_cost(costs: Sequence[float], world: int) -> list[int]:
    """The rank owning each item: largest cost first, each to the least loaded rank so far (ties: the lowest
    rank), the longest-processing-time greedy; deterministic, so every rank computes the same plan."""
    load = [0.0] * world
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owner[i] = rank
        load[rank] += costs[i]
    return owner


class MatrixOwners:
    """ZeRO-1 for Muon: every parameter whole on one rank of ``group``, which keeps its state, updates it and
    broadcasts it (``broadcast``, after the step) to the others.

    Muon's matrices are balanced by their Newton-Schulz FLOPs (``newton_schulz_flops`` of each matrix, as
    Megatron-Core's and Moonlight's distributed Muon balance the orthogonalisation), the AdamW parameters by their
    elements (their state's bytes), each set on its own: ``ZeroRedundancyOptimizer`` balances elements only,
    which leaves the rank owning the widest matrices with several times the others' Newton-Schulz work.
    """

    def __init__(self, named: list[tuple[str, nn.Parameter]], group: dist.ProcessGroup, ns_steps: int):
        world = dist.get_world_size(group)
        self.group, self.rank = group, dist.get_rank(group)
        self.sources = [dist.get_global_rank(group, r) for r in range(world)]
        self.params = [p for _, p in named]
        self.owner: dict[int, int] = {}
        muon = [(n, p) for n, p in named if uses_muon(n, p)]
        rest = [(n, p) for n, p in named if not uses_muon(n, p)]

        def flops(name: str, p: torch.Tensor) -> float:
            count, rows, cols = muon_matrices(name, p)
            return count * newton_schulz_flops(rows, cols, ns_steps)

        for items, cost in ((muon, flops), (rest, lambda name, p: float(p.numel()))):
            for (_, p), rank in zip(items, owners_by_cost([cost(n, p) for n, p in items], world)):
                self.owner[id(p)] = rank

    def owns(self, p: nn.Parameter) -> bool:
        return self.owner[id(p)] == self.rank

    @torch.no_grad()
    def broadcast(self) -> None:
        """Each owner's updated parameters to every rank of the group: one flat broadcast per owner and dtype."""
        for rank, src in enumerate(self.sources):
            mine = [p for p in self.params if self.owner[id(p)] == rank]
            for dtype in dict.fromkeys(p.dtype for p in mine):
                ps = [p for p in mine if p.dtype == dtype]
                if rank == self.rank:
                    flat = torch.cat([p.detach().reshape(-1) for p in ps])
                else:
                    flat = torch.empty(sum(p.numel() for p in ps), dtype=dtype, device=ps[0].device)
                dist.broadcast(flat, src=src, group=self.group)
                if rank != self.rank:
                    offset = 0
                    for p in ps:
                        p.copy_(flat[offset:offset + p.numel()].view_as(p))
                        offset += p.numel()


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
        if optimizer_class is Muon:  # how each Muon parameter splits into matrices (the w13 halves need the name)
            optimizer_class = functools.partial(Muon, matrices={id(p): muon_matrices(name, p)
                                                                for name, p in dense + expert if uses_muon(name, p)})
        if cfg.master_dtype == "float32":
            grads.keep_main_grads(self.dense_params + self.expert_params, torch.float32)
        self.optimizers: list[torch.optim.Optimizer] = []
        self.owners: list[MatrixOwners] = []  # Muon's ZeRO-1 (whole matrices balanced by FLOPs)
        for named, group in ((dense, dp_group), (expert, edp_group)):
            if not named:
                continue
            groups = _param_groups(named, cfg)
            shard = zero1 and group is not None and dist.get_world_size(group) > 1
            if shard and cfg.name == "muon":
                owners = MatrixOwners(named, group, cfg.muon_ns_steps)
                self.owners.append(owners)  # every group kept (maybe empty here): the same grouping on every rank
                opt = optimizer_class([{**g, "params": [p for p in g["params"] if owners.owns(p)]} for g in groups],
                                      **kw)
            elif shard:
                # imported here: torch.distributed.optim pulls in FSDP, DTensor and sympy, seconds of start-up
                # that only a sharded run needs (every launcher's parent process and one-process run skip it)
                from torch.distributed.optim import ZeroRedundancyOptimizer

                first = {k: v for k, v in groups[0].items() if k != "params"}
                opt = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=optimizer_class,
                                              process_group=group, **{**kw, **first})
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
        for owners in self.owners:
            owners.broadcast()

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
