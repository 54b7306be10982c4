"""The training loop: one code path from a 1-process CPU run to the PP x EP x DP layout.

Per optimizer step: the sampler hands this data-parallel rank its slice of the global batch; the
micro-batches go through the pipeline schedule (``parallel.schedule``; ``none`` is plain gradient
accumulation), the gradients are reduced (dense over dp, experts over their replicas), clipped to
``optim.clip_grad`` on the global norm, the optimizers step (ZeRO-1 sharded), the LR scheduler
steps, and the aux-loss-free expert biases are updated from the global batch's expert loads.

Hooks, for checkpointing and fault tolerance (``training/checkpoint``, ``training/fault.py``):

- ``after_backward_hooks``: ``fn(trainer, metrics) -> bool``; after gradients are reduced and the
  norm is known, before the optimizer step. Returning False skips this step's update (every rank
  must agree: decide from globally reduced values such as ``metrics["loss"]``/``["grad_norm"]``).
- ``step_end_hooks``: ``fn(trainer, metrics)``; after the step, before logging. May add metrics
  (e.g. ``checkpoint_stall_s``).

``state_dict()`` / ``load_state_dict()`` are what a checkpoint holds: model (with expert biases), optimizer
states keyed by parameter name, LR scheduler, sampler, step and tokens seen (and EPLB's plan); RNG states
are captured by the checkpoint manager.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import accel
import models.deepseek_v4 as v4
from accel import grads
from accel.flight import FlightRecorder, flight_path, record_collective
from accel.trace import TraceRecorder
from deep_gemm.health import Fp8Health, merge_counts
from deep_gemm.utils import unchecked_scale_values
from models.deepseek_v3 import ModelArgs
from models.deepseek_v3.eplb import local_physical_experts
from models.deepseek_v4.args import PRESETS as V4_PRESETS
from models.deepseek_v4.args import hf_model_type
from training.checkpoint.format import CheckpointMismatchError
from training.checkpoint.resume import load_named_optimizer_state, named_optimizer_state, param_names
from training.compile import check_compile, compile_stages, eager, tracing
from training.config import DataConfig, TrainConfig, check_microbatches, check_world_size, numerics_dict, schedule_of
from training.context_parallel import check_context_parallel, context_parallel, wire_context_parallel
from training.data import ResumableSampler, TokenCorpus, build_tokenizer, check_vocab, load_corpus
from training.eplb import EplbRuntime, check_eplb, initial_plan
from training.experts import load_metrics, update_biases, wire_moe_layers
from training.fault import Fp8Shadow, blame_layers, block_of, fp8_disabled, fp8_modules
from training.inference import pipeline_generate, pipeline_hidden
from training.loss import StageLoss, freeze_all_but_indexers, indexer_metrics, init_from_hf
from training.metrics import MetricsLogger, NullLogger, fp8_health_metrics, model_flops_per_token
from training.optim import LRScheduler, Optimizers, clip_grad_norm, reduce_gradients
from training.parallel import ParallelState
from training.pipeline import PipelineRunner
from training.stages import (
    DeepSeekV3Stage,
    build_stages,
    chunk_layers,
    expert_range,
    num_model_stages,
    split_layers,
    stage_ids,
)

if TYPE_CHECKING:  # the loop only calls them; training.run makes them
    from training.preempt import Preemption, Stop

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
log = logging.getLogger(__name__)


def model_args(cfg: TrainConfig) -> ModelArgs | v4.ModelArgs:
    """The model's arguments: the preset (a DeepSeek-V4 one builds ``models.deepseek_v4``), or the architecture of
    ``model.hf_config`` (V3 or V4 by its ``model_type``), then the overrides and the config's FP8 / fused-ops /
    MTP switches."""
    fp8 = cfg.model.fp8 and cfg.model.fp8_recipe  # False, or the recipe's name
    changes = {**cfg.model.overrides, "fp8": fp8, "fused_ops": cfg.model.fused_ops,
               "expert_weight_format": cfg.model.expert_weight_format,
               "indexer_qk_format": cfg.model.indexer_qk_format, "mtp_loss_weight": cfg.model.mtp_lambda}
    try:
        if cfg.model.hf_config:
            try:
                return hf_model_family(cfg.model.hf_config).from_hf_config(cfg.model.hf_config, **changes)
            except ValueError as exc:
                raise ValueError(f"model.hf_config={cfg.model.hf_config!r}: {exc}") from None
        family = v4.ModelArgs if cfg.model.preset in V4_PRESETS else ModelArgs
        return family.preset(cfg.model.preset, **changes)
    except TypeError as exc:  # an unknown ModelArgs field
        raise ValueError(f"model.overrides: {exc}") from None


def hf_model_family(path: str | Path) -> type[ModelArgs] | type[v4.ModelArgs]:
    """The ``ModelArgs`` class that reads the ``config.json`` at ``path`` (a file or a folder holding one): V4's
    for ``model_type = "deepseek_v4"``, else V3's (an unreadable file is left to its ``from_hf_config`` to name)."""
    file = Path(path).expanduser()
    file = file / "config.json" if file.is_dir() else file
    try:
        kind = json.loads(file.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        kind = None
    return v4.ModelArgs if kind == "deepseek_v4" else ModelArgs


def set_cpu_threads(threads: int) -> None:
    """Torch intra-op threads: ``threads``, else ``OMP_NUM_THREADS``, else cores / processes on this node.

    Oversubscribed cores make torch's thread pool spin: on a loaded 2-core machine two threads per
    process ran a step 10-20x slower than one.
    """
    if threads <= 0:
        if os.environ.get("OMP_NUM_THREADS"):
            return
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        threads = max(1, (os.cpu_count() or 1) // local)
    torch.set_num_threads(threads)


def max_global_batch(cfg: TrainConfig) -> int:
    return max(schedule_of(cfg).batch_sizes())


def check_layout(cfg: TrainConfig, world: int | None = None, *, allow_missing_init: bool = False) -> ModelArgs:
    """The checks of ``check_static`` that need no data: world size (when ``world`` is given), model
    arguments, pipeline split, combinations refused by construction, micro-batches of every ramp step,
    balancing and EPLB. The planner's legality test (it asks for thousands of layouts)."""
    if world is not None:
        check_world_size(cfg.parallel, world)
    args = model_args(cfg)
    par = cfg.parallel
    if isinstance(args, v4.ModelArgs) and par.cp > 1:
        raise ValueError(f"model.preset={cfg.model.preset!r}: DeepSeek-V4 trains without context parallelism so "
                         f"far; set parallel.cp=1")
    if par.vpp > 1:
        chunk_layers(args, par.pp, par.vpp)
    else:
        split_layers(args, num_model_stages(par.schedule, par.pp))
    if par.ep > 1:
        expert_range(args, 0, par.ep)
    if args.n_mtp_layers and not par.layout.same_rank(0, par.layout.num_parts - 1):
        raise ValueError(f"model.overrides.n_mtp_layers={args.n_mtp_layers} with parallel.schedule={par.schedule!r} "
                         f"and parallel.pp={par.pp}: MTP shares the embedding, which this schedule puts on another "
                         "rank than the last stage; use parallel.schedule dualpipev / zbv / dualpipe, or set "
                         "model.overrides.n_mtp_layers=0")
    for batch in schedule_of(cfg).batch_sizes():  # every batch in between is a multiple that suits the schedule too
        check_microbatches(par, batch // (par.dp * cfg.data.micro_batch), f"a global batch of {batch} sequences")
    if cfg.data.seq_len > args.max_seq_len:
        raise ValueError(f"data.seq_len={cfg.data.seq_len} exceeds the model's max_seq_len={args.max_seq_len}")
    check_context_parallel(par.cp, cfg.data.seq_len, args.n_mtp_layers, cfg.balance.capacity_factor)
    check_eplb(cfg, args)
    if cfg.run.compile and isinstance(args, v4.ModelArgs):
        raise ValueError("run.compile=true with a DeepSeek-V4 model: only V3's blocks are compiled so far; set "
                         "run.compile=false")
    if cfg.run.compile and par.cp > 1:
        raise ValueError(f"run.compile=true with parallel.cp={par.cp}: the latent all-gather runs inside MLA, which "
                         "would then be a compiled region; set run.compile=false or parallel.cp=1")
    if cfg.run.compile:
        check_compile(args, cfg.logging.fp8_health_every if low_precision_casts(cfg) else 0,
                      bool(cfg.fault.inject_fp8_scale_error_at_step))
    init_missing = cfg.model.init_from and not Path(cfg.model.init_from).exists()
    if cfg.model.init_from and not (allow_missing_init and init_missing) \
            and not (Path(cfg.model.init_from) / "config.json").is_file():
        raise ValueError(f"model.init_from={cfg.model.init_from!r}: no config.json there; expected an HF checkpoint "
                         "folder (e.g. one written by recipes.export_hf)")
    v4_start = cfg.model.init_from and hf_model_type(cfg.model.init_from) == "deepseek_v4"
    if v4_start and not isinstance(args, v4.ModelArgs):
        raise ValueError(f"model.init_from={cfg.model.init_from!r} is a DeepSeek-V4 checkpoint (model_type "
                         f"'deepseek_v4') and model.preset={cfg.model.preset!r} a V3 model; a V4 checkpoint starts a "
                         "V4 preset (deepseek_v4_flash, deepseek_v4_pro, debug_v4)")
    if cfg.model.init_from and isinstance(args, v4.ModelArgs) and not v4_start and not init_missing:
        raise ValueError(f"model.init_from={cfg.model.init_from!r} is not a DeepSeek-V4 checkpoint (its config.json's "
                         f"model_type is not 'deepseek_v4') and model.preset={cfg.model.preset!r} a V4 model")
    if cfg.model.init_from and cfg.eplb.enabled:
        raise ValueError("model.init_from with eplb.enabled=true: an HF checkpoint loads into the logical expert "
                         "layout only; set eplb.enabled=false")
    return args


def low_precision_casts(cfg: TrainConfig) -> bool:
    """Whether the run makes the casts the FP8 health report counts: FP8 GEMMs, MXFP4 QAT experts, or the
    indexer's FP4 q and k (``model.indexer_qk_format = "mxfp4_hadamard"``)."""
    return bool(cfg.model.fp8) or cfg.model.expert_weight_format == "mxfp4_qat" \
        or cfg.model.indexer_qk_format == "mxfp4_hadamard"


def check_static(cfg: TrainConfig, world: int | None = None, *, allow_missing_data: bool = False
                 ) -> tuple[ModelArgs, TokenCorpus | None]:
    """Every check a launch makes before a process group exists, and the one ``--dry-run`` makes too:
    ``check_layout``, then data files, corpus size and vocabulary. Returns (args, corpus).

    ``allow_missing_data``: a dry run plans a cluster job from a laptop, where ``data.source`` and
    ``data.tokenizer`` need not exist; they are then reported (``missing_data``) instead of failing,
    and corpus is None. When they are present, the corpus is checked exactly as at launch."""
    args = check_layout(cfg, world, allow_missing_init=allow_missing_data)  # (a dry run plans from a laptop)
    if allow_missing_data and missing_data(cfg.data):
        return args, None
    corpus = load_corpus(cfg.data, build_tokenizer(cfg.data.tokenizer), min_windows=max_global_batch(cfg))
    check_vocab(corpus, args.vocab_size)
    return args, corpus


def missing_data(data: DataConfig) -> list[str]:
    """The configured data files that do not exist on this machine (``data.source``, ``data.tokenizer``)."""
    missing = []
    if data.source != "bundled" and not glob.glob(os.path.expanduser(data.source)):
        missing.append(f"data.source={data.source!r}")
    if data.tokenizer != "byte" and not Path(data.tokenizer).expanduser().exists():
        missing.append(f"data.tokenizer={data.tokenizer!r}")
    return missing


@torch.no_grad()
def scale_grads(module: nn.Module, factor: float) -> None:
    """Multiply every gradient of ``module`` (each shared parameter once) by ``factor``."""
    for g in map(grads.grad, module.parameters()):
        if g is not None:
            g.mul_(factor)


class Trainer:
    """Builds this rank's stages, optimizer, data and logger from a validated config, and trains."""

    def __init__(self, cfg: TrainConfig, ps: ParallelState, run_dir: str | Path, wandb_mode: str = "disabled",
                 checked: tuple[ModelArgs, TokenCorpus] | None = None, recorder: TraceRecorder | None = None):
        self.cfg, self.ps, self.run_dir = cfg, ps, Path(run_dir)
        self.recorder = recorder  # the --trace timeline: handed to the pipeline and the EP exchanges
        # always on: the last pipeline actions and collectives, dumped to run_dir/flight/ on a hang (accel.flight)
        self.flight = FlightRecorder(ps.rank, flight_path(self.run_dir, ps.rank), world_size=ps.world_size)
        self.device = accel.default_device()
        self.dtype = DTYPES[cfg.run.dtype]
        torch.manual_seed(cfg.run.seed)
        set_cpu_threads(cfg.run.threads)
        self.args, self.corpus = checked if checked is not None else check_static(cfg)
        self.tokenizer = build_tokenizer(cfg.data.tokenizer)
        c = ps.coords
        self.sampler = ResumableSampler(self.corpus.num_train, cfg.run.seed, c.dp_rank, cfg.parallel.dp)
        physical = None
        if cfg.eplb.enabled:  # this rank's physical expert slots under the plan used until loads are measured
            physical = local_physical_experts(initial_plan(cfg, self.args), c.ep_rank, cfg.parallel.ep).tolist()
        self.model, self.stages = build_stages(self.args, cfg.parallel.schedule, cfg.parallel.pp, c.pp_rank,
                                               c.ep_rank, cfg.parallel.ep, self.device, self.dtype, cfg.run.seed,
                                               physical_experts=physical, vpp=cfg.parallel.vpp,
                                               memory_policy=not cfg.run.compile)
        self.modules = nn.ModuleList(self.stages)
        if cfg.model.init_from:
            init_from_hf(self.model, cfg.model.init_from)
        if self.args.dsa_warmup:  # DSA stage 1: only the indexers train; nothing else reaches the optimizer
            freeze_all_but_indexers(self.stages)
        wire_moe_layers(self.stages, cfg, ps, recorder, self.flight)  # expert parallelism and balancing here
        # context parallelism: MLA's latent exchange, the rows' positions, the loss shares
        self.cp = context_parallel(cfg, ps, recorder, self.flight)
        wire_context_parallel(self.stages, self.cp)
        if cfg.run.compile:  # after the EP wiring: an expert-parallel block compiles the pieces between its all-to-alls
            compile_stages(self.stages, cfg.run.compile_backend)
        self.pipeline = (PipelineRunner(self.stages, cfg, ps, recorder, self.flight, self.cp)
                         if cfg.parallel.schedule != "none" else None)
        self.optimizer = Optimizers(self.stages, cfg.optim, ps.group("dp"), ps.group("edp"), cfg.parallel.zero1)
        self.schedule = schedule_of(cfg)  # LR, batch, MTP weight and bias speed by steps and tokens seen
        self.lr_scheduler = LRScheduler(self.optimizer, self.schedule)
        self.eplb = EplbRuntime(self.stages, cfg, self.args, ps.group("ep"), ps.group("dp"), self.optimizer.optimizers,
                                mirror_group=ps.group("pp") if cfg.parallel.layout.copies > 1 else None
                                ) if cfg.eplb.enabled else None
        self.step, self.tokens_seen = 0, 0
        self.after_backward_hooks: list[Callable[[Trainer, dict[str, Any]], bool]] = []
        self.step_end_hooks: list[Callable[[Trainer, dict[str, Any]], None]] = []
        self.wandb_mode = wandb_mode
        self.logger: MetricsLogger | NullLogger = NullLogger()
        self.history: list[dict[str, Any]] = []
        self.holds_loss = self._holds_loss()
        self.preemption: Preemption | None = None  # set by training.run: SIGTERM / SIGINT / run.max_minutes
        self.stopped: Stop | None = None  # why and after which step fit() stopped early (every rank agrees)
        self._nan_injected = False  # fault.inject_nan_at_step fires once per process
        # FP8 health (logging.fp8_health_every) and the BF16 shadow (fault.fp8_shadow_every): owned here, handed
        # to the FP8 layers; the shadow's fallback switches blocks to BF16 for the rest of the run
        self.fp8_health = Fp8Health() if low_precision_casts(cfg) and cfg.logging.fp8_health_every else None
        if self.fp8_health is not None:
            self.fp8_health.attach(self.stages)
        f = cfg.fault
        self.fp8_shadow = Fp8Shadow(f.fp8_shadow_threshold, f.fp8_shadow_patience) \
            if cfg.model.fp8 and f.fp8_shadow_every else None
        self.fp8_bf16_blocks: list[str] = []
        self._fp8_warned: dict[str, float] = {}  # FP8-health warnings given: layer GEMM operand -> underflow
        if f.inject_fp8_scale_error_at_step:
            self._inject_fp8_scale_error(f.inject_fp8_scale_error_layer, f.inject_fp8_scale_error_at_step)

    # ---- construction helpers -----------------------------------------------------------------
    def _holds_loss(self) -> bool:
        """Whether this rank computes the loss (holds the last stage of the first replica)."""
        par = self.cfg.parallel
        return (num_model_stages(par.schedule, par.pp, par.vpp) - 1) in stage_ids(par.schedule, par.pp,
                                                                                    self.ps.coords.pp_rank, par.vpp)

    @property
    def loss_stage(self) -> DeepSeekV3Stage | None:
        return next((s for s in self.stages if s.is_last), None)

    # ---- state ----------------------------------------------------------------------------------
    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers under the Transformer's names (shared tensors once).

        Routed experts are in the logical layout (this EP rank's ``E / ep`` experts, as without EPLB);
        under EPLB that takes a collective over the EP group, so every rank of it must call this.
        """
        out: dict[str, torch.Tensor] = {}
        for st in self.stages:
            for k, v in st.state_dict().items():
                out.setdefault(k, v)
        return self.eplb.logical_model_state(out) if self.eplb is not None else out

    def param_names(self) -> dict[int, str]:
        """``id(param) -> name`` of this rank's parameters as checkpoints key them (``checkpoint.resume``)."""
        return param_names(self.stages, self.args, self.ps.coords.ep_rank, self.cfg.parallel.ep)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds: model (logical expert layout), optimizer states keyed by parameter name (the
        ZeRO-1 shard this rank holds; re-partitionable, expert moments in the logical layout too), scheduler,
        sampler, step; EPLB's plan and load average when it is on. Under EPLB every rank of the EP group must
        call this (the logical layout takes collectives)."""
        model = self.model_state_dict()
        names = self.param_names()
        optimizer = [named_optimizer_state(opt, names) for opt in self.optimizer.optimizers]
        if self.eplb is not None:
            self.eplb.logical_optimizer_state(optimizer, names)
        state = {
            "model": model,
            "optimizer": optimizer,
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "sampler": self.sampler.state_dict(),
            "trainer": {"step": self.step, "tokens_seen": self.tokens_seen},
        }
        if self.eplb is not None:
            state["eplb"] = self.eplb.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of ``state_dict``, from this layout's checkpoint or one re-partitioned for it
        (``training.checkpoint.reshard``). Under EPLB the saved plan (if any) is adopted first and the logical
        expert weights and moments are materialised into its physical slots; a checkpoint without EPLB state
        keeps the current plan."""
        named = state["optimizer"]
        optimizers = self.optimizer.optimizers
        if len(named) != len(optimizers):
            raise CheckpointMismatchError(f"{len(named)} optimizer states for this run's {len(optimizers)} optimizers")
        model = state["model"]
        if self.eplb is not None:
            self.eplb.load_plan(state.get("eplb"))
            model = self.eplb.physical_model_state(model)
        for st in self.stages:
            own = st.state_dict()
            missing = sorted(set(own) - set(model))
            if missing:
                raise ValueError(f"checkpoint model state lacks {len(missing)} tensors of stage {st.stage_id}, "
                                 f"e.g. {missing[:3]}")
            st.load_state_dict({k: model[k] for k in own}, strict=True)
        names = self.param_names()
        for opt, saved in zip(optimizers, named):
            load_named_optimizer_state(opt, names, saved)
        if self.eplb is not None:  # saved moments are logical: into this plan's slots
            self.eplb.optimizer_state_from_logical()
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        self.step = int(state["trainer"]["step"])
        self.tokens_seen = int(state["trainer"]["tokens_seen"])

    def checkpoint_meta(self) -> dict[str, Any]:
        """Global information the checkpoint manager stores beside the shards."""
        par = self.cfg.parallel
        return {"tokens_seen": self.tokens_seen, "config": numerics_dict(self.cfg), "full_config": self.cfg.to_dict(),
                "layout": {"pp": par.pp, "dp": par.dp, "ep": par.ep, "cp": par.cp, "schedule": par.schedule,
                           "vpp": par.vpp,
                           "world_size": self.ps.world_size}}

    # ---- one step ---------------------------------------------------------------------------------
    def _forward_backward(self, windows: torch.Tensor, chunks: int, mtp_lambda: float) -> StageLoss | None:
        """Run every micro-batch's forward and backward; the gradients end as the micro-batches' mean.

        Returns the step's criterion (its ``parts``: each micro-batch's losses) on ranks holding the loss.
        """
        last = self.loss_stage
        inject = self._nan_injection_due()
        criterion = StageLoss(last, mtp_lambda, inject) if last is not None else None
        if self.pipeline is not None:
            self.pipeline.step(windows, chunks, criterion)
        else:
            stage = self.stages[0]
            for i, mb in enumerate(windows.chunk(chunks)):
                with self._span(f"0F{i}"), self._autocast():
                    loss = criterion(stage(self._local(mb[:, :-1])), mb)
                with self._span(f"0B{i}"):
                    loss.backward()
        scale_grads(self.modules, 1.0 / chunks)  # every loss (main, MTP, balance) entered backward unscaled
        return criterion

    def _local(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's rows of whole sequences ``tokens [b, seq_len]``: all of them, or its CP chunks."""
        return tokens if self.cp is None else self.cp.split(tokens)

    def _nan_injection_due(self) -> bool:
        """``fault.inject_nan_at_step``: True the first time this process runs that step (so a rollback replays
        it healthy, as after a transient fault); every rank decides alike."""
        at = self.cfg.fault.inject_nan_at_step
        if not at or self.step + 1 != at or self._nan_injected:
            return False
        self._nan_injected = True
        return True

    def _span(self, name: str) -> contextlib.AbstractContextManager:
        """An action of the flight recorder and, when tracing, a compute span of the ``--trace`` timeline (named
        like the pipeline's actions)."""
        stack = contextlib.ExitStack()
        if self.recorder is not None:
            stack.enter_context(self.recorder.span("compute", name))
        stack.enter_context(self.flight.record("action", name))
        return stack

    def _compiling(self) -> contextlib.AbstractContextManager:
        """Dynamo's settings for the training step's compiled modules (``run.compile``)."""
        return tracing() if self.cfg.run.compile else contextlib.nullcontext()

    def _eager(self) -> contextlib.AbstractContextManager:
        """No-grad passes (evaluation, sampling, the FP8 shadow) run the compiled modules eager (``run.compile``)."""
        return eager() if self.cfg.run.compile else contextlib.nullcontext()

    def _autocast(self) -> contextlib.AbstractContextManager:
        if accel.backend() != "cpu" and self.cfg.run.autocast_bf16 and self.dtype != torch.float64:
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _global_mean(self, value: float, count: int, group: dist.ProcessGroup | None = None) -> float:
        """Mean of ``value`` over the ranks that hold it (``count`` = 1 on holders, 0 elsewhere)."""
        if self.ps.world_size == 1:
            return value if count else float("nan")
        t = torch.tensor([value * count, float(count)], dtype=torch.float64)
        with record_collective(self.flight, "loss mean", "world" if group is None else "group", group, 16):
            dist.all_reduce(t, group=group)
            return float(t[0] / t[1]) if t[1] > 0 else float("nan")  # the host read waits for the all-reduce

    def train_step(self) -> dict[str, Any]:
        cfg, step = self.cfg, self.step
        self.flight.step = step
        t0 = time.perf_counter()
        point = self.schedule.at(step, self.tokens_seen)  # the step's values, by steps and tokens seen before it
        lr = self.lr_scheduler.step(step, self.tokens_seen)
        global_batch = point.global_batch
        chunks = global_batch // (cfg.parallel.dp * cfg.data.micro_batch)
        ids = self.sampler.next_batch(global_batch)
        windows = torch.stack([self.corpus.window(i) for i in ids]).to(self.device)
        self.optimizer.zero_grad()
        if self.fp8_health is not None:
            self.fp8_health.active = (step + 1) % cfg.logging.fp8_health_every == 0
        with unchecked_scale_values(), self._compiling():  # FP8: a NaN must reach the loss / gradient norm
            criterion = self._forward_backward(windows, chunks, point.mtp_lambda)
        reduce_gradients(self.optimizer, self.ps.group("dp"), self.ps.group("edp"), cfg.parallel.dp, self.flight)
        grad_sync_s = None
        if self.eplb is not None:  # replicas of one expert take the same (summed) step
            t_sync = time.perf_counter()
            self.eplb.sync_grads()
            grad_sync_s = time.perf_counter() - t_sync
        # (dense gradients are replicated on the cp x dp ranks of a stage, experts on cp x dp / ep)
        grad_norm = clip_grad_norm(self.optimizer, cfg.optim.clip_grad, cfg.parallel.cp * cfg.parallel.dp,
                                   cfg.parallel.ep,
                                   stage_copies=cfg.parallel.layout.copies,
                                   expert_row_weights=self.eplb.norm_weights() if self.eplb is not None else None,
                                   flight=self.flight)
        parts = {name: criterion.mean(name) if criterion is not None and self.holds_loss else None
                 for name in ("total", "main", "mtp")}
        # each CP rank's losses are its share of its sequences' (they sum to the loss over the CP group)
        loss, main, mtp = (cfg.parallel.cp * self._global_mean(v or 0.0, 0 if v is None else 1)
                           for v in parts.values())
        metrics: dict[str, Any] = {"loss": main, "total_loss": loss, "grad_norm": grad_norm,
                                   "lr": lr, "global_batch": global_batch,
                                   "microbatches": chunks, "mtp_lambda": point.mtp_lambda,
                                   "bias_update_speed": point.bias_update_speed}
        if not math.isnan(mtp):
            metrics["mtp_loss"] = mtp
        if grad_sync_s is not None:
            metrics["eplb_grad_sync_s"] = grad_sync_s
        metrics.update(self._fp8_checks(windows.chunk(chunks)[0]))
        apply = all(hook(self, metrics) is not False for hook in self.after_backward_hooks)
        if apply:
            self.optimizer.step()
            update_biases(self.stages, cfg, self.ps, self.args, gamma=point.bias_update_speed, device=self.device)
        else:
            metrics["skipped"] = 1
        if self.eplb is not None:  # between steps: re-plan from the measured loads, move experts and moments
            metrics.update(self.eplb.after_step(step + 1))
        metrics.update(self._load_metrics())
        if self.args.index_topk:
            metrics.update(indexer_metrics(self.stages, self.ps, self.device))
        tokens = global_batch * cfg.data.seq_len
        self.tokens_seen += tokens
        self.step += 1
        dt = time.perf_counter() - t0
        metrics.update(tokens_seen=self.tokens_seen, step_time_s=dt, tokens_per_s=tokens / dt)
        for hook in self.step_end_hooks:
            hook(self, metrics)
        return metrics

    # ---- FP8 health and the BF16 shadow ------------------------------------------------------------
    def _fp8_checks(self, micro_batch: torch.Tensor) -> dict[str, Any]:
        """This step's FP8 health report and BF16 shadow check, where due (every rank calls it)."""
        out: dict[str, Any] = {}
        if self.fp8_health is not None and self.fp8_health.active:
            self.fp8_health.active = False
            counts = [self.fp8_health.counts()]
            if self.ps.world_size > 1:
                gathered = [None] * self.ps.world_size if self.ps.rank == 0 else None
                dist.gather_object(counts[0], gathered, dst=0)
                counts = gathered or []
            if self.ps.rank == 0:
                health, warnings = fp8_health_metrics(merge_counts(counts), self.step + 1,
                                                      self.cfg.logging.fp8_underflow_warn, self._fp8_warned)
                out.update(health)
                for line in warnings:
                    log.warning(line)
        if self.fp8_shadow is not None and (self.step + 1) % self.cfg.fault.fp8_shadow_every == 0:
            out.update(self._fp8_shadow_check(micro_batch))
        return out

    def _fp8_shadow_check(self, micro_batch: torch.Tensor) -> dict[str, Any]:
        """``micro_batch``'s main loss with FP8 and with every FP8 layer in BF16, at this step's weights; on a
        sustained gap the blocks to blame, and with ``fault.fp8_shadow_action = "bf16"`` the fault flag and the
        switch of those blocks to BF16 (the checkpoint hooks roll back on the flag)."""
        layers = fp8_modules(self.stages)
        fp8_loss = self._main_loss(micro_batch)
        with fp8_disabled(list(layers.values())):
            bf16_loss = self._main_loss(micro_batch)
        gap = fp8_loss / bf16_loss - 1.0
        out: dict[str, Any] = {"fp8_shadow_gap": gap}
        if not self.fp8_shadow.add(gap):
            return out

        def gap_without(blocks: list[str]) -> float:
            with fp8_disabled([m for name, m in layers.items() if block_of(name) in blocks]):
                return self._main_loss(micro_batch) / bf16_loss - 1.0

        f = self.cfg.fault
        blocks = [f"layers.{i}" for i in range(self.args.n_layers) if f"layers.{i}" not in self.fp8_bf16_blocks]
        blame = blame_layers(blocks, gap_without, f.fp8_shadow_threshold)
        if self.ps.rank == 0:
            log.warning("FP8 shadow at step %d: loss gap %+.3f%% to BF16 on the same micro-batch, above %.3f%% in "
                        "%d checks in a row; FP8 GEMMs of %s make it; action %s (fault.fp8_shadow_action)",
                        self.step + 1, gap * 100, f.fp8_shadow_threshold * 100, f.fp8_shadow_patience,
                        ", ".join(blame), f.fp8_shadow_action)
        out["fp8_shadow_blame"] = blame
        if f.fp8_shadow_action == "bf16":
            for name, m in layers.items():
                if block_of(name) in blame:
                    m.fp8 = False
            self.fp8_bf16_blocks += blame
            out["fp8_shadow_fault"] = 1
        return out

    @torch.no_grad()
    def _main_loss(self, windows: torch.Tensor) -> float:
        """Mean next-token loss of ``windows [b, s + 1]`` (one per data-parallel rank) through the pipeline."""
        with self._autocast(), self._eager():
            h = pipeline_hidden(self.stages, self.cfg.parallel, self.ps, self._local(windows[:, :-1]), self.dtype)
            loss = None
            if h is not None:  # (under CP: this rank's chunks, as many tokens as every other CP rank's)
                st = self.loss_stage
                loss = float(F.cross_entropy(st.logits(h).flatten(0, 1).float(),
                                             self._local(windows[:, 1:]).flatten()))
        return self._global_mean(loss or 0.0, 0 if loss is None else 1)

    def _inject_fp8_scale_error(self, name: str, at_step: int) -> None:
        """``fault.inject_fp8_scale_error_*``: from ``at_step`` on, ``name``'s FP8 forward output is 16x too large."""
        if not hasattr(dict(self.model.named_modules()).get(name), "fp8"):
            raise ValueError(f"fault.inject_fp8_scale_error_layer={name!r} is not an FP8 layer of the model "
                             "(e.g. layers.1.attn.wq_b)")

        def scale_error(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
            return out * 16 if module.fp8 and self.step + 1 >= at_step else None

        for st in self.stages:
            module = dict(st.named_modules()).get(name)
            if module is not None:
                module.register_forward_hook(scale_error)
                break

    def _load_metrics(self) -> dict[str, Any]:
        return load_metrics(self.stages, self.cfg, self.ps, self.args, self.device)

    # ---- evaluation and sampling -------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, batches: int) -> float:
        """Mean validation loss (main next-token loss) over ``batches`` held-out batches."""
        if self.corpus.num_valid == 0:
            return float("nan")
        size = self.cfg.data.micro_batch
        total, n = 0.0, 0
        for b in range(batches):
            inputs, labels = self.corpus.valid_batch(b * self.cfg.parallel.dp + self.ps.coords.dp_rank, size)
            with self._eager():
                h = pipeline_hidden(self.stages, self.cfg.parallel, self.ps, self._local(inputs.to(self.device)),
                                    self.dtype)
                if h is not None:  # (under CP: this rank's chunks, as many tokens as every other CP rank's)
                    st = self.loss_stage
                    logits = st.logits(h)
                    total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                                     self._local(labels.to(self.device)).flatten()))
                    n += 1
        return self._global_mean(total / max(n, 1), 1 if n else 0)

    @torch.no_grad()
    def generate(self, prompt: str, max_new_tokens: int) -> str:
        """Continuation of ``prompt`` through the pipeline (every rank must call it), sampled at
        ``run.sample_temperature`` (0 = greedy)."""
        with self._eager():
            return pipeline_generate(self.stages, self.cfg.parallel, self.ps, self.tokenizer, self.corpus, prompt,
                                     max_new_tokens, self.cfg.data.seq_len, self.dtype, self.device,
                                     temperature=self.cfg.run.sample_temperature, seed=self.cfg.run.seed)

    # ---- the loop -----------------------------------------------------------------------------------
    def start_logging(self, total_steps: int) -> None:
        if self.ps.rank != 0:
            return
        counts = self.args.param_counts()
        fpt = model_flops_per_token(counts["activated"], self.args.n_layers, self.args.n_heads,
                                    self.args.qk_head_dim, self.args.v_head_dim, self.cfg.data.seq_len)
        self.logger = MetricsLogger(self.run_dir, total_steps, self.step, self.cfg.to_dict(), self.wandb_mode,
                                    self.cfg.logging.wandb_project, self.cfg.run.name, self.cfg.logging.progress,
                                    flops_per_token=fpt, fp8=self.cfg.model.fp8)

    def fit(self) -> dict[str, Any]:
        """Train to ``run.steps``, or until ``preemption`` stops every rank (then ``stopped`` says why and when);
        returns the summary (on every rank; rank 0 also writes it)."""
        cfg = self.cfg
        self.start_logging(cfg.run.steps)
        t_start, first_loss, last = time.perf_counter(), None, {}
        start_step = self.step
        while self.step < cfg.run.steps:
            t_step = time.perf_counter()
            last = self.train_step()
            if first_loss is None:
                first_loss = last["loss"]
            if cfg.logging.eval_every and self.step % cfg.logging.eval_every == 0:
                last["valid_loss"] = self.evaluate(cfg.logging.eval_batches)
            if self.step % cfg.logging.log_every == 0 or self.step == cfg.run.steps:
                self.logger.log(self.step, {k: v for k, v in last.items()})
            self.history.append({"step": self.step, **{k: v for k, v in last.items() if isinstance(v, (int, float))}})
            if self.preemption is not None:  # one tiny all-reduce per step: every rank stops after the same step
                self.stopped = self.preemption.check(self.step, cfg.run.steps, time.perf_counter() - t_step,
                                                     self.ps.world_size, self.device)
                if self.stopped is not None:
                    break
        summary = {"steps": self.step, "steps_this_run": self.step - start_step,
                   "first_loss": first_loss, "final_loss": last.get("loss"),
                   "final_mtp_loss": last.get("mtp_loss"), "tokens_seen": self.tokens_seen,
                   "wall_time_s": time.perf_counter() - t_start}
        if self.stopped is None:  # a stopping job spends its last seconds on the checkpoint
            summary["valid_loss"] = self.evaluate(cfg.logging.eval_batches)
        return summary
