"""Training configuration: TOML files, ``--set key=value`` overrides, validation that names the key.

A config is a tree of dataclasses, one per TOML table (``[run]``, ``[model]``, ``[parallel]``, ``[data]``,
``[optim]``, ``[balance]``, ``[eplb]``, ``[logging]``, ``[checkpoint]``, ``[fault]``, ``[schedule]``). Loading
rejects unknown keys and wrong types with a ``ValueError`` that names the dotted key (and the
nearest known key, for typos), so a bad config fails on the laptop that launches the job, before
any process group exists. ``numerics_dict`` is everything that changes the numerics; checkpoints
store it with its hash (``training.checkpoint.format.config_hash``), so a resume under a different
model or data setup is refused.

Layout rule (as DeepSeek-V3): world = pp x cp x dp; expert parallelism spans ``ep`` of the cp x dp ranks
of the same pipeline stage (as Megatron-Core), so ``ep`` divides ``cp x dp`` and there are ``cp x dp / ep``
replicas of each expert shard. ``cp`` (context parallelism: ranks sharing each sequence) is 1 unless a long-context
config sets it; the planner, the memory model and the dry run know it, the trainer does not run it yet.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - python 3.10
    import tomli as tomllib

from deep_gemm.linear import EXPERT_WEIGHT_FORMATS, FP8_RECIPES
from dualpipe import schedules
from dualpipe.ir import Layout
from dualpipe.schedules import check_sizes, check_vpp
from models.deepseek_v3.args import INDEXER_QK_FORMATS
from models.deepseek_v3.balancing import BalanceConfig  # [balance]: the model's own class, validated on build
from training.schedule import Schedule, parse_curve

OPTIMIZERS = ("adamw", "muon", "sgd")
MUON_ADJUST_LR = ("match_rms_adamw", "original")
MOMENT_DTYPES = ("param", "bfloat16")
MASTER_DTYPES = ("param", "float32")
SCHEDULES = ("none", *schedules.SCHEDULES)
FP8_SHADOW_ACTIONS = ("bf16", "warn")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")  # torch.compile backends run.compile_backend may name
INT64 = 1 << 63
# run.steps at most 10^9 - 1: checkpoint folders are named step_NNNNNNNNN with nine digits, so that a listing sorts
# them by step; no run comes near (V3's 14.8T tokens: 235,000 steps, recipes/configs/deepseek_v3_671b.toml)
MAX_STEPS = 10**9 - 1


def pipeline_layout(schedule: str, pp: int, vpp: int = 1) -> Layout:
    """Where ``parallel.schedule`` puts the model's parts (stages) on ``pp`` pipeline ranks (``vpp`` model chunks
    each under ``interleaved1f1b``): the schedule IR's layout (``dualpipe.schedules.layout``); ``none`` is one rank
    holding the whole model."""
    return schedules.layout("1f1b" if schedule == "none" else schedule, pp, vpp)


@dataclass
class RunConfig:
    name: str = "run"
    seed: int = 1234
    steps: int = 100
    nproc: int = 1  # world size that `--nproc` defaults to (single machine)
    dtype: str = "float32"  # the parameters (master weights unless optim.master_dtype) and, on CPU, compute:
    # float32 | float64 | bfloat16
    autocast_bf16: bool = True  # bf16 autocast on GPU (ignored on CPU)
    runs_root: str = "runs"
    sample_prompt: str = "The "  # prompt of the generated sample printed at the end ("" = none)
    sample_tokens: int = 120
    sample_temperature: float = 0.8  # 0 = greedy (a small byte model's greedy output loops on spaces)
    threads: int = 0  # torch CPU threads per process; 0 = cores / local processes (OMP_NUM_THREADS wins)
    timeout_s: float = 300.0  # collective timeout; a stalled rank fails with its rank and step named
    max_minutes: float = 0.0  # time budget: save and stop cleanly before this many minutes (0 = none)
    # seconds without a completed pipeline action or collective after which every rank dumps its flight recorder
    # to RUN_DIR/flight/ (python -m recipes.diagnose RUN_DIR); below timeout_s, so it dumps first; 0 = off
    watchdog_s: float = 60.0
    # torch.compile(fullgraph=True) of each block from outside (training.compile), on every schedule; training only
    compile: bool = False
    compile_backend: str = "inductor"  # inductor | aot_eager (dynamo + AOTAutograd, no code generation) | eager


@dataclass
class ModelConfig:
    preset: str = "debug_tiny"
    fp8: bool = False  # route attention projections and experts through deep_gemm's FP8 layers
    fused_ops: bool = True  # memory-bound steps as fused_ops' Triton kernels on a GPU; false: the unfused torch ops
    # with fp8: "blockwise" (DeepSeek-V3: 1x128 activations, 128x128 weights, fp32 scales) or "mxfp8" (1x32 blocks
    # with power-of-two scales for activations, weights and gradients, as Megatron-Core / torchtitan on Blackwell)
    fp8_recipe: str = "blockwise"
    # the routed experts' weights in their GEMMs: bf16 (as stored), fp8 (V3's FP8 GEMM; needs fp8) or mxfp4_qat
    # (quantisation-aware training in MXFP4, E2M1 + an E8M0 scale per 32, as DeepSeek-V4; with fp8, the blockwise
    # recipe's forward is the FP8 x MXFP4 grouped GEMM, MXFP8's GEMMs take the FP4 weight exactly)
    expert_weight_format: str = "bf16"
    # the V3.2 lightning indexer's q . k scoring: auto (fp8 with model.fp8, else bf16), bf16, fp8 (Hadamard-rotated
    # e4m3 q and k for the selection, V3.2's release) or mxfp4_hadamard (V4's QAT: Hadamard rotation, then FP4 per 32
    # with power-of-two scales, straight-through; the selection and the indexer loss both see it)
    indexer_qk_format: str = "auto"
    mtp_lambda: float = 0.3  # weight of the MTP loss (V3: 0.3 for the first 10T tokens, then 0.1)
    mtp_lambda_late: float = 0.3
    mtp_lambda_switch_step: int = 0  # step at which mtp_lambda becomes mtp_lambda_late (0 = never)
    overrides: dict[str, Any] = field(default_factory=dict)  # ModelArgs fields to change from the preset
    # an HF config.json (or a folder holding one) whose architecture replaces the preset's: DeepSeek-V3 / V3.2, or
    # V4 (model_type "deepseek_v4"); the overrides apply on top ("" = the preset)
    hf_config: str = ""
    # an HF checkpoint folder the run's weights start from ("" = the seeded init); a DeepSeek-V3 one starts a
    # V3.2 model (index_topk > 0) with a freshly initialised indexer. A resumed run reads its own checkpoint.
    init_from: str = ""


@dataclass
class ParallelConfig:
    pp: int = 1
    dp: int = 1
    ep: int = 1
    # context parallelism: ranks sharing each sequence (2 x cp chunks, rank r holding r and 2cp-1-r); planned and
    # dry-run, not yet executed by the trainer (recipes.train refuses cp > 1 outside --dry-run)
    cp: int = 1
    schedule: str = "none"  # none (no pipeline) | 1f1b | interleaved1f1b | zb1p | zbv | dualpipe | dualpipev
    vpp: int = 1  # model chunks per pipeline rank (Megatron's virtual pipeline size): >= 2 with interleaved1f1b only
    overlap: bool = True  # use the stage's overlapped_forward_backward where the schedule pairs F and B
    zero1: bool = True  # shard optimizer states over data-parallel ranks (ZeroRedundancyOptimizer)

    @property
    def world_size(self) -> int:
        return self.pp * self.cp * self.dp

    @property
    def layout(self) -> Layout:
        return pipeline_layout(self.schedule, self.pp, self.vpp)

    @property
    def num_stages(self) -> int:
        """The model parts (``training.stages``) the schedule cuts the model into."""
        return self.layout.num_parts


@dataclass
class DataConfig:
    source: str = "bundled"  # "bundled" | a text file | a .bin/.npy shard | a folder or glob of shards
    tokenizer: str = "byte"  # "byte" | path to a Hugging Face tokenizer.json
    bin_dtype: str = "uint16"  # element type of raw .bin shards
    seq_len: int = 128
    global_batch: int = 16  # sequences per optimizer step, all data-parallel ranks together
    micro_batch: int = 2  # sequences per micro-batch per data-parallel rank
    batch_ramp_start: int = 0  # 0 = no ramp; else the global batch ramps from this value ...
    batch_ramp_steps: int = 0  # ... to global_batch over this many steps (V3 ramps over 469B tokens)
    valid_fraction: float = 0.01  # tail of the corpus held out for the validation loss


@dataclass
class OptimConfig:
    lr: float = 2.2e-4
    min_lr: float = 2.2e-5
    warmup_steps: int = 2000
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_grad: float = 1.0  # 0 = no clipping
    name: str = "adamw"  # adamw | muon (hidden matrices; AdamW for the rest) | sgd (momentum = betas[0]; one moment)
    # Muon's group (optim.name = "muon"); lr, weight_decay, betas, eps above are the AdamW group's (docs/muon.md)
    muon_lr: float = 2.2e-4
    muon_weight_decay: float = 0.1
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5  # Newton-Schulz iterations
    # match_rms_adamw: step x update_rms x sqrt(max(rows, cols)) (Moonlight 0.2; V4 reports 0.18) | original
    muon_adjust_lr: str = "match_rms_adamw"
    muon_update_rms: float = 0.2
    moments_dtype: str = "param"  # param (the master weights' dtype) | bfloat16 (V3: AdamW moments in BF16)
    # param: the parameters are the master weights | float32: with run.dtype = "bfloat16", BF16 working weights,
    # an FP32 master copy in the (ZeRO-1 sharded) optimizer state and FP32 gradient accumulation (V3)
    master_dtype: str = "param"
    ema_decay: float = 0.0  # > 0: keep an EMA of the parameters in host memory, updated asynchronously (V3)


@dataclass
class EplbConfig:
    """Expert-parallel load balancing in the training runtime (``training/eplb.py``).

    Each EP rank hosts ``(n_routed_experts + redundant_experts) / parallel.ep`` physical expert slots;
    every ``interval`` optimizer steps the plan is recomputed from a moving average of the measured
    loads (deepseek-ai/EPLB's policy) and the weights and optimizer moments move between steps.
    """

    enabled: bool = False
    redundant_experts: int = 0  # extra physical slots per MoE layer (V3 serving: 32 over 256 experts)
    interval: int = 10  # optimizer steps between re-plans
    ema_decay: float = 0.9  # moving average of the per-interval loads the plans are made from
    num_groups: int = 0  # 0 = the model's n_expert_groups (hierarchical policy when groups divide over nodes)
    num_nodes: int = 0  # 0 = balance.num_nodes (nodes the EP group spans)


@dataclass
class LoggingConfig:
    wandb: str = "offline"  # offline | online | disabled; WANDB_MODE wins unless --wandb is given
    wandb_project: str = "dsv3-toolkit"
    progress: bool = True
    log_every: int = 1
    eval_every: int = 0  # 0 = only at the end
    eval_batches: int = 4  # held-out batches of the validation loss (0 = none)
    plot: bool = True
    # FP8 health (deep_gemm.health, with model.fp8, MXFP4 QAT experts or the indexer's mxfp4_hadamard): every N
    # steps each FP8 GEMM's e4m3 (each FP4 cast's E2M1) underflow, subnormals and tile amax range go to
    # metrics.jsonl (per layer) and wandb (maxima); 0 = off. A warning names the layer and GEMM whose share of
    # nonzero values rounding to 0 exceeds fp8_underflow_warn.
    fp8_health_every: int = 10
    fp8_underflow_warn: float = 0.01


@dataclass
class CheckpointConfig:
    interval: int = 0  # steps between saves; 0 = only the final one when `final` is true
    async_save: bool = True
    keep_last: int = 2
    keep_every: int = 0  # also keep every n-th step's checkpoint (0 = none)
    final: bool = True
    write_delay_s: float = 0.0  # test only: pause halfway through each shard file (the kill -9 trials land there)


@dataclass
class FaultConfig:
    """The NaN / loss-spike guard (``training/fault.py``), on by default: a faulty step's update is skipped,
    no non-finite state is ever committed, and the run rolls back to the last stable checkpoint, or stops
    (exit status 4) with one line when there is none yet or ``max_retries`` rollbacks made no progress."""

    enabled: bool = True
    spike_sigma: float = 6.0  # a loss this many standard deviations above the moving window is a spike
    window: int = 50
    stable_after: int = 20  # healthy steps after which a committed checkpoint becomes stable (a rollback target)
    max_retries: int = 3
    inject_nan_at_step: int = 0  # check the guard: step N's loss is made NaN, once per process (0 = never)
    # BF16 shadow (with model.fp8): every N steps micro-batch 0's loss is computed again with FP8 off and the
    # relative gap logged (0 = off: it costs two forwards of one micro-batch per check, docs/fp8.md). A gap above
    # fp8_shadow_threshold in fp8_shadow_patience checks in a row is a fault: "warn" logs it and the layers to
    # blame; "bf16" also rolls back as for a NaN and continues with those layers' GEMMs in BF16.
    fp8_shadow_every: int = 0
    fp8_shadow_threshold: float = 0.0025
    fp8_shadow_patience: int = 3
    fp8_shadow_action: str = "bf16"
    # check the shadow: from this step on, the named FP8 module's forward output is 16x too large, as from a
    # dequantization scale off by 16x (a module called as a module, e.g. layers.1.attn.wq_b; 0 = never)
    inject_fp8_scale_error_at_step: int = 0
    inject_fp8_scale_error_layer: str = ""


@dataclass
class ScheduleConfig:
    """Stage lists (``[[schedule.lr]]`` ...; ``training/schedule.py`` describes a stage) for the scheduled
    quantities. An empty list keeps that quantity's older keys: ``optim.lr``, ``optim.warmup_steps`` and
    ``optim.min_lr`` (warm-up, then cosine over ``run.steps``); ``data.global_batch`` with
    ``data.batch_ramp_start`` / ``data.batch_ramp_steps``; ``model.mtp_lambda`` / ``model.mtp_lambda_late`` /
    ``model.mtp_lambda_switch_step``; ``balance.gamma`` / ``balance.gamma_stop_step``. A stage list replaces those
    keys, and giving both is an error."""

    lr: list[dict[str, Any]] = field(default_factory=list)
    global_batch: list[dict[str, Any]] = field(default_factory=list)  # sequences; at most data.global_batch
    mtp_lambda: list[dict[str, Any]] = field(default_factory=list)
    bias_update_speed: list[dict[str, Any]] = field(default_factory=list)  # the aux-loss-free bias update gamma


# the older keys each stage list replaces (giving both is refused when the config is loaded)
SCHEDULE_REPLACES = {"lr": ("optim.lr", "optim.min_lr", "optim.warmup_steps"),
                     "global_batch": ("data.batch_ramp_start", "data.batch_ramp_steps"),
                     "mtp_lambda": ("model.mtp_lambda", "model.mtp_lambda_late", "model.mtp_lambda_switch_step"),
                     "bias_update_speed": ("balance.gamma", "balance.gamma_stop_step")}


@dataclass
class TrainConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    eplb: EplbConfig = field(default_factory=EplbConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)

    # -- derived quantities --------------------------------------------------------------------
    def global_batch_at(self, step: int) -> int:
        """Sequences in the optimizer step ``step`` (0-based) of a run that followed the schedule from step 0."""
        return schedule_of(self).batch_at(step)

    def microbatches_at(self, step: int) -> int:
        """Micro-batches per data-parallel rank in optimizer step ``step`` (the pipeline's num_chunks)."""
        return self.global_batch_at(step) // (self.parallel.dp * self.data.micro_batch)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        return dump_toml(self.to_dict())


# ---- loading and overrides ---------------------------------------------------------------------

def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """``value`` as type ``tp`` (int -> float allowed, list -> tuple), else a ValueError naming ``key``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(key, value, arg)
            except ValueError:
                continue
        raise ValueError(f"config key '{key}': expected {tp}, got {value!r}")
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ValueError(f"config key '{key}': expected a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args)))
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"config key '{key}': expected a list, got {value!r}")
        (arg,) = typing.get_args(tp)
        return [_coerce(f"{key}[{i}]", v, arg) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"config key '{key}': expected a table, got {value!r}")
        return dict(value)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"config key '{key}': expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"config key '{key}': expected an integer, got {value!r}")
        if not -INT64 <= value < INT64:  # checkpoints, metrics and torch tensors hold 64-bit integers
            raise ValueError(f"config key '{key}': expected a 64-bit integer, got {value}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"config key '{key}': expected true or false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"config key '{key}': expected a string, got {value!r}")
        return value
    if tp is Any:
        return value
    raise ValueError(f"config key '{key}': unsupported type {_type_name(tp)}")


def _build(cls: type, table: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in table.items():
        dotted = f"{prefix}{key}"
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; known keys: {', '.join(names)}"
            raise ValueError(f"unknown config key '{dotted}'{hint}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ValueError(f"config key '{dotted}' must be a table [{dotted}], got {value!r}")
            kwargs[key] = _build(tp, value, f"{dotted}.")
        else:
            kwargs[key] = _coerce(dotted, value, tp)
    try:
        return cls(**kwargs)
    except ValueError as exc:  # a table's own checks (``[balance]`` is the model's BalanceConfig)
        raise ValueError(f"config table [{prefix.rstrip('.')}]: {exc}") from None


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"optim.lr=3e-4"`` -> (["optim", "lr"], 3e-4); the value is read as TOML, else as a bare string."""
    if "=" not in item:
        raise ValueError(f"--set expects key=value (e.g. optim.lr=3e-4), got {item!r}")
    key, raw = item.split("=", 1)
    key, raw = key.strip(), raw.strip()
    if not key:
        raise ValueError(f"--set {item!r}: empty key")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.split("."), value


def apply_overrides(table: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """A copy of the raw TOML ``table`` with each ``key=value`` set (``model.overrides.x=1`` nests)."""
    table = json.loads(json.dumps(table))
    for item in overrides:
        path, value = parse_override(item)
        node = table
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {item!r}: '{part}' is not a table")
        node[path[-1]] = value
    return table


def load_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    """Read a TOML config (or the defaults when ``path`` is None), apply overrides, validate."""
    table: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if path.is_dir():
            raise ValueError(f"--config {str(path)!r} is a folder; expected a TOML file")
        if not path.is_file():
            raise ValueError(f"--config: no such file {str(path)!r}")
        try:
            table = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"--config {str(path)!r}: not valid TOML: {exc}") from None
        except UnicodeDecodeError as exc:
            raise ValueError(f"--config {str(path)!r}: not UTF-8 text ({exc.reason} at byte {exc.start}); "
                             "expected a TOML file") from None
        try:  # the file's own unknown keys and wrong types, named with the file
            _build(TrainConfig, table, "")
        except ValueError as exc:
            raise ValueError(f"--config {str(path)!r}: {exc}") from None
    table = apply_overrides(table, list(overrides))
    check_schedule_keys(table)
    cfg = _build(TrainConfig, table, "")
    validate(cfg)
    return cfg


def check_schedule_keys(table: dict[str, Any]) -> None:
    """ValueError when a ``[[schedule.X]]`` stage list and a key it replaces (``SCHEDULE_REPLACES``) are both set to
    something (a key at its default value, as a written-out config holds every key, is not a second statement)."""
    stages = table.get("schedule", {})
    if not isinstance(stages, dict):
        return  # _build names the wrong type
    classes = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
    hints = {name: typing.get_type_hints(TrainConfig)[name] for name in classes}
    for quantity, keys in SCHEDULE_REPLACES.items():
        if not stages.get(quantity):
            continue
        for dotted in keys:
            section, key = dotted.split(".")
            values = table.get(section)
            if isinstance(values, dict) and key in values and values[key] != getattr(hints[section](), key):
                raise ValueError(f"config key '{dotted}' and schedule.{quantity} both set: the stage list replaces "
                                 f"{', '.join(keys)}; state the schedule in one place")


def schedule_of(cfg: TrainConfig) -> Schedule:
    """The run's ``training.schedule.Schedule``: the ``[schedule]`` stage lists, or for each empty one the curve
    its older keys define (``ScheduleConfig``); a ValueError naming the key for a bad stage."""
    o, d, m, b, p, sc = cfg.optim, cfg.data, cfg.model, cfg.balance, cfg.parallel, cfg.schedule
    unit = p.dp * d.micro_batch
    min_batch = unit * min_microbatches(p)
    lr = sc.lr
    if not lr:  # linear warm-up: lr / warmup at step 0, lr at step warmup - 1; then cosine to min_lr at run.steps
        w = o.warmup_steps
        lr = [{"shape": "linear", "from": o.lr / w, "value": o.lr, "steps": w - 1}] if w > 1 else []
        lr += [{"value": o.lr, "until_steps": w}] if w >= 1 else []
        if cfg.run.steps > w:
            lr += [{"shape": "cosine", "from": o.lr, "value": o.min_lr, "until_steps": cfg.run.steps},
                   {"value": o.min_lr}]
        else:
            lr += [{"value": o.lr}]
    batch = sc.global_batch
    if not batch:
        batch = [{"value": d.global_batch}]
        if d.batch_ramp_start > 0 and d.batch_ramp_steps > 0:
            batch = [{"shape": "linear", "from": d.batch_ramp_start, "value": d.global_batch,
                      "steps": d.batch_ramp_steps}, *batch]
    mtp = sc.mtp_lambda or ([{"value": m.mtp_lambda, "until_steps": m.mtp_lambda_switch_step},
                             {"value": m.mtp_lambda_late}] if m.mtp_lambda_switch_step else [{"value": m.mtp_lambda}])
    bias = sc.bias_update_speed or ([{"value": b.gamma, "until_steps": b.gamma_stop_step}, {"value": 0.0}]
                                    if b.gamma_stop_step else [{"value": b.gamma}])
    return Schedule(parse_curve("schedule.lr", lr), parse_curve("schedule.global_batch", batch, 1, d.global_batch),
                    parse_curve("schedule.mtp_lambda", mtp), parse_curve("schedule.bias_update_speed", bias),
                    seq_len=d.seq_len, batch_multiple=unit * (2 if p.schedule == "dualpipe" else 1),
                    min_batch=min_batch)


# ---- validation ----------------------------------------------------------------------------

def min_microbatches(par: ParallelConfig) -> int:
    """The fewest micro-batches per step the schedule accepts (DualPipe README rules)."""
    return 1 if par.schedule == "none" else schedules.min_microbatches(par.schedule, par.pp)


def check_microbatches(par: ParallelConfig, num_chunks: int, where: str) -> None:
    """ValueError unless ``num_chunks`` micro-batches suit the schedule (``where`` names the source)."""
    if par.schedule == "none":
        return
    try:
        check_sizes(par.schedule, par.pp, num_chunks, par.vpp)
    except ValueError as exc:
        raise ValueError(f"{where}: {num_chunks} micro-batches per step (global_batch / (dp x micro_batch)) do not "
                         f"suit parallel.schedule={par.schedule!r} with parallel.pp={par.pp}: {exc}; change "
                         "data.global_batch or data.micro_batch") from None


def check_finite(node: Any, prefix: str = "") -> None:
    """ValueError naming the first float option (at any depth, ``model.overrides`` and ``optim.betas`` included)
    that is NaN or infinite: no option of the training config means anything when it is not finite."""
    if isinstance(node, float):
        if not math.isfinite(node):
            raise ValueError(f"config key '{prefix}' must be a finite number, got {node}")
        return
    if dataclasses.is_dataclass(node):
        items = ((f"{prefix}.{k}" if prefix else k, v) for k, v in vars(node).items())
    elif isinstance(node, dict):
        items = ((f"{prefix}.{k}", v) for k, v in node.items())
    elif isinstance(node, (list, tuple)):
        items = ((f"{prefix}[{i}]", v) for i, v in enumerate(node))
    else:
        return
    for key, value in items:
        if not isinstance(value, (bool, int, str)):  # the bulk of the options: nothing to look at
            check_finite(value, key)


def validate(cfg: TrainConfig) -> None:
    """Every check that needs no model, no data and no process group; errors name the key."""
    check_finite(cfg)
    r, p, d, o = cfg.run, cfg.parallel, cfg.data, cfg.optim
    if r.timeout_s <= 0:
        raise ValueError(f"run.timeout_s must be > 0, got {r.timeout_s}")
    if r.sample_temperature < 0:
        raise ValueError(f"run.sample_temperature must be >= 0 (0 = greedy), got {r.sample_temperature}")
    if not 1 <= r.steps <= MAX_STEPS:
        raise ValueError(f"run.steps must be in [1, {MAX_STEPS}] (checkpoint folders number steps with nine "
                         f"digits), got {r.steps}")
    if r.sample_tokens < 0:
        raise ValueError(f"run.sample_tokens must be >= 0 (0 = no sample), got {r.sample_tokens}")
    if r.threads < 0:
        raise ValueError(f"run.threads must be >= 0 (0 = cores / local processes), got {r.threads}")
    if r.nproc < 1:
        raise ValueError(f"run.nproc must be >= 1, got {r.nproc}")
    if not (r.watchdog_s == 0 or 0 < r.watchdog_s < r.timeout_s):
        raise ValueError(f"run.watchdog_s must be 0 (off) or in (0, run.timeout_s={r.timeout_s:g}) so the flight "
                         f"recorder is dumped before the collective timeout ends the run, got {r.watchdog_s:g}")
    if r.dtype not in ("float32", "float64", "bfloat16"):
        raise ValueError(f"run.dtype must be float32, float64 or bfloat16, got {r.dtype!r}")
    if r.compile_backend not in COMPILE_BACKENDS:
        raise ValueError(f"run.compile_backend must be one of {', '.join(COMPILE_BACKENDS)}, got {r.compile_backend!r}")
    if r.max_minutes < 0:  # (check_finite above has refused nan and inf)
        raise ValueError(f"run.max_minutes must be a finite number >= 0 (0 = no time budget), got {r.max_minutes}")
    for key in ("pp", "dp", "ep", "cp"):
        if getattr(p, key) < 1:
            raise ValueError(f"parallel.{key} must be >= 1, got {getattr(p, key)}")
    if p.schedule not in SCHEDULES:
        raise ValueError(f"parallel.schedule must be one of {', '.join(SCHEDULES)}, got {p.schedule!r}")
    if p.cp == 1 and p.dp % p.ep:
        raise ValueError(f"parallel.ep={p.ep} must divide parallel.dp={p.dp}: expert parallelism spans "
                         "data-parallel ranks of the same pipeline stage")
    if (p.cp * p.dp) % p.ep:
        raise ValueError(f"parallel.ep={p.ep} must divide parallel.cp x parallel.dp = {p.cp} x {p.dp} = {p.cp * p.dp}: "
                         "expert parallelism spans the context- and data-parallel ranks of a pipeline stage")
    if p.pp > 1 and p.schedule == "none":
        raise ValueError(f"parallel.pp={p.pp} needs a pipeline schedule: set parallel.schedule to one of "
                         f"{', '.join(SCHEDULES[1:])}")
    if p.schedule == "dualpipe" and p.pp % 2:
        raise ValueError(f"parallel.schedule='dualpipe' needs an even parallel.pp, got {p.pp}")
    try:
        check_vpp("1f1b" if p.schedule == "none" else p.schedule, p.vpp)
    except ValueError as exc:
        raise ValueError(f"parallel.vpp={p.vpp} with parallel.schedule={p.schedule!r}: {exc}") from None
    if d.seq_len < 2:
        raise ValueError(f"data.seq_len must be >= 2, got {d.seq_len}")
    if p.cp > 1 and d.seq_len % p.cp:
        raise ValueError(f"parallel.cp={p.cp} must divide data.seq_len={d.seq_len}: the context-parallel ranks "
                         "share each sequence")
    if p.cp > 1 and d.seq_len % (2 * p.cp):
        raise ValueError(f"data.seq_len={d.seq_len} must be divisible by 2 x parallel.cp = {2 * p.cp}: each sequence "
                         f"is cut into 2 x cp chunks, context-parallel rank r holding chunks r and 2cp-1-r (balanced "
                         "causal work)")
    if d.micro_batch < 1:
        raise ValueError(f"data.micro_batch must be >= 1, got {d.micro_batch}")
    unit = p.dp * d.micro_batch
    if d.global_batch < 1 or d.global_batch % unit:
        raise ValueError(f"data.global_batch={d.global_batch} must be a positive multiple of parallel.dp x "
                         f"data.micro_batch = {p.dp} x {d.micro_batch} = {unit}")
    check_microbatches(p, d.global_batch // unit, "data.global_batch")
    if d.batch_ramp_start:
        smallest = unit * min_microbatches(p)
        if not smallest <= d.batch_ramp_start <= d.global_batch or d.batch_ramp_steps < 1:
            raise ValueError(f"data.batch_ramp_start must be in [{smallest}, data.global_batch={d.global_batch}] "
                             f"(the smallest batch schedule '{p.schedule}' can run) with data.batch_ramp_steps >= 1, "
                             f"got {d.batch_ramp_start} and {d.batch_ramp_steps}")
    if not 0.0 <= d.valid_fraction < 0.5:
        raise ValueError(f"data.valid_fraction must be in [0, 0.5), got {d.valid_fraction}")
    if d.bin_dtype not in ("uint8", "uint16", "int32", "uint32", "int64"):
        raise ValueError(f"data.bin_dtype must be uint8, uint16, int32, uint32 or int64, got {d.bin_dtype!r}")
    if o.lr <= 0 or o.min_lr < 0 or o.min_lr > o.lr:
        raise ValueError(f"optim.lr must be > 0 and optim.min_lr in [0, lr], got lr={o.lr}, min_lr={o.min_lr}")
    if o.warmup_steps < 0:
        raise ValueError(f"optim.warmup_steps must be >= 0, got {o.warmup_steps}")
    if not all(0.0 <= beta < 1.0 for beta in o.betas):
        raise ValueError(f"optim.betas must be in [0, 1), got {o.betas}")
    if o.eps <= 0:
        raise ValueError(f"optim.eps must be > 0 (it keeps AdamW's update finite where a moment is 0), got {o.eps}")
    if o.clip_grad < 0:
        raise ValueError(f"optim.clip_grad must be >= 0 (0 = no clipping), got {o.clip_grad}")
    if o.weight_decay < 0:
        raise ValueError(f"optim.weight_decay must be >= 0, got {o.weight_decay}")
    if o.name not in OPTIMIZERS:
        raise ValueError(f"optim.name must be one of {', '.join(OPTIMIZERS)}, got {o.name!r}")
    if o.muon_lr <= 0:
        raise ValueError(f"optim.muon_lr (Muon's LR) must be > 0, got {o.muon_lr}")
    if o.muon_weight_decay < 0:
        raise ValueError(f"optim.muon_weight_decay must be >= 0, got {o.muon_weight_decay}")
    if not 0.0 <= o.muon_momentum < 1.0:
        raise ValueError(f"optim.muon_momentum must be in [0, 1), got {o.muon_momentum}")
    if not 1 <= o.muon_ns_steps < 100:
        raise ValueError(f"optim.muon_ns_steps (Newton-Schulz iterations) must be in [1, 100), got {o.muon_ns_steps}")
    if o.muon_adjust_lr not in MUON_ADJUST_LR:
        raise ValueError(f"optim.muon_adjust_lr must be one of {', '.join(MUON_ADJUST_LR)}, got {o.muon_adjust_lr!r}")
    if o.muon_update_rms <= 0:
        raise ValueError(f"optim.muon_update_rms must be > 0 (Moonlight 0.2, V4 0.18), got {o.muon_update_rms}")
    if o.moments_dtype not in MOMENT_DTYPES:
        raise ValueError(f"optim.moments_dtype must be one of {', '.join(MOMENT_DTYPES)}, got {o.moments_dtype!r}")
    if o.moments_dtype == "bfloat16" and o.name == "sgd":
        raise ValueError(f"optim.moments_dtype='bfloat16' needs optim.name='adamw' or 'muon' (the optimizers with BF16 "
                         f"moments); "
                         f"optim.name={o.name!r} cannot take them (choices for it: {', '.join(OPTIMIZERS)})")
    if o.master_dtype not in MASTER_DTYPES:
        raise ValueError(f"optim.master_dtype must be one of {', '.join(MASTER_DTYPES)}, got {o.master_dtype!r}")
    if o.master_dtype == "float32" and r.dtype != "bfloat16":
        raise ValueError(f"optim.master_dtype='float32' keeps an FP32 master copy of BF16 working weights: it needs "
                         f"run.dtype='bfloat16', got run.dtype={r.dtype!r} (with float32 the parameters are already "
                         f"the master weights; choices for optim.master_dtype: {', '.join(MASTER_DTYPES)})")
    if o.master_dtype == "float32" and o.name == "sgd":
        raise ValueError(f"optim.master_dtype='float32' needs optim.name='adamw' or 'muon' (the optimizers that keep "
                         f"the master copy); optim.name={o.name!r} cannot (choices for it: {', '.join(OPTIMIZERS)})")
    if not 0.0 <= o.ema_decay < 1.0:
        raise ValueError(f"optim.ema_decay must be in [0, 1) (0 = no EMA), got {o.ema_decay}")
    if o.ema_decay and o.name == "sgd":
        raise ValueError(f"optim.ema_decay > 0 needs optim.name='adamw' or 'muon' (the EMA lives in their "
                         f"per-parameter state); "
                         f"got optim.name={o.name!r}")
    if cfg.logging.wandb not in ("offline", "online", "disabled"):
        raise ValueError(f"logging.wandb must be offline, online or disabled, got {cfg.logging.wandb!r}")
    lg, ck = cfg.logging, cfg.checkpoint
    if lg.log_every < 1:
        raise ValueError(f"logging.log_every must be >= 1 (steps between logged lines), got {lg.log_every}")
    if lg.eval_every < 0 or lg.eval_batches < 0:
        raise ValueError(f"logging.eval_every must be >= 0 (0 = only at the end) and logging.eval_batches >= 0 "
                         f"(0 = no validation loss), got {lg.eval_every} and {lg.eval_batches}")
    if ck.interval < 0 or ck.keep_last < 1 or ck.keep_every < 0:
        raise ValueError(f"checkpoint.interval must be >= 0, checkpoint.keep_last >= 1 and checkpoint.keep_every >= 0 "
                         f"(0 = none), got {ck.interval}, {ck.keep_last} and {ck.keep_every}")
    if cfg.checkpoint.write_delay_s < 0:
        raise ValueError(f"checkpoint.write_delay_s must be >= 0, got {cfg.checkpoint.write_delay_s}")
    for key in ("mtp_lambda", "mtp_lambda_late"):
        if getattr(cfg.model, key) < 0:
            raise ValueError(f"model.{key} must be >= 0, got {getattr(cfg.model, key)}")
    if cfg.model.fp8_recipe not in FP8_RECIPES:
        raise ValueError(f"model.fp8_recipe must be one of {', '.join(FP8_RECIPES)}, got {cfg.model.fp8_recipe!r}")
    fmt = cfg.model.expert_weight_format
    if fmt not in EXPERT_WEIGHT_FORMATS:
        raise ValueError(f"model.expert_weight_format must be one of {', '.join(EXPERT_WEIGHT_FORMATS)}, got {fmt!r}")
    if fmt == "fp8" and not cfg.model.fp8:
        raise ValueError("model.expert_weight_format='fp8' is V3's FP8 expert GEMM: it needs model.fp8=true")
    if cfg.model.indexer_qk_format not in INDEXER_QK_FORMATS:
        raise ValueError(f"model.indexer_qk_format must be one of {', '.join(INDEXER_QK_FORMATS)}, "
                         f"got {cfg.model.indexer_qk_format!r}")
    validate_fault(cfg.fault)
    if cfg.logging.fp8_health_every < 0 or not 0 < cfg.logging.fp8_underflow_warn <= 1:
        raise ValueError(f"logging.fp8_health_every must be >= 0 (0 = off) and logging.fp8_underflow_warn in (0, 1], "
                         f"got {cfg.logging.fp8_health_every} and {cfg.logging.fp8_underflow_warn}")
    validate_eplb(cfg)
    validate_schedule(cfg)


def validate_schedule(cfg: TrainConfig) -> None:
    """The ``[schedule]`` stage lists (``training.schedule.parse_curve`` names a bad stage) and a batch ramp that
    starts where the pipeline schedule can run."""
    p, d = cfg.parallel, cfg.data
    sched = schedule_of(cfg)
    smallest = p.dp * d.micro_batch * min_microbatches(p)
    if cfg.schedule.global_batch and min(sched.global_batch.values()) < smallest:
        raise ValueError(f"schedule.global_batch: {min(sched.global_batch.values()):g} sequences is below {smallest}, "
                         f"the smallest batch parallel.schedule='{p.schedule}' can run at parallel.dp={p.dp} "
                         f"(data.micro_batch={d.micro_batch}); start the ramp there")


def validate_fault(f: FaultConfig) -> None:
    """The ``[fault]`` ranges (``training.fault.FaultPolicy`` checks the same when built), named by key."""
    if f.spike_sigma <= 0:
        raise ValueError(f"fault.spike_sigma must be > 0, got {f.spike_sigma}")
    for key in ("window", "stable_after"):
        if getattr(f, key) < 1:
            raise ValueError(f"fault.{key} must be >= 1, got {getattr(f, key)}")
    for key in ("max_retries", "inject_nan_at_step", "fp8_shadow_every", "inject_fp8_scale_error_at_step"):
        if getattr(f, key) < 0:
            raise ValueError(f"fault.{key} must be >= 0, got {getattr(f, key)}")
    if not f.fp8_shadow_threshold > 0 or f.fp8_shadow_patience < 1:
        raise ValueError(f"fault.fp8_shadow_threshold must be > 0 and fault.fp8_shadow_patience >= 1, got "
                         f"{f.fp8_shadow_threshold} and {f.fp8_shadow_patience}")
    if f.fp8_shadow_action not in FP8_SHADOW_ACTIONS:
        raise ValueError(f"fault.fp8_shadow_action must be one of {', '.join(FP8_SHADOW_ACTIONS)}, "
                         f"got {f.fp8_shadow_action!r}")
    if bool(f.inject_fp8_scale_error_at_step) != bool(f.inject_fp8_scale_error_layer):
        raise ValueError("fault.inject_fp8_scale_error_at_step and fault.inject_fp8_scale_error_layer go together "
                         f"(both set or both unset), got {f.inject_fp8_scale_error_at_step} and "
                         f"{f.inject_fp8_scale_error_layer!r}")


def validate_eplb(cfg: TrainConfig) -> None:
    """The ``[eplb]`` checks that need no model (``training.eplb.check_eplb`` adds the model's)."""
    e, p = cfg.eplb, cfg.parallel
    if e.redundant_experts < 0 or e.interval < 1 or not 0.0 <= e.ema_decay < 1.0 or e.num_groups < 0 \
            or e.num_nodes < 0:
        raise ValueError(f"eplb: redundant_experts must be >= 0, interval >= 1, ema_decay in [0, 1), num_groups and "
                         f"num_nodes >= 0 (0 = derived); got redundant_experts={e.redundant_experts}, "
                         f"interval={e.interval}, ema_decay={e.ema_decay}, num_groups={e.num_groups}, "
                         f"num_nodes={e.num_nodes}")
    if not e.enabled:
        return
    if p.ep < 2:
        raise ValueError(f"eplb.enabled needs expert parallelism: parallel.ep must be > 1, got {p.ep} (with one EP "
                         "rank every expert is local and there is no per-GPU load to balance); set parallel.ep > 1 "
                         "or eplb.enabled=false")


def check_world_size(p: ParallelConfig, world_size: int) -> None:
    """ValueError unless the launch's world size is the config's pp x cp x dp."""
    if p.cp > 1 and world_size % (p.pp * p.cp):
        raise ValueError(f"parallel.cp={p.cp} x parallel.pp={p.pp} = {p.pp * p.cp} does not divide the world size "
                         f"{world_size}: every pipeline stage needs whole context-parallel groups; change --nproc / "
                         "run.nproc or the [parallel] section")
    if p.cp > 1 and world_size != p.world_size:
        raise ValueError(f"world size {world_size} != parallel.pp x parallel.cp x parallel.dp = {p.pp} x {p.cp} x "
                         f"{p.dp} = {p.world_size}; change --nproc / run.nproc or the [parallel] section")
    if world_size != p.world_size:
        raise ValueError(f"world size {world_size} != parallel.pp x parallel.dp = {p.pp} x {p.dp} = {p.world_size} "
                         f"(parallel.ep={p.ep} spans data-parallel ranks, it does not multiply the world); "
                         "change --nproc / torchrun --nproc-per-node or the [parallel] section")


# ---- hashing and dumping -------------------------------------------------------------------

# Keys that do not change what is computed: a resume may change them freely.
_HASH_EXCLUDED = {"run": {"name", "nproc", "runs_root", "sample_prompt", "sample_tokens", "sample_temperature",
                          "timeout_s", "watchdog_s", "steps", "threads", "max_minutes",
                          "compile", "compile_backend"},  # the same math, compiled or not
                  "logging": "*", "checkpoint": "*", "fault": "*",
                  "optim": {"ema_decay"},  # the EMA watches the weights, it does not change them
                  # EPLB moves experts between GPUs, not the math: a run may switch it on or off on resume
                  "eplb": "*"}


def numerics_dict(cfg: TrainConfig) -> dict[str, Any]:
    """The config without the keys a resume may change (logging, checkpointing, steps, names)."""
    table = cfg.to_dict()
    for section, keys in _HASH_EXCLUDED.items():
        if keys == "*":
            table.pop(section, None)
        else:
            for k in keys:
                table[section].pop(k, None)
    return table


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {v!r} as TOML")


def dump_toml(table: dict[str, Any]) -> str:
    """A two-level table (sections of scalars) as TOML text that ``tomllib`` reads back to the same dict."""
    lines = []
    for section, values in table.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in values.items() if v is not None]  # None = default
        lines.append("")
    return "\n".join(lines)
