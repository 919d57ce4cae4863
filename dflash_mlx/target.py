"""Target adapter: one forward pass of an mlx-lm model that also returns hidden features.

mlx-lm has no hook for intermediate hidden states, so the adapter runs the model's
own modules (embedding, decoder layers with the model's masks and caches, final
norm, head) in the same order ``model(x)`` does, and keeps the outputs of the
layers the drafter was trained on. Nothing is patched: two targets in one process
are two independent adapters.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from .caches import WindowKVCache
from .errors import DFlashError

# model_type values whose layer loop `_forward` reproduces exactly.
SUPPORTED_MODEL_TYPES = ("llama", "qwen3")


class Target:
    """A loaded mlx-lm causal LM plus the layer ids whose outputs feed the drafter."""

    def __init__(self, model: nn.Module, layer_ids: Sequence[int]):
        model_type = getattr(model, "model_type", None) or model.args.model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise DFlashError(
                f"target architecture {model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        self.model = model
        self.model_type = model_type
        self.body = model.model
        self.layer_ids = list(layer_ids)
        n = self.num_layers
        bad = [i for i in self.layer_ids if not 0 <= i < n]
        if bad:
            raise DFlashError(
                f"drafter target_layer_ids {self.layer_ids} out of range for a "
                f"{n}-layer target (bad: {bad})"
            )
        self._capture = {i: k for k, i in enumerate(self.layer_ids)}

    @property
    def num_layers(self) -> int:
        return len(self.body.layers)

    @property
    def hidden_size(self) -> int:
        return self.model.args.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.body.embed_tokens.weight.shape[0]

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
        roll back (mlx-lm's RotatingKVCache cannot once it wraps).
        """
        own_window = getattr(self.body, "sliding_window", None)
        caches: list[Any] = []
        for layer in self.body.layers:
            if getattr(layer, "use_sliding", False):
                caches.append(WindowKVCache(own_window, 0, slack))
            elif window is not None:
                caches.append(WindowKVCache(window, sinks, slack))
            else:
                caches.append(KVCache())
        return caches

    def embed(self, tokens: mx.array) -> mx.array:
        return self.body.embed_tokens(tokens)

    def lm_head(self, h: mx.array) -> mx.array:
        if hasattr(self.model, "lm_head"):
            return self.model.lm_head(h)
        return self.body.embed_tokens.as_linear(h)

    def __call__(
        self, tokens: mx.array, cache: list[Any], last_logits_only: bool = False
    ) -> tuple[mx.array, mx.array]:
        """Logits and the concatenated features of ``layer_ids`` for ``tokens`` ([1, L]).

        ``last_logits_only`` skips the vocabulary projection for all but the last
        position (prefill needs one next token, not L of them).
        """
        h = self.embed(tokens)
        full_mask = create_attention_mask(h, cache[getattr(self.body, "fa_idx", 0)])
        window = getattr(self.body, "sliding_window", None)
        swa_idx = getattr(self.body, "swa_idx", None)
        swa_mask = (
            create_attention_mask(h, cache[swa_idx], window_size=window)
            if swa_idx is not None
            else None
        )
        features: list[mx.array] = [None] * len(self.layer_ids)  # type: ignore[list-item]
        for i, (layer, c) in enumerate(zip(self.body.layers, cache)):
            h = layer(h, swa_mask if getattr(layer, "use_sliding", False) else full_mask, c)
            if i in self._capture:
                features[self._capture[i]] = h
        if last_logits_only:
            h = h[:, -1:]
        logits = self.lm_head(self.body.norm(h))
        return logits, mx.concatenate(features, axis=-1)

    @staticmethod
    def rollback(cache: list[Any], n: int) -> None:
        """Forget the last ``n`` positions of every layer's cache (rejected draft tokens)."""
        if n == 0:
            return
        for c in cache:
            if not c.is_trimmable() or c.trim(n) != n:
                raise RuntimeError(f"cannot roll back {n} tokens in {type(c).__name__}")
