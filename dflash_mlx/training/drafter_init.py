"""A new drafter for a target: its config.json and its initial weights, taken from the target.

- Initialisation. The drafter's output goes through the target's LM head and its context K/V
  come from normalised target features, so the draft layers start as copies of the target
  layers right after the last feature layer (the last ``layers`` layers when fewer follow),
  by parameter name where shapes fit (quantized weights dequantized; an MoE MLP or a
  linear-attention block does not fit and keeps MLX's default init). ``hidden_norm`` copies
  the first source layer's ``input_layernorm``: with one feature layer the context K/V then
  start out exactly as that target layer computes them. ``fc`` starts as the average of the
  feature slices, ``norm`` as the target's final norm (the LM head reads its output).
- Mask token. A special token named like a mask, else the pad token, else one named
  unused/reserved, else the last vocabulary id; never an EOS id, and never a token whose
  embedding is all zeros (RMSNorm keeps zeros zero: every MASK position would get the same
  query and the block could not tell its positions apart).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import DFlashError
from ..models.drafter import Drafter
from ..models.target import Target


def pick_mask_token(tokenizer: Any, target: Target) -> int:
    """The MASK id: a mask-like special, pad, an unused/reserved special, else the last id (see module doc)."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    specials = {i: getattr(t, "content", str(t)).lower() for i, t in added.items()}

    def named(*words: str) -> list[int]:
        return [i for i, name in sorted(specials.items()) if any(w in name for w in words)]

    eos = set(tokenizer.eos_token_ids)
    for token in named("mask") + [tokenizer.pad_token_id] + named("unused", "reserved") + [target.vocab_size - 1]:
        if token is None or token in eos or not 0 <= token < target.vocab_size:
            continue
        if mx.any(target.embed(mx.array([token])) != 0).item():
            return int(token)
    raise DFlashError("found no usable mask token: every candidate is an EOS token or has an all-zero embedding")


def draft_config(target: Target, layers: int, block_size: int, layer_ids: list[int], mask_token: int) -> dict[str, Any]:
    """A z-lab style config.json for a drafter of ``target``'s shapes and rope."""
    a = target.lm.args
    rope_scaling = getattr(a, "rope_scaling", None) or {}
    rope_type = rope_scaling.get("type") or rope_scaling.get("rope_type", "default")
    if rope_type == "dynamic":
        raise DFlashError("targets with dynamic NTK rope scaling cannot be trained for yet (positions vary per block)")
    theta = getattr(a, "rope_theta", None) or (getattr(a, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "block_size": block_size,
        "dflash_config": {"mask_token_id": mask_token, "target_layer_ids": list(layer_ids)},
        "num_target_layers": target.num_layers,
        "num_hidden_layers": layers,
        "hidden_size": target.hidden_size,
        "intermediate_size": a.intermediate_size,
        "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_key_value_heads,
        "head_dim": getattr(a, "head_dim", None) or target.hidden_size // a.num_attention_heads,
        "rms_norm_eps": a.rms_norm_eps,
        "rope_theta": theta,
        "rope_scaling": rope_scaling if rope_type != "default" else None,
        "max_position_embeddings": getattr(a, "max_position_embeddings", None) or 40960,
        "layer_types": ["full_attention"] * layers,
        "sliding_window": None,
        "use_sliding_window": False,
        "attention_bias": False,
        "vocab_size": target.vocab_size,
        "tie_word_embeddings": bool(getattr(a, "tie_word_embeddings", False)),
        "dtype": str(target.dtype).split(".")[-1],
    }


def _dense_weights(module: nn.Module) -> dict[str, mx.array]:
    """A module's float weights by name, quantized linear layers dequantized."""
    weights = {k: v for k, v in tree_flatten(module.parameters()) if mx.issubdtype(v.dtype, mx.floating)}
    for name, m in module.named_modules():
        if isinstance(m, nn.QuantizedLinear):
            weights[f"{name}.weight"] = mx.dequantize(
                m.weight, m.scales, m.get("biases"), m.group_size, m.bits, mode=m.mode
            )
    return weights


def _copy_matching(dst: nn.Module, src: dict[str, mx.array]) -> None:
    own = tree_flatten(dst.parameters())
    fitting = [(k, src[k].astype(v.dtype)) for k, v in own if k in src and src[k].shape == v.shape]
    dst.load_weights(fitting, strict=False)


def init_from_target(drafter: Drafter, target: Target) -> list[int]:
    """Start from the target's own weights where shapes fit (see module doc); returns the source layers."""
    n, layers = target.num_layers, len(drafter.layers)
    start = max(0, min(drafter.target_layer_ids[-1] + 1, n - layers))
    sources = [min(start + i, n - 1) for i in range(layers)]
    for layer, j in zip(drafter.layers, sources):
        _copy_matching(layer, _dense_weights(target.body.layers[j]))
    first = _dense_weights(target.body.layers[sources[0]])
    if "input_layernorm.weight" in first:
        _copy_matching(drafter.hidden_norm, {"weight": first["input_layernorm.weight"]})
    _copy_matching(drafter.norm, _dense_weights(target.body.norm))
    n_features, hidden = len(drafter.target_layer_ids), drafter.args.hidden_size
    drafter.fc.weight = mx.concatenate([mx.eye(hidden) / n_features] * n_features, axis=1)
    return sources
