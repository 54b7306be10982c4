"""ModelArgs: every knob of the DeepSeek-V4 architecture, named after DeepSeek's V4 ``inference/model.py``.

Also here: the presets (V4-Flash, V4-Pro, the CPU-sized ``debug_v4``) and conversion to and from a
Hugging Face ``config.json``. Two spellings of that file exist: the released one (per-layer
``compress_ratios``, ``num_hash_layers``, ``qk_rope_head_dim``, a ``rope_scaling`` YaRN block) and the one
transformers writes (``layer_types``, ``mlp_layer_types``, ``compress_rates``, ``partial_rotary_factor``,
``rope_parameters`` keyed ``main`` / ``compress``); both are read, the second is written.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from models.deepseek_v3.args import check_indexer_qk_format, read_hf_config

COMPRESS_RATIOS = (0, 4, 128)  # per layer: window only, CSA (overlapping windows + indexer), HCA
RECOMPUTE_KINDS = ("block",)
INDEXER_QK_FORMATS = ("bf16", "mxfp4_hadamard")  # V4 has no FP8 GEMM path here
_LAYER_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}


@dataclass
class ModelArgs:
    """DeepSeek-V4 architecture. Defaults are V4-Flash (``deepseek_v4_flash``)."""

    vocab_size: int = 129280
    dim: int = 4096
    n_layers: int = 43
    n_heads: int = 64
    # attention: low-rank Q, one shared K = V head, grouped low-rank output
    q_lora_rank: int = 1024
    head_dim: int = 512
    rope_head_dim: int = 64  # RoPE on the last rope_head_dim dims of every head (interleaved pairs)
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    # one entry per main layer, then one per MTP layer: 0 (window only), 4 (CSA) or 128 (HCA)
    compress_ratios: tuple[int, ...] = ()
    # lightning indexer of the CSA layers
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    # the indexer's q . k: "bf16" (the model's precision) or "mxfp4_hadamard" (V4's QAT: Hadamard rotation, then
    # FP4 per 32 with power-of-two scales, straight-through; models.deepseek_v3.indexer.hadamard_fp4)
    indexer_qk_format: str = "bf16"
    # MoE (every layer)
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    n_activated_experts: int = 6
    moe_inter_dim: int = 2048
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.5
    n_hash_layers: int = 3  # the first n_hash_layers layers route by the token id (``tid2eid``)
    swiglu_limit: float = 10.0  # 0: no clamp
    # manifold-constrained hyper-connections
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # RoPE: plain rope_theta on window-only layers; compress_rope_theta with YaRN on compressed layers
    max_seq_len: int = 1048576
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0  # 1: no YaRN
    original_seq_len: int = 65536
    beta_fast: int = 32
    beta_slow: int = 1
    # MTP
    n_mtp_layers: int = 1
    mtp_loss_weight: float = 0.3
    # misc
    norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    init_std: float = 0.02
    # training switches (not part of the checkpoint's config.json), with V3's meanings (``models.deepseek_v3.args``):
    # FP8 for the routed experts' grouped GEMMs (False, True / "blockwise", or "mxfp8"), their weight format, and
    # whole-block recompute ("block") for the layers ``recompute_layers`` (None: every layer; MTP is n_layers + k)
    fp8: bool | str = False
    fused_ops: bool = True
    expert_weight_format: str = "bf16"
    recompute: tuple[str, ...] = ()
    recompute_layers: tuple[int, ...] | None = None
    # V3.2's dense indexer warm-up (``models.deepseek_v4.indexer_loss``): CSA layers attend every visible
    # compressed entry and only the indexers train (``training.loss.freeze_all_but_indexers``)
    dsa_warmup: bool = False
    # config.json fields this model does not use (tokenizer ids, generation defaults ...), kept for round trips
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.recompute = (self.recompute,) if isinstance(self.recompute, str) else tuple(self.recompute)
        if self.recompute_layers is not None:
            self.recompute_layers = tuple(self.recompute_layers)
        self.compress_ratios = tuple(int(r) for r in self.compress_ratios)
        n = self.n_layers + self.n_mtp_layers
        if len(self.compress_ratios) < n:  # an MTP layer without an entry attends its window only
            if len(self.compress_ratios) < self.n_layers:
                raise ValueError(f"compress_ratios has {len(self.compress_ratios)} entries; expected one per "
                                 f"layer (n_layers={self.n_layers}, plus optionally one per MTP layer)")
            self.compress_ratios += (0,) * (n - len(self.compress_ratios))
        self.compress_ratios = self.compress_ratios[:n]
        bad = sorted({r for r in self.compress_ratios if r not in COMPRESS_RATIOS})
        if bad:
            raise ValueError(f"compress_ratios: {bad} not supported; expected entries in {COMPRESS_RATIOS}")
        checks = [
            (self.head_dim % 2 == 0 and 0 < self.rope_head_dim <= self.head_dim and self.rope_head_dim % 2 == 0,
             f"rope_head_dim={self.rope_head_dim} must be even and <= head_dim={self.head_dim}"),
            (self.rope_head_dim <= self.index_head_dim or 4 not in self.compress_ratios,
             f"index_head_dim={self.index_head_dim} must hold the rope_head_dim={self.rope_head_dim} RoPE dims"),
            (self.n_heads * self.head_dim % self.o_groups == 0,
             f"o_groups={self.o_groups} must divide n_heads * head_dim={self.n_heads * self.head_dim}"),
            (0 < self.n_activated_experts <= self.n_routed_experts,
             f"n_activated_experts={self.n_activated_experts} must be in 1..n_routed_experts={self.n_routed_experts}"),
            (self.n_shared_experts in (0, 1), f"n_shared_experts={self.n_shared_experts}; V4 has 0 or 1"),
            (self.score_func in ("sqrtsoftplus", "sigmoid", "softmax"),
             f"score_func={self.score_func!r}; expected 'sqrtsoftplus', 'sigmoid' or 'softmax'"),
            (0 <= self.n_hash_layers <= self.n_layers, f"n_hash_layers={self.n_hash_layers} exceeds n_layers"),
            (self.hc_mult >= 1 and self.hc_sinkhorn_iters >= 1, "hc_mult and hc_sinkhorn_iters must be >= 1"),
            (self.index_topk > 0 or 4 not in self.compress_ratios, "CSA layers need index_topk > 0"),
            (not self.dsa_warmup or 4 in self.compress_ratios,
             "dsa_warmup=True needs a CSA layer (compress ratio 4: the layers with an indexer)"),
            (self.window_size > 0, f"window_size={self.window_size} must be positive"),
            (set(self.recompute) <= set(RECOMPUTE_KINDS),
             f"recompute={list(self.recompute)}: V4 recomputes {list(RECOMPUTE_KINDS)} (whole blocks)"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"ModelArgs: {msg}")
        if self.indexer_qk_format == "auto":  # the training config's default: V4's indexer scores in BF16 here
            self.indexer_qk_format = "bf16"
        if self.indexer_qk_format not in INDEXER_QK_FORMATS:
            raise ValueError(f"ModelArgs: indexer_qk_format must be one of {', '.join(INDEXER_QK_FORMATS)} for V4, "
                             f"got {self.indexer_qk_format!r}")
        check_indexer_qk_format(self.indexer_qk_format, self.index_head_dim if 4 in self.compress_ratios else None)

    @property
    def yarn(self) -> bool:
        return self.rope_factor > 1 and self.original_seq_len > 0

    @property
    def fp8_cache(self) -> bool:
        """FP8 activation caching (V3's ``fp8_cache_activations``): not implemented for V4, always off."""
        return False

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width (the shared K = V head), for V3's FLOP counter."""
        return self.head_dim

    @property
    def v_head_dim(self) -> int:
        return self.head_dim

    def recomputes(self, kind: str, layer_id: int) -> bool:
        """Whether layer ``layer_id`` (MTP depth k: ``n_layers + k - 1``) recomputes ``kind`` (only "block")."""
        return kind in self.recompute and (self.recompute_layers is None or layer_id in self.recompute_layers)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelArgs:
        """A named configuration (see ``PRESETS``), with optional field overrides."""
        if name not in PRESETS:
            raise ValueError(f"ModelArgs.preset: unknown name {name!r}; expected one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    # ---- HF config.json ---------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, path_or_dict: str | Path | dict[str, Any], **overrides: Any) -> ModelArgs:
        """From a V4 ``config.json`` (file, folder holding one, or dict), either spelling. A file that is not
        JSON, or whose values do not make a valid config, is a ValueError naming the file."""
        return read_hf_config(path_or_dict, lambda cfg: cls._from_hf_dict(cfg, overrides))

    @classmethod
    def _from_hf_dict(cls, cfg: dict[str, Any], overrides: dict[str, Any]) -> ModelArgs:
        if cfg.get("model_type", "deepseek_v4") != "deepseek_v4":
            raise ValueError(f"model_type={cfg['model_type']!r} is not 'deepseek_v4' (a V3 config: "
                             "models.deepseek_v3.ModelArgs.from_hf_config)")
        kw: dict[str, Any] = {ours: cfg[theirs] for ours, theirs in _HF_FIELDS.items() if cfg.get(theirs) is not None}
        n = kw.get("n_layers", cls.n_layers)
        if cfg.get("layer_types") is not None:
            rates = {**_DEFAULT_RATES, **(cfg.get("compress_rates") or {})}
            by_type = {t: (0 if t == "sliding_attention" else int(rates[t])) for t in _LAYER_TYPES.values()}
            kw["compress_ratios"] = tuple(by_type[t] for t in cfg["layer_types"])
        elif cfg.get("compress_ratios") is not None:
            kw["compress_ratios"] = tuple(cfg["compress_ratios"])
        else:
            kw["compress_ratios"] = (0,) * n
        if cfg.get("mlp_layer_types") is not None:
            types = list(cfg["mlp_layer_types"])
            n_hash = sum(t == "hash_moe" for t in types)
            if types != ["hash_moe"] * n_hash + ["moe"] * (len(types) - n_hash):
                raise ValueError(f"mlp_layer_types must be 'hash_moe' layers then 'moe' layers, got {types}")
            kw["n_hash_layers"] = n_hash
        elif cfg.get("num_hash_layers") is not None:
            kw["n_hash_layers"] = cfg["num_hash_layers"]
        if cfg.get("qk_rope_head_dim") is not None:
            kw["rope_head_dim"] = cfg["qk_rope_head_dim"]
        elif cfg.get("partial_rotary_factor") is not None:
            kw["rope_head_dim"] = round(kw.get("head_dim", cls.head_dim) * cfg["partial_rotary_factor"])
        rope = cfg.get("rope_parameters") or {}
        if isinstance(rope.get("compress"), dict):  # transformers' spelling: {"main": {...}, "compress": {...}}
            kw["rope_theta"] = rope.get("main", {}).get("rope_theta", kw.get("rope_theta", cls.rope_theta))
            yarn = rope["compress"]
            kw["compress_rope_theta"] = yarn.get("rope_theta", kw.get("compress_rope_theta", cls.compress_rope_theta))
        else:
            yarn = cfg.get("rope_scaling") or rope
        if yarn.get("rope_type", yarn.get("type", "default")) == "yarn":
            kw.update(rope_factor=yarn["factor"], original_seq_len=yarn["original_max_position_embeddings"],
                      beta_fast=yarn.get("beta_fast") or 32, beta_slow=yarn.get("beta_slow") or 1)
        else:
            kw.update(rope_factor=1.0, original_seq_len=0)
        for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False),
                          ("norm_topk_prob", True)):
            if cfg.get(key, want) != want:
                raise ValueError(f"{key}={cfg[key]!r}; DeepSeek-V4 has {want!r}")
        kw["extra"] = {k: v for k, v in cfg.items() if k not in _HF_READ and not k.startswith("_")}
        kv_heads = cfg.get("num_key_value_heads", 1)
        if kv_heads != 1:
            raise ValueError(f"num_key_value_heads={kv_heads}; DeepSeek-V4 has one shared K = V head")
        if cfg.get("n_shared_experts") is None and "n_shared_experts" not in kw:
            kw["n_shared_experts"] = 1
        return cls(**{**kw, **overrides})

    def to_hf_config(self) -> dict[str, Any]:
        """The ``config.json`` dict transformers' ``DeepseekV4Config`` reads (its own spelling)."""
        cfg: dict[str, Any] = {**self.extra, "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"}
        cfg.update({theirs: getattr(self, ours) for ours, theirs in _HF_FIELDS.items()})
        cfg.update(num_key_value_heads=1, partial_rotary_factor=self.rope_head_dim / self.head_dim,
                   layer_types=[_LAYER_TYPES[r] for r in self.compress_ratios[: self.n_layers]],
                   compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
                   mlp_layer_types=["hash_moe"] * self.n_hash_layers + ["moe"] * (self.n_layers - self.n_hash_layers),
                   compress_ratios=list(self.compress_ratios), hidden_act="silu", norm_topk_prob=True)
        main = {"rope_type": "default", "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.rope_head_dim / self.head_dim}
        compress: dict[str, Any] = {**main, "rope_theta": self.compress_rope_theta}
        if self.yarn:
            compress.update(rope_type="yarn", factor=self.rope_factor, original_max_position_embeddings=
                            self.original_seq_len, beta_fast=self.beta_fast, beta_slow=self.beta_slow,
                            attention_factor=1.0)
        cfg["rope_parameters"] = {"main": main, "compress": compress}
        return cfg

    def replace(self, **changes: Any) -> ModelArgs:
        return dataclasses.replace(self, **changes)

    def layer_params(self, layer_id: int) -> dict[str, int]:
        """Parameters of block ``layer_id`` (MTP depth k: ``n_layers + k - 1``) by part: ``attention`` (projections,
        norms, sink, compressor and indexer of its kind), ``mhc`` (its two mHC units), ``routed`` (all routed
        experts), ``ffn`` (the rest of the MoE: router, shared expert, norm). Closed form from the shapes
        (``models.deepseek_v4.model``); buffers (router bias, ``tid2eid``) are not parameters."""
        d, h, hd = self.dim, self.n_heads, self.head_dim
        attn = (d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * hd + d * hd + hd
                + h * hd * self.o_lora_rank + self.o_groups * self.o_lora_rank * d + h + d)  # + attn_norm

        def compressor(ratio: int, width: int) -> int:
            coff = 2 if ratio == 4 else 1
            return 2 * d * coff * width + ratio * coff * width + width

        ratio = self.compress_ratios[layer_id]
        if ratio:
            attn += compressor(ratio, hd)
        if ratio == 4:  # the indexer: wq_b, weights_proj, its own compressor
            attn += self.q_lora_rank * self.index_n_heads * self.index_head_dim + d * self.index_n_heads
            attn += compressor(4, self.index_head_dim)
        mix = (2 + self.hc_mult) * self.hc_mult
        expert = 3 * d * self.moe_inter_dim
        return {"attention": attn, "mhc": 2 * (mix * self.hc_mult * d + mix + 3),
                "routed": self.n_routed_experts * expert,
                "ffn": self.n_routed_experts * d + self.n_shared_experts * expert + d}

    def param_counts(self, include_mtp: bool = False) -> dict[str, int]:
        """Total and activated-per-token parameter counts, as DeepSeek publishes them (V4-Flash 284B / 13B): MTP
        excluded unless asked for, "activated" without the input embedding (a lookup) and with ``n_activated``
        of the routed experts. Closed form (``layer_params``), independent of the modules."""
        d, v, hc = self.dim, self.vocab_size, self.hc_mult
        hc_head = hc * hc * d + hc + 1
        lookup = v * d
        total = lookup + (0 if self.tie_word_embeddings else v * d) + d + hc_head  # + final norm, hc_head
        active = total - lookup
        layers = list(range(self.n_layers))
        if include_mtp:
            layers += [self.n_layers + k for k in range(self.n_mtp_layers)]
            mtp = self.n_mtp_layers * (2 * d * d + 3 * d + hc_head)  # e_proj, h_proj, enorm, hnorm, norm, hc_head
            total, active = total + mtp, active + mtp
        for i in layers:
            p = self.layer_params(i)
            dense = p["attention"] + p["mhc"] + p["ffn"]
            total += dense + p["routed"]
            active += dense + p["routed"] * self.n_activated_experts // self.n_routed_experts
        return {"total": total, "activated": active}


# what from_hf_config reads or rewrites (the rest of a config.json travels in ``extra``); the quantisation
# fields describe a file, not the model, and are written by save_hf_checkpoint when it quantises
_HF_READ_BASE = {
    "architectures", "model_type", "layer_types", "compress_rates", "compress_ratios", "mlp_layer_types",
    "num_hash_layers", "qk_rope_head_dim", "partial_rotary_factor", "rope_parameters", "rope_scaling",
    "num_key_value_heads", "hidden_act", "attention_bias", "mlp_bias", "norm_topk_prob", "quantization_config",
    "expert_dtype", "torch_dtype", "dtype", "compress_rate_csa", "compress_rate_hca", "transformers_version",
}

_DEFAULT_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}

# our field -> HF config.json key (the names both spellings share)
_HF_FIELDS = {
    "vocab_size": "vocab_size", "dim": "hidden_size", "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads", "q_lora_rank": "q_lora_rank", "head_dim": "head_dim",
    "o_groups": "o_groups", "o_lora_rank": "o_lora_rank", "window_size": "sliding_window",
    "index_n_heads": "index_n_heads", "index_head_dim": "index_head_dim", "index_topk": "index_topk",
    "n_routed_experts": "n_routed_experts", "n_shared_experts": "n_shared_experts",
    "n_activated_experts": "num_experts_per_tok", "moe_inter_dim": "moe_intermediate_size",
    "score_func": "scoring_func", "route_scale": "routed_scaling_factor", "swiglu_limit": "swiglu_limit",
    "hc_mult": "hc_mult", "hc_sinkhorn_iters": "hc_sinkhorn_iters", "hc_eps": "hc_eps",
    "max_seq_len": "max_position_embeddings", "rope_theta": "rope_theta",
    "compress_rope_theta": "compress_rope_theta", "n_mtp_layers": "num_nextn_predict_layers",
    "norm_eps": "rms_norm_eps", "tie_word_embeddings": "tie_word_embeddings",
    "bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "init_std": "initializer_range",
}

_HF_READ = _HF_READ_BASE | set(_HF_FIELDS.values())


def hf_model_type(folder: str | Path) -> str | None:
    """``model_type`` of ``folder/config.json`` ("deepseek_v4", "deepseek_v3", ...): which model a checkpoint folder
    holds. None when the file is unreadable or names none (the loader then says why)."""
    try:
        cfg = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return cfg.get("model_type") if isinstance(cfg, dict) else None


def _alternating(n: int, head: tuple[int, ...], first: int, second: int) -> tuple[int, ...]:
    """``head`` then ``first, second, first, ...`` up to n layers."""
    return head + tuple(first if i % 2 == 0 else second for i in range(n - len(head)))


PRESETS: dict[str, dict[str, Any]] = {
    # V4-Flash, 284B / 13B active: two window-only layers, then CSA and HCA alternating; the MTP layer
    # attends its window only.
    "deepseek_v4_flash": dict(compress_ratios=_alternating(43, (0, 0), 4, 128) + (0,)),
    # V4-Pro, 1.6T / 49B active (transformers' default schedule: two HCA layers, then HCA / CSA alternating).
    "deepseek_v4_pro": dict(dim=7168, n_layers=61, n_heads=128, q_lora_rank=1536, o_groups=16,
                            n_routed_experts=384, moe_inter_dim=3072, index_topk=1024,
                            compress_ratios=_alternating(61, (128, 128), 128, 4) + (0,)),
    # CPU-sized: every attention kind, hash and scored routing, 4 streams, MTP; sequences of a few hundred tokens
    # reach HCA's 128-token windows.
    "debug_v4": dict(vocab_size=512, dim=64, n_layers=4, n_heads=4, q_lora_rank=32, head_dim=32,
                     rope_head_dim=16, o_groups=2, o_lora_rank=16, window_size=16,
                     compress_ratios=(0, 4, 128, 4, 0), index_n_heads=16, index_head_dim=16, index_topk=8,
                     n_routed_experts=8, n_activated_experts=2, moe_inter_dim=32, n_hash_layers=1,
                     max_seq_len=4096, original_seq_len=1024, rope_factor=4.0),
}
