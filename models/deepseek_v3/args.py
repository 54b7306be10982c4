"""ModelArgs: every knob of the DeepSeek-V3 architecture, named after DeepSeek's ``inference/model.py``.

Also here: the presets (671B, a 16B-class "lite", CPU-sized debug models), conversion to and
from Hugging Face ``config.json`` (both the released ``rope_scaling`` block and newer
transformers' ``rope_parameters``), validation, and parameter counts (total / activated per token).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

RECOMPUTE_KINDS = ("norm", "mla_up", "swiglu", "block")
# names that stand for several kinds: "v3" is the V3 report's policy (every RMSNorm and the MLA up-projections)
RECOMPUTE_ALIASES = {"v3": ("norm", "mla_up")}
RECOMPUTE_NAMES = (*RECOMPUTE_KINDS, *RECOMPUTE_ALIASES)
# the lightning indexer's q . k scoring: "auto" (fp8 with FP8 GEMMs, else bf16), "bf16" (the model's precision),
# "fp8" (Hadamard-rotated e4m3 q and k in DeepGEMM's fp8_mqa_logits, V3.2's release; the selection only) or
# "mxfp4_hadamard" (V4's QAT: q and k rotated by the orthonormal Hadamard matrix of the head dim, then FP4 per 32
# with V4's power-of-two scales, straight-through; the selection and the indexer loss both see it)
INDEXER_QK_FORMATS = ("auto", "bf16", "fp8", "mxfp4_hadamard")


@dataclass
class ModelArgs:
    """DeepSeek-V3 architecture. Defaults are the released 671B model (``deepseek_v3_671b``)."""

    vocab_size: int = 129280
    dim: int = 7168
    inter_dim: int = 18432  # dense FFN width (first ``n_dense_layers`` layers)
    moe_inter_dim: int = 2048  # width of every routed and shared expert
    n_layers: int = 61
    n_dense_layers: int = 3
    n_heads: int = 128
    # MoE
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    n_activated_experts: int = 8
    n_expert_groups: int = 8
    n_limited_groups: int = 4
    score_func: str = "sigmoid"  # "sigmoid" (V3) or "softmax" (V2)
    route_scale: float = 2.5
    norm_topk_prob: bool = True
    # MLA
    q_lora_rank: int = 1536  # 0: plain q projection (V2-Lite)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # DeepSeek Sparse Attention (V3.2's lightning indexer; index_topk 0 = dense V3, no indexer)
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 0
    # RoPE / YaRN (rope_factor 1.0 = plain RoPE)
    max_seq_len: int = 163840
    original_seq_len: int = 4096
    rope_theta: float = 10000.0
    rope_factor: float = 40.0
    beta_fast: int = 32
    beta_slow: int = 1
    mscale: float = 1.0  # YaRN cos/sin attention factor numerator (HF ``mscale``)
    mscale_all_dim: float = 1.0  # softmax-scale correction (HF ``mscale_all_dim``); 0 disables it
    # MTP
    n_mtp_layers: int = 1
    mtp_loss_weight: float = 0.3  # lambda; the V3 report lowers it to 0.1 late in training
    # misc
    norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    init_std: float = 0.006
    # training switches (not part of the checkpoint's config.json)
    # route attention projections and every expert/FFN Linear through deep_gemm FP8: False, True / "blockwise"
    # (DeepSeek-V3's recipe) or "mxfp8" (deep_gemm.linear's FP8 recipes)
    fp8: bool | str = False
    # FP8 GEMMs keep their inputs for backward only as e4m3 + 1x128 scales, and the SwiGLU input is kept in
    # FP8 with its output recomputed (V3 report 3.3.3). None: on exactly when ``fp8`` is.
    fp8_cache_activations: bool | None = None
    # RMSNorm, SwiGLU, RoPE, the MoE permute / unpermute and the router through fused_ops' kernels wherever they
    # run (a GPU); False: the unfused torch ops everywhere (the A/B reference). No effect where they cannot run.
    fused_ops: bool = True
    expert_weight_format: str = "bf16"  # routed experts' weights: bf16 | fp8 | mxfp4_qat (deep_gemm.grouped_linear)
    indexer_qk_format: str = "auto"  # INDEXER_QK_FORMATS (the indexer's q . k scoring; ``indexer_qk`` resolves auto)
    # DSA stage 1 (the dense warm-up): attention stays dense and the indexer learns its distribution; off:
    # attention reads each query's index_topk keys (stage 2, and inference). Needs index_topk > 0.
    dsa_warmup: bool = False
    recompute: tuple[str, ...] = ()  # names of RECOMPUTE_NAMES (kinds, or aliases such as "v3")
    recompute_layers: tuple[int, ...] | None = None  # None: every layer (MTP blocks are layer n_layers + k)
    extra: dict[str, Any] = field(default_factory=dict)  # unknown HF config fields, kept for round trips

    def __post_init__(self) -> None:
        self.recompute = (self.recompute,) if isinstance(self.recompute, str) else tuple(self.recompute)
        if self.recompute_layers is not None:
            self.recompute_layers = tuple(self.recompute_layers)
        self.validate()

    # ---- validation -------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError naming the field for any inconsistent setting."""
        positive = ("vocab_size", "dim", "inter_dim", "n_layers", "n_heads", "kv_lora_rank", "qk_nope_head_dim",
                    "qk_rope_head_dim", "v_head_dim", "max_seq_len", "original_seq_len")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelArgs.{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ValueError(f"ModelArgs.n_dense_layers must be in [0, n_layers={self.n_layers}], "
                             f"got {self.n_dense_layers}")
        if self.q_lora_rank < 0 or self.n_mtp_layers < 0 or self.n_shared_experts < 0:
            raise ValueError("ModelArgs.q_lora_rank, n_mtp_layers and n_shared_experts must be >= 0, got "
                             f"{self.q_lora_rank}, {self.n_mtp_layers}, {self.n_shared_experts}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"ModelArgs.qk_rope_head_dim must be even (rotary pairs), got {self.qk_rope_head_dim}")
        if self.score_func not in ("sigmoid", "softmax"):
            raise ValueError(f"ModelArgs.score_func must be 'sigmoid' or 'softmax', got {self.score_func!r}")
        if self.has_moe:
            if self.n_routed_experts <= 0 or self.moe_inter_dim <= 0:
                raise ValueError(f"ModelArgs.n_routed_experts and moe_inter_dim must be > 0 for MoE layers, got "
                                 f"{self.n_routed_experts}, {self.moe_inter_dim}")
            if self.n_expert_groups <= 0 or self.n_routed_experts % self.n_expert_groups:
                raise ValueError(f"ModelArgs.n_routed_experts={self.n_routed_experts} must be divisible by "
                                 f"n_expert_groups={self.n_expert_groups}")
            if not 1 <= self.n_limited_groups <= self.n_expert_groups:
                raise ValueError(f"ModelArgs.n_limited_groups (top-k groups) must be in [1, n_expert_groups="
                                 f"{self.n_expert_groups}], got {self.n_limited_groups}")
            reachable = self.n_limited_groups * (self.n_routed_experts // self.n_expert_groups)
            if not 1 <= self.n_activated_experts <= reachable:
                raise ValueError(f"ModelArgs.n_activated_experts must be in [1, {reachable}] (experts in the "
                                 f"{self.n_limited_groups} kept groups), got {self.n_activated_experts}")
            if self.n_expert_groups > 1 and self.score_func == "sigmoid" and self.experts_per_group < 2:
                raise ValueError("ModelArgs: group scores sum each group's top-2 experts, so n_routed_experts / "
                                 f"n_expert_groups must be >= 2, got {self.experts_per_group}")
        if self.expert_weight_format != "bf16" and not self.has_moe:
            raise ValueError(f"ModelArgs.expert_weight_format={self.expert_weight_format!r} is the routed experts' "
                             f"weight format, and this model has none (n_dense_layers = n_layers = {self.n_layers}, "
                             "no MTP layer); set expert_weight_format='bf16' or make a layer MoE")
        if self.rope_factor < 1.0:
            raise ValueError(f"ModelArgs.rope_factor must be >= 1 (1 = no YaRN), got {self.rope_factor}")
        if self.fp8_cache_activations and not self.fp8:
            raise ValueError("ModelArgs.fp8_cache_activations=True needs fp8=True (it caches the FP8 GEMMs' "
                             "inputs); set fp8=True, or fp8_cache_activations to False or None")
        if self.index_topk < 0:
            raise ValueError(f"ModelArgs.index_topk must be >= 0 (0 = dense V3), got {self.index_topk}")
        if self.index_topk:
            if not self.q_lora_rank:
                raise ValueError("ModelArgs.index_topk > 0 needs q_lora_rank > 0: the indexer's queries come from "
                                 "the MLA query's low-rank residual")
            if self.index_n_heads <= 0 or self.index_head_dim < self.qk_rope_head_dim:
                raise ValueError(f"ModelArgs.index_n_heads must be > 0 and index_head_dim >= qk_rope_head_dim="
                                 f"{self.qk_rope_head_dim}, got {self.index_n_heads}, {self.index_head_dim}")
        elif self.dsa_warmup:
            raise ValueError("ModelArgs.dsa_warmup=True needs index_topk > 0 (a model with an indexer)")
        check_indexer_qk_format(self.indexer_qk_format, self.index_head_dim if self.index_topk else None)
        unknown = [name for name in self.recompute if name not in RECOMPUTE_NAMES]
        if unknown:
            raise ValueError(f"ModelArgs.recompute: unknown name(s) {unknown}; valid names are "
                             f"{', '.join(RECOMPUTE_NAMES)} (v3 = {' + '.join(RECOMPUTE_ALIASES['v3'])})")

    # ---- derived ----------------------------------------------------------------------------------
    @property
    def has_moe(self) -> bool:
        return self.n_layers > self.n_dense_layers or self.n_mtp_layers > 0

    @property
    def experts_per_group(self) -> int:
        return self.n_routed_experts // self.n_expert_groups

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def yarn(self) -> bool:
        return self.rope_factor > 1.0

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times the YaRN mscale^2 correction when the context is extended."""
        scale = self.qk_head_dim ** -0.5
        if self.yarn and self.mscale_all_dim:
            m = 0.1 * self.mscale_all_dim * math.log(self.rope_factor) + 1.0
            scale *= m * m
        return scale

    @property
    def indexer_qk(self) -> str:
        """The indexer's scoring format with "auto" resolved: "fp8" when the GEMMs run in FP8, else "bf16"."""
        if self.indexer_qk_format == "auto":
            return "fp8" if self.fp8 else "bf16"
        return self.indexer_qk_format

    @property
    def sparse(self) -> bool:
        """Whether attention reads only each query's ``index_topk`` indexed keys (V3.2 outside the warm-up)."""
        return self.index_topk > 0 and not self.dsa_warmup

    def is_moe_layer(self, layer_id: int) -> bool:
        """Layer ids run 0..n_layers-1 for the trunk and n_layers+k for MTP depth k+1 (always MoE)."""
        return layer_id >= self.n_dense_layers

    @property
    def fp8_cache(self) -> bool:
        """Whether FP8 activation caching is on (``fp8_cache_activations``, defaulting to ``fp8``)."""
        return bool(self.fp8) if self.fp8_cache_activations is None else bool(self.fp8_cache_activations)

    @property
    def recompute_kinds(self) -> frozenset[str]:
        """``recompute`` with the aliases expanded into the kinds they stand for."""
        return frozenset(k for name in self.recompute for k in RECOMPUTE_ALIASES.get(name, (name,)))

    def recomputes(self, kind: str, layer_id: int) -> bool:
        """Whether layer ``layer_id`` recomputes ``kind``. Where ``block`` is on it covers the whole layer
        (only the block's input is kept), so the finer kinds are off there."""
        def on(k: str) -> bool:
            return k in self.recompute_kinds and (self.recompute_layers is None or layer_id in self.recompute_layers)

        return on(kind) and (kind == "block" or not on("block"))

    def replace(self, **changes: Any) -> ModelArgs:
        return dataclasses.replace(self, **changes)

    # ---- presets ----------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelArgs:
        """A named configuration (see ``PRESETS``), with optional field overrides."""
        if name not in PRESETS:
            raise ValueError(f"ModelArgs.preset: unknown name {name!r}; expected one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    # ---- HF config.json ---------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, path_or_dict: str | Path | dict[str, Any], **overrides: Any) -> ModelArgs:
        """From a HF ``config.json`` (file, directory holding one, or dict). A file that is not JSON, or whose
        values do not make a valid config, is a ValueError naming the file."""
        return read_hf_config(path_or_dict, lambda cfg: cls._from_hf_dict(cfg, overrides))

    @classmethod
    def _from_hf_dict(cls, cfg: dict[str, Any], overrides: dict[str, Any]) -> ModelArgs:
        if cfg.get("model_type") == "deepseek_v4" or "hc_mult" in cfg:
            raise ValueError("from_hf_config: this is a DeepSeek-V4 config; read it with "
                             "models.deepseek_v4.ModelArgs.from_hf_config")
        kw: dict[str, Any] = {}
        for ours, theirs in _HF_FIELDS.items():
            if cfg.get(theirs) is not None:
                kw[ours] = cfg.pop(theirs)
            else:
                cfg.pop(theirs, None)
        kw["q_lora_rank"] = kw.get("q_lora_rank") or 0
        kw.setdefault("n_routed_experts", 0)  # null in a dense config
        rope = cfg.pop("rope_scaling", None) or cfg.pop("rope_parameters", None) or {}
        cfg.pop("rope_parameters", None)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if "rope_theta" in rope:
            kw["rope_theta"] = rope["rope_theta"]
        elif cfg.get("rope_theta") is not None:
            kw["rope_theta"] = cfg.pop("rope_theta")
        cfg.pop("rope_theta", None)
        if rope_type in ("yarn", "deepseek_yarn"):
            kw.update(rope_factor=float(rope["factor"]), original_seq_len=int(rope["original_max_position_embeddings"]),
                      beta_fast=rope.get("beta_fast", 32), beta_slow=rope.get("beta_slow", 1),
                      mscale=float(rope.get("mscale", 1.0) or 0.0),
                      mscale_all_dim=float(rope.get("mscale_all_dim", 0.0) or 0.0))
        elif rope_type == "default":
            kw.update(rope_factor=1.0, original_seq_len=kw.get("max_seq_len", 4096))
        else:
            raise ValueError(f"from_hf_config: rope type {rope_type!r} is not supported (expected yarn or default)")
        kv_heads = cfg.pop("num_key_value_heads", None)
        if kv_heads is not None and kv_heads != kw.get("n_heads", cls.n_heads):
            raise ValueError(f"from_hf_config: num_key_value_heads={kv_heads} must equal num_attention_heads="
                             f"{kw.get('n_heads', cls.n_heads)} (MLA expands its shared latent to every head)")
        if cfg.pop("moe_layer_freq", 1) != 1:
            raise ValueError("from_hf_config: moe_layer_freq must be 1 (every layer after the dense ones is MoE)")
        if cfg.pop("hidden_act", "silu") != "silu":
            raise ValueError("from_hf_config: hidden_act must be 'silu'")
        if cfg.pop("topk_method", "noaux_tc") not in ("noaux_tc", "greedy", "group_limited_greedy"):
            raise ValueError("from_hf_config: unsupported topk_method")
        if cfg.get("model_type") == "deepseek_v32" and not kw.get("index_topk"):
            kw["index_topk"] = 2048  # transformers' DeepseekV32Config default
        kw["extra"] = {k: v for k, v in cfg.items() if k not in _HF_DROPPED}
        kw.update(overrides)
        return cls(**kw)

    def to_hf_config(self) -> dict[str, Any]:
        """The HF ``config.json`` dict (DeepseekV3ForCausalLM; loads in transformers and DeepSeek's code)."""
        cfg: dict[str, Any] = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
        for ours, theirs in _HF_FIELDS.items():
            cfg[theirs] = getattr(self, ours)
        for name in _HF_INDEX_FIELDS:
            cfg.pop(name)
            if self.index_topk:
                cfg[name] = getattr(self, name)
        cfg.update(q_lora_rank=self.q_lora_rank or None, hidden_act="silu", topk_method="noaux_tc",
                   num_key_value_heads=self.n_heads, attention_bias=False, rope_interleave=True,
                   n_group=self.n_expert_groups, topk_group=self.n_limited_groups,
                   num_experts_per_tok=self.n_activated_experts, first_k_dense_replace=self.n_dense_layers)
        if self.yarn:
            cfg["rope_scaling"] = {"type": "yarn", "rope_type": "yarn", "factor": self.rope_factor,
                                   "original_max_position_embeddings": self.original_seq_len,
                                   "beta_fast": self.beta_fast, "beta_slow": self.beta_slow,
                                   "mscale": self.mscale, "mscale_all_dim": self.mscale_all_dim}
        else:
            cfg["rope_scaling"] = None
        cfg["rope_theta"] = self.rope_theta
        if self.index_topk:  # DeepSeek-V3.2 (transformers' DeepseekV32, whose config has no rope_interleave)
            cfg.update(architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32")
            del cfg["rope_interleave"]
        for k, v in self.extra.items():
            cfg.setdefault(k, v)
        return cfg

    def save_hf_config(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_hf_config(), indent=2) + "\n")

    # ---- parameter counts -------------------------------------------------------------------------
    def param_counts(self, include_mtp: bool = False) -> dict[str, int]:
        """Total and activated-per-token parameter counts.

        As in DeepSeek's published figures (671B / 37B for V3, 15.7B / 2.4B for V2-Lite): the MTP
        module is excluded unless asked for (the HF checkpoint's 685B includes it with its copies of
        embedding and head), and "activated" leaves out the input embedding, a lookup rather than a GEMM.
        """
        d, h = self.dim, self.n_heads
        q = self.q_lora_rank * (d + h * self.qk_head_dim + 1) if self.q_lora_rank else d * h * self.qk_head_dim
        kv = d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        kv += self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
        attn = q + kv + h * self.v_head_dim * d + 2 * d  # + both block norms
        if self.index_topk:  # the lightning indexer: wq_b, wk, k_norm (weight and bias), weights_proj
            hi, di = self.index_n_heads, self.index_head_dim
            attn += self.q_lora_rank * hi * di + d * di + 2 * di + d * hi
        dense_ffn = 3 * d * self.inter_dim
        expert = 3 * d * self.moe_inter_dim
        moe_common = self.n_shared_experts * expert + self.n_routed_experts * d  # shared + router (bias: buffer)
        moe_total = moe_common + self.n_routed_experts * expert
        moe_active = moe_common + self.n_activated_experts * expert
        n_moe = self.n_layers - self.n_dense_layers
        embed_head = self.vocab_size * d * (1 if self.tie_word_embeddings else 2) + d  # + final norm
        total = embed_head + self.n_layers * attn + self.n_dense_layers * dense_ffn + n_moe * moe_total
        lookup = 0 if self.tie_word_embeddings else self.vocab_size * d
        active = embed_head - lookup + self.n_layers * attn + self.n_dense_layers * dense_ffn + n_moe * moe_active
        if include_mtp:
            mtp_extra = 2 * d * d + 3 * d  # eh_proj, enorm, hnorm, shared_head.norm
            total += self.n_mtp_layers * (attn + moe_total + mtp_extra)
            active += self.n_mtp_layers * (attn + moe_active + mtp_extra)
        return {"total": total, "activated": active}


# HF config.json name for each ModelArgs field that maps 1:1.
def check_indexer_qk_format(fmt: object, head_dim: int | None) -> None:
    """One-line ValueError for an indexer scoring format the model cannot take (``head_dim``: the indexer's head
    dim, None for a model without an indexer): an unknown name; fp8 or mxfp4_hadamard without an indexer, or on a
    head dim that is not a power of two (the Hadamard rotation), above 128 (fp8: one scale per head) or not a
    multiple of 32 (mxfp4_hadamard: FP4 blocks)."""
    if fmt not in INDEXER_QK_FORMATS:
        raise ValueError(f"indexer_qk_format must be one of {', '.join(INDEXER_QK_FORMATS)}, got {fmt!r}")
    if fmt in ("auto", "bf16"):
        return
    if head_dim is None:
        raise ValueError(f"indexer_qk_format={fmt!r} needs a model with a lightning indexer (V3.2: index_topk > 0; "
                         "V4: a compress-ratio-4 layer)")
    if head_dim & (head_dim - 1) or head_dim <= 0:
        raise ValueError(f"indexer_qk_format={fmt!r} rotates q and k by a Hadamard matrix: index_head_dim must be a "
                         f"power of two, got {head_dim}")
    if fmt == "fp8" and head_dim > 128:
        raise ValueError(f"indexer_qk_format='fp8' scales each head's q in one 1x128 tile: index_head_dim must be "
                         f"<= 128, got {head_dim}")
    if fmt == "mxfp4_hadamard" and head_dim % 32:
        raise ValueError(f"indexer_qk_format='mxfp4_hadamard' casts q and k to FP4 in blocks of 32: index_head_dim "
                         f"must be a multiple of 32, got {head_dim}")


_HF_FIELDS = {
    "vocab_size": "vocab_size", "dim": "hidden_size", "inter_dim": "intermediate_size",
    "moe_inter_dim": "moe_intermediate_size", "n_layers": "num_hidden_layers",
    "n_dense_layers": "first_k_dense_replace",
    "n_heads": "num_attention_heads", "n_routed_experts": "n_routed_experts", "n_shared_experts": "n_shared_experts",
    "n_activated_experts": "num_experts_per_tok", "n_expert_groups": "n_group", "n_limited_groups": "topk_group",
    "score_func": "scoring_func", "route_scale": "routed_scaling_factor", "norm_topk_prob": "norm_topk_prob",
    "q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank", "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim", "max_seq_len": "max_position_embeddings",
    "n_mtp_layers": "num_nextn_predict_layers", "norm_eps": "rms_norm_eps",
    "tie_word_embeddings": "tie_word_embeddings", "bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id",
    "index_n_heads": "index_n_heads", "index_head_dim": "index_head_dim", "index_topk": "index_topk",
}
_HF_INDEX_FIELDS = ("index_n_heads", "index_head_dim", "index_topk")  # written for V3.2 configs only
# HF fields that are implied by ours (re-written by to_hf_config) or carry no architecture.
_HF_DROPPED = {"architectures", "model_type", "num_key_value_heads", "attention_bias", "rope_interleave",
               "transformers_version", "auto_map", "quantization_config", "torch_dtype", "dtype", "use_cache",
               "num_mtp_layers", "head_dim", "qk_head_dim"}


_DEBUG = dict(
    vocab_size=256, dim=64, inter_dim=128, moe_inter_dim=32, n_layers=3, n_dense_layers=1, n_heads=4,
    n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, n_expert_groups=4, n_limited_groups=2,
    q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    max_seq_len=512, original_seq_len=128, rope_factor=4.0, n_mtp_layers=1, init_std=0.02,
)

PRESETS: dict[str, dict[str, Any]] = {
    "deepseek_v3_671b": {},
    # DeepSeek-V2-Lite (the released 16B-class MLA+MoE model): softmax scores, no q LoRA, no groups, no MTP.
    "deepseek_v2_lite": dict(
        vocab_size=102400, dim=2048, inter_dim=10944, moe_inter_dim=1408, n_layers=27, n_dense_layers=1,
        n_heads=16, n_routed_experts=64, n_shared_experts=2, n_activated_experts=6, n_expert_groups=1,
        n_limited_groups=1, score_func="softmax", route_scale=1.0, norm_topk_prob=False, q_lora_rank=0,
        max_seq_len=163840, original_seq_len=4096, rope_factor=40.0, mscale=0.707, mscale_all_dim=0.707,
        n_mtp_layers=0, bos_token_id=100000, eos_token_id=100001,
    ),
    # A byte-level model that trains on a CPU in seconds: every V3 feature (q LoRA, YaRN, groups, MTP) on.
    "debug": _DEBUG,
    # Smallest shapes for unit tests.
    "debug_tiny": {**_DEBUG, "dim": 32, "inter_dim": 64, "moe_inter_dim": 16, "n_heads": 2, "q_lora_rank": 16,
                   "kv_lora_rank": 16, "qk_nope_head_dim": 8, "v_head_dim": 8},
    # CPU benchmark size: big enough that GEMMs, not Python, dominate.
    "bench_cpu": {**_DEBUG, "dim": 256, "inter_dim": 512, "moe_inter_dim": 128, "n_layers": 4, "n_heads": 8,
                  "n_routed_experts": 16, "n_activated_experts": 4, "n_expert_groups": 4, "n_limited_groups": 2,
                  "q_lora_rank": 96, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
                  "v_head_dim": 32, "vocab_size": 1024},
    # One-GPU benchmark size: V3's per-layer head/latent dims, 64 experts top-6, 3 layers (~0.5B params).
    "bench_gpu": {**_DEBUG, "dim": 2048, "inter_dim": 4096, "moe_inter_dim": 512, "n_layers": 3, "n_heads": 16,
                  "n_routed_experts": 64, "n_activated_experts": 6, "n_expert_groups": 8, "n_limited_groups": 4,
                  "q_lora_rank": 768, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                  "v_head_dim": 128, "vocab_size": 16384, "max_seq_len": 8192, "original_seq_len": 4096,
                  "rope_factor": 40.0, "init_std": 0.006},
}
# DeepSeek-V3.2(-Exp): V3 plus the lightning indexer (64 heads x 128, top-2048) in every layer.
PRESETS["deepseek_v32_671b"] = dict(index_n_heads=64, index_head_dim=128, index_topk=2048)
# The CPU debug model with an indexer: top-32 keys of a 128-token window, so attention is really sparse.
PRESETS["debug_dsa"] = {**_DEBUG, "index_n_heads": 4, "index_head_dim": 16, "index_topk": 32}
PRESETS["lite"] = PRESETS["deepseek_v2_lite"]


T = TypeVar("T")


def read_hf_config(path_or_dict: str | Path | dict[str, Any], build: Callable[[dict[str, Any]], T]) -> T:
    """``build(config dict)`` from a ``config.json`` file, a folder holding one, or a dict (V3's and V4's
    ``from_hf_config``): a file that is not a JSON object, or whose values ``build`` refuses (ValueError, or a
    missing key), is a ValueError naming the file."""
    if isinstance(path_or_dict, dict):
        return build(dict(path_or_dict))
    path = Path(path_or_dict)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"from_hf_config: no config.json at {path}")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"from_hf_config: {path} is not readable JSON: {' '.join(str(exc).split())}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"from_hf_config: {path} holds a JSON {type(cfg).__name__}; expected an object")
    try:
        return build(cfg)
    except KeyError as exc:
        raise ValueError(f"from_hf_config: {path}: missing key {exc}") from None
    except (ValueError, TypeError, AttributeError) as exc:
        what = " ".join(str(exc).split()).removeprefix("from_hf_config: ")
        raise ValueError(f"from_hf_config: {path}: {what}") from None
