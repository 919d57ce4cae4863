"""A new drafter for a target: its config.json and its initial weights, taken from the target.

- Initialisation. The drafter's output goes through the target's LM head and its context K/V
  come from normalised target features, so the draft layers start as copies of the target
  layers right after the last feature layer (the last ``layers`` layers when fewer follow),
  by parameter name where shapes fit (quantized weights dequantized; an MoE MLP or a
  linear-attention block does not fit and keeps MLX's default init). Norms take the scale the
  target's apply (Gemma's scale by 1 + weight; a LayerNorm is not copied). ``hidden_norm`` takes
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
    """A z-lab style config.json for a drafter of ``target``'s hidden size, attention shape and rope where it has
    them (a recurrent target has no heads to copy: the drafter gets heads of 64), its embedding as the target's
    forward scales it and its head's output transforms (``Target.embed``, ``Target.logit_transforms``)."""
    a = target.args
    rope_scaling = getattr(a, "rope_scaling", None) or {}
    rope_type = rope_scaling.get("type") or rope_scaling.get("rope_type", "default")
    if rope_type == "dynamic":
        raise DFlashError("targets with dynamic NTK rope scaling cannot be trained for yet (positions vary per block)")
    theta = getattr(a, "rope_theta", None) or (getattr(a, "rope_parameters", None) or {}).get("rope_theta")
    hidden = target.hidden_size
    heads = getattr(a, "num_attention_heads", None) or max(1, hidden // 64)
    head_dim = getattr(a, "head_dim", None) or hidden // heads
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "block_size": block_size,
        "dflash_config": {"mask_token_id": mask_token, "target_layer_ids": list(layer_ids), **target.logit_transforms},
        "num_target_layers": target.num_layers,
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "intermediate_size": getattr(a, "intermediate_size", None) or 3 * hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(a, "num_key_value_heads", None) or heads,
        "head_dim": head_dim if isinstance(head_dim, int) else hidden // heads,
        "rms_norm_eps": getattr(a, "rms_norm_eps", None) or 1e-6,
        "rope_theta": theta if isinstance(theta, (int, float)) else 10000.0,
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
    """A module's float weights by name, quantized linear layers dequantized; norms left out (``_copy_norms``)."""
    norms = {name for name, m in module.named_modules() if name and _is_norm(m)}
    weights = {k: v for k, v in tree_flatten(module.parameters())
               if mx.issubdtype(v.dtype, mx.floating) and k.rsplit(".", 1)[0] not in norms}
    for name, m in module.named_modules():
        if isinstance(m, nn.QuantizedLinear):
            weights[f"{name}.weight"] = mx.dequantize(
                m.weight, m.scales, m.get("biases"), m.group_size, m.bits, mode=m.mode
            )
    return weights


def _is_norm(m: nn.Module) -> bool:
    return "norm" in type(m).__name__.lower()


def _norm_scale(norm: nn.Module, size: int) -> Any:
    """What a norm multiplies a vector of RMS 1 by, per channel: its weight for an ``nn.RMSNorm``, 1 + weight for
    Gemma's. None for one that centres (a LayerNorm makes a constant vector zero) or takes another size."""
    try:
        out = norm(mx.ones((1, size), dtype=mx.float32)).reshape(-1)
    except (ValueError, TypeError):
        return None
    return None if out.size != size or not mx.any(out != 0).item() else out


def _copy_norms(dst: nn.Module, src: nn.Module) -> None:
    """Each RMSNorm of ``dst`` takes the scale its namesake in ``src`` applies (``_norm_scale``)."""
    sources = dict(src.named_modules())
    for name, m in dst.named_modules():
        if isinstance(m, nn.RMSNorm) and name in sources:
            scale = _norm_scale(sources[name], m.weight.shape[0])
            if scale is not None:
                m.weight = scale.astype(m.weight.dtype)


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
        _copy_matching(layer, _dense_weights(target.layers[j]))
        _copy_norms(layer, target.layers[j])
    first = dict(target.layers[sources[0]].named_modules()).get("input_layernorm")
    scale = None if first is None else _norm_scale(first, drafter.args.hidden_size)
    if scale is not None:
        drafter.hidden_norm.weight = scale.astype(drafter.hidden_norm.weight.dtype)
    scale = None if target.norm is None else _norm_scale(target.norm, drafter.args.hidden_size)
    if scale is not None:
        drafter.norm.weight = scale.astype(drafter.norm.weight.dtype)
    n_features, hidden = len(drafter.target_layer_ids), drafter.args.hidden_size
    drafter.fc.weight = mx.concatenate([mx.eye(hidden) / n_features] * n_features, axis=1)
    return sources
