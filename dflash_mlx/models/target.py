"""Target adapter: one forward pass of an mlx-lm model that also returns hidden features.

mlx-lm has no hook for intermediate hidden states, so the adapter runs the model's
own modules (embedding, decoder layers with the model's masks and caches, final
norm, head) in the same order ``model(x)`` does, and keeps the outputs of the
layers the drafter was trained on. Nothing is patched: two targets in one process
are two independent adapters.

Layers come in three kinds: full attention, sliding-window attention (gpt-oss,
Llama configs with ``sliding_attention``) and GatedDeltaNet linear attention
(Qwen3.5/3.6, Qwen3-Next). The last are run here step by step so that their
recurrent state can be rolled back to any prefix of a verified block.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, gather_last_axis
from mlx_lm.models.cache import KVCache
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

from ..errors import DFlashError
from .caches import RecurrentCache, WindowKVCache

# model_type values whose forward this adapter reproduces, each tested lossless.
SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next", "gpt_oss")


def check_model_type(model_type: Optional[str]) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise DFlashError(
            f"target architecture {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def _layer_kind(layer: nn.Module, layer_type: Optional[str]) -> str:
    if getattr(layer, "is_linear", False):
        return "linear"
    if getattr(layer, "use_sliding", False) or layer_type == "sliding_attention":
        return "sliding"
    return "full"


def _fused_recurrence() -> bool:
    """Whether gated_delta_update runs mlx-lm's fused Metal kernel here (GPU default device)."""
    return mx.default_device() == mx.gpu and mx.metal.is_available()


def _gated_delta_net(gdn: nn.Module, x: mx.array, cache: RecurrentCache, undoable: bool) -> mx.array:
    """mlx-lm's GatedDeltaNet forward (Qwen3.5 and Qwen3-Next layouts).

    With ``undoable`` it leaves a replay in the cache, which keeps this update's
    projections (and per-step states) alive until the next update: only a verify,
    which may be rolled back, asks for it; a prefill chunk does not.
    """
    B, S, _ = x.shape
    if hasattr(gdn, "in_proj_qkvz"):  # Qwen3-Next packs the projections
        q, k, v, z, b, a = gdn.fix_query_key_value_ordering(gdn.in_proj_qkvz(x), gdn.in_proj_ba(x))
        mixed = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
    else:
        mixed = gdn.in_proj_qkv(x)
        z = gdn.in_proj_z(x).reshape(B, S, gdn.num_v_heads, gdn.head_v_dim)
        b, a = gdn.in_proj_b(x), gdn.in_proj_a(x)
    n_keep = gdn.conv_kernel_size - 1
    conv_state = cache[0] if cache[0] is not None else mx.zeros((B, n_keep, gdn.conv_dim), dtype=x.dtype)
    conv_input = mx.concatenate([conv_state, mixed], axis=1)
    conv_out = nn.silu(gdn.conv1d(conv_input))
    q, k, v = [
        t.reshape(B, S, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [gdn.key_dim, 2 * gdn.key_dim], -1),
            [gdn.num_k_heads, gdn.num_k_heads, gdn.num_v_heads],
            [gdn.head_k_dim, gdn.head_k_dim, gdn.head_v_dim],
        )
    ]
    q, k = normalize_qk(q, k, inv_scale=gdn.head_k_dim**-0.5, eps=1e-6)
    old_state = cache[1]

    def recurrence(end: int, state: Optional[mx.array], start: int = 0) -> tuple[mx.array, mx.array]:
        s = slice(start, end)
        return gated_delta_update(
            q[:, s], k[:, s], v[:, s], a[:, s], b[:, s], gdn.A_log, gdn.dt_bias, state, None, use_kernel=not gdn.training
        )

    if undoable and cache.step_states and S <= cache.slack:
        # One token at a time: what mlx-lm's ops path does anyway, keeping each state.
        outs, steps, state = [], [], old_state
        for t in range(S):
            o, state = recurrence(t + 1, state, start=t)
            outs.append(o)
            steps.append(state)
        out = mx.concatenate(outs, axis=1)
    else:
        out, state = recurrence(S, old_state)
        steps = []

    def replay(keep: int) -> tuple[mx.array, mx.array]:
        if keep == 0:
            return conv_state, old_state
        kept = steps[keep - 1] if steps else recurrence(keep, old_state)[1]
        return mx.contiguous(conv_input[:, keep : keep + n_keep]), kept

    cache.record(mx.contiguous(conv_input[:, -n_keep:]), state, replay if undoable else None, S)
    out = gdn.out_proj(gdn.norm(out, z).reshape(B, S, -1))
    group = getattr(gdn, "sharding_group", None)  # sharded: this rank's heads (and state) only, summed here
    return out if group is None else mx.distributed.all_sum(out, group=group)


class Target:
    """A loaded mlx-lm causal LM plus the layer ids whose outputs feed the drafter."""

    def __init__(self, model: nn.Module, layer_ids: Sequence[int], group: Optional[mx.distributed.Group] = None):
        lm = getattr(model, "language_model", model)  # Qwen3.5 wraps its text model
        self.group = group  # the ranks this model is sharded over (model.shard), None on one machine
        self.model_type = getattr(model, "model_type", None) or model.args.model_type
        check_model_type(self.model_type)
        self.model = model
        self.lm = lm
        self.body = lm.model
        layer_types = getattr(self.body, "layer_types", None) or [None] * len(self.body.layers)
        self.kinds = [_layer_kind(layer, t) for layer, t in zip(self.body.layers, layer_types)]
        self.sliding_window = getattr(self.body, "sliding_window", None) or getattr(self.body, "window_size", None)
        self.layer_ids = list(layer_ids)
        n = self.num_layers
        bad = [i for i in self.layer_ids if not 0 <= i < n]
        if bad:
            raise DFlashError(
                f"drafter target_layer_ids {self.layer_ids} out of range for a {n}-layer target (bad: {bad})"
            )
        self._capture = set(self.layer_ids)  # a layer listed twice is captured once, used twice
        self.source: Optional[Path] = None  # the folder it was loaded from (``load`` sets it)
        self.adapter: Optional[Path] = None  # the LoRA adapter folder applied to it, if any

    @property
    def num_layers(self) -> int:
        return len(self.body.layers)

    @property
    def hidden_size(self) -> int:
        return self.lm.args.hidden_size

    @property
    def head_dim(self) -> int:
        args = self.lm.args
        return getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding: every id the model takes, added tokens included."""
        return self.body.embed_tokens.weight.shape[0]

    @property
    def max_positions(self) -> Optional[int]:
        """The most positions the model was made for (its config's max_position_embeddings), if it says."""
        return getattr(self.lm.args, "max_position_embeddings", None)

    @property
    def dtype(self) -> mx.Dtype:
        """The float dtype activations run in (scales dtype for quantized embeddings)."""
        emb = self.body.embed_tokens
        return emb.scales.dtype if hasattr(emb, "scales") else emb.weight.dtype

    def make_cache(self, window: Optional[int] = None, sinks: int = 0, slack: int = 16) -> list[Any]:
        """Per-layer caches that can roll back ``slack`` tokens.

        Without ``window`` full-attention layers keep everything (exact full
        attention). With it they keep ``sinks`` + the last ``window`` positions.
        Layers with their own sliding window keep theirs, in a cache that can
        roll back (mlx-lm's RotatingKVCache cannot once it wraps). Linear-attention
        layers hold a fixed-size recurrent state whatever the window.
        """
        caches: list[Any] = []
        for kind in self.kinds:
            if kind == "linear":
                caches.append(RecurrentCache(slack, step_states=not _fused_recurrence()))
            elif kind == "sliding":
                caches.append(WindowKVCache(self.sliding_window, 0, slack))
            elif window is not None:
                caches.append(WindowKVCache(window, sinks, slack))
            else:
                caches.append(KVCache())
        return caches

    def embed(self, tokens: mx.array) -> mx.array:
        return self.body.embed_tokens(tokens)

    def lm_head(self, h: mx.array) -> mx.array:
        if not hasattr(self.lm, "lm_head"):
            return self.body.embed_tokens.as_linear(h)
        logits = self.lm.lm_head(h)
        group = getattr(self.lm, "sharding_group", None)  # sharded: this rank's slice of the vocabulary
        return logits if group is None else gather_last_axis(logits, group)

    def __call__(
        self, tokens: mx.array, cache: list[Any], last_logits_only: bool = False, undoable: bool = True
    ) -> tuple[mx.array, mx.array]:
        """Logits and the concatenated features of ``layer_ids`` for ``tokens`` ([1, L]).

        A layer's feature is its output, except the last layer's: that one is taken
        after the final norm, as z-lab's code takes it (Transformers' last
        ``hidden_states`` entry is normed), so a drafter trained there drafts the same.
        ``last_logits_only`` skips the vocabulary projection for all but the last
        position (prefill needs one next token, not L of them). ``undoable=False``
        (prefill) keeps no recurrent replay: the update cannot be rolled back.
        """
        h = self.embed(tokens)
        masks: dict[str, Any] = {}
        for i, kind in enumerate(self.kinds):
            if kind not in masks:
                window = self.sliding_window if kind == "sliding" else None
                masks[kind] = None if kind == "linear" else create_attention_mask(h, cache[i], window_size=window)
        captured: dict[int, mx.array] = {}
        for i, (layer, c, kind) in enumerate(zip(self.body.layers, cache, self.kinds)):
            if kind == "linear":
                h = h + _gated_delta_net(layer.linear_attn, layer.input_layernorm(h), c, undoable)
                h = h + layer.mlp(layer.post_attention_layernorm(h))
            else:
                h = layer(h, masks[kind], c)
            if i in self._capture:
                captured[i] = h
        last = self.num_layers - 1
        if last in self._capture:
            captured[last] = h = self.body.norm(h)
        else:
            h = self.body.norm(h[:, -1:] if last_logits_only else h)
        logits = self.lm_head(h[:, -1:] if last_logits_only else h)
        if not self.layer_ids:  # loaded alone: no drafter reads features
            return logits, h[..., :0]
        return logits, mx.concatenate([captured[i] for i in self.layer_ids], axis=-1)
