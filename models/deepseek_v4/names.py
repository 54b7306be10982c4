"""Tensor names of DeepSeek-V4 in its three spellings: ours, transformers' and DeepSeek's released checkpoint.

Ours are the release's (``embed``, ``layers.N.attn.wq_a``, ``hc_attn_fn``, ``attn_sink``, ``ape``, ``mtp.K.*``)
except the routed experts, which we hold as two ``[E, ...]`` tensors per layer (``ffn.experts.w13`` = every
expert's ``w1`` rows then ``w3`` rows, ``ffn.experts.w2``); the release stores them one expert at a time
(``ffn.experts.E.w1.weight`` ...), transformers as ``mlp.experts.gate_up_proj`` / ``down_proj`` -- our layout.
transformers has no MTP: its checkpoints carry MTP under the release's names (it skips ``mtp.*`` on load).
"""

from __future__ import annotations

import re

# leaf renames inside a layer: ours (= release) -> transformers (after ``model.layers.N.``)
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "hc_attn_fn": "attn_hc.fn", "hc_attn_base": "attn_hc.base", "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn", "hc_ffn_base": "ffn_hc.base", "hc_ffn_scale": "ffn_hc.scale",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.attn_sink": "self_attn.sinks",
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "ffn.experts.w13": "mlp.experts.gate_up_proj",
    "ffn.experts.w2": "mlp.experts.down_proj",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
_COMPRESSOR = {"wkv.weight": "kv_proj.weight", "wgate.weight": "gate_proj.weight", "ape": "position_bias",
               "norm.weight": "kv_norm.weight"}
for _ours, _theirs in _COMPRESSOR.items():
    _LAYER[f"attn.compressor.{_ours}"] = f"self_attn.compressor.{_theirs}"
    _LAYER[f"attn.indexer.compressor.{_ours}"] = f"self_attn.compressor.indexer.{_theirs}"
_TOP = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
        "norm.weight": "model.norm.weight",
        "hc_head.hc_head_fn": "model.hc_head.hc_fn", "hc_head.hc_head_base": "model.hc_head.hc_base",
        "hc_head.hc_head_scale": "model.hc_head.hc_scale"}
_TOP_RELEASE = {"hc_head.hc_head_fn": "hc_head_fn", "hc_head.hc_head_base": "hc_head_base",
                "hc_head.hc_head_scale": "hc_head_scale"}
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")
_MTP_KEY = re.compile(r"^mtp\.(\d+)\.(.+)$")


def hf_name(ours: str) -> str | None:
    """transformers' key for our tensor ``ours``; None for MTP tensors (transformers has no MTP)."""
    if ours in _TOP:
        return _TOP[ours]
    m = _LAYER_KEY.match(ours)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"
    if _MTP_KEY.match(ours):
        return None
    raise KeyError(f"no transformers name for model tensor {ours!r}")


def release_name(ours: str) -> str:
    """The released checkpoint's key for our tensor (routed experts: see ``release_expert_names``)."""
    if ours in _TOP_RELEASE:
        return _TOP_RELEASE[ours]
    if ours.startswith("mtp.") and ".hc_head.hc_head_" in ours:
        return ours.replace(".hc_head.", ".")
    return ours


def release_expert_names(ours: str, n_experts: int) -> list[tuple[str, ...]] | None:
    """For ``layers.N.ffn.experts.w13`` / ``.w2`` (or MTP's): per expert, the release keys that make it up
    (``(w1, w3)`` for w13, ``(w2,)`` for w2); None for any other tensor."""
    for ours_leaf, leaves in ((".ffn.experts.w13", ("w1", "w3")), (".ffn.experts.w2", ("w2",))):
        if ours.endswith(ours_leaf):
            prefix = ours[: -len(ours_leaf)]
            return [tuple(f"{prefix}.ffn.experts.{e}.{leaf}.weight" for leaf in leaves) for e in range(n_experts)]
    return None


# DeepSeek's released names -> transformers' (the renames transformers applies on load, in order); they leave
# transformers' own names unchanged, and also read what transformers' ``save_pretrained`` writes (release-style
# leaves under ``model.``, with the attention's ``kv_norm`` written as ``attn.norm``).
_RELEASE_TO_HF = [(re.compile(p), r) for p, r in (
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight$", "embed_tokens.weight"), (r"^head\.weight$", "lm_head.weight"),
    (r"^hc_head_fn$", "hc_head.hc_fn"), (r"^hc_head_base$", "hc_head.hc_base"),
    (r"^hc_head_scale$", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn$", ".attn_hc.fn"), (r"\.hc_attn_base$", ".attn_hc.base"), (r"\.hc_attn_scale$", ".attn_hc.scale"),
    (r"\.hc_ffn_fn$", ".ffn_hc.fn"), (r"\.hc_ffn_base$", ".ffn_hc.base"), (r"\.hc_ffn_scale$", ".ffn_hc.scale"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."), (r"\.ape$", ".position_bias"), (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."), (r"\.wkv\.", ".kv_proj."), (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."), (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
)]
_HF_TO_OURS = {v: k for k, v in _TOP.items()} | {f"model.layers.N.{v}": f"layers.N.{k}" for k, v in _LAYER.items()}
_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(w[123])\.weight$")
_RELEASE_EXPERT = re.compile(r"^(mtp\.\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")
_PART = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", 0)}


def our_name(key: str) -> tuple[str, int | None, int] | None:
    """Where checkpoint tensor ``key`` (transformers', released or ``save_pretrained``'s spelling) goes:
    ``(our tensor, expert, part)`` -- expert None for a whole tensor; part 0/1 = w1/w3 rows of ``w13`` -- or
    None when it is not a V4 tensor."""
    if key.startswith("mtp."):  # MTP keeps the release's names in every layout
        m = _RELEASE_EXPERT.match(key)
        if m:
            which, part = _PART[m.group(3)]
            return f"{m.group(1)}.ffn.experts.{which}", int(m.group(2)), part
        m = re.match(r"^(mtp\.\d+)\.(hc_head_\w+)$", key)
        return (f"{m.group(1)}.hc_head.{m.group(2)}", None, 0) if m else (key, None, 0)
    bare = key.removeprefix("model.")
    for pattern, repl in _RELEASE_TO_HF:
        bare = pattern.sub(repl, bare)
    hf = bare if bare.startswith("lm_head.") else f"model.{bare}"
    m = _HF_EXPERT.match(hf)
    if m:
        which, part = _PART[m.group(3)]
        return f"layers.{m.group(1)}.ffn.experts.{which}", int(m.group(2)), part
    m = re.match(r"^model\.layers\.(\d+)\.(.+)$", hf)
    ours = _HF_TO_OURS.get(f"model.layers.N.{m.group(2)}" if m else hf)
    if ours is None:
        return None
    return (ours.replace("layers.N.", f"layers.{m.group(1)}.") if m else ours), None, 0
