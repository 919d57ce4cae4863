"""Poolside's Laguna DFlash drafters: v1's block drafting with Laguna's attention.

What differs from v1 (``drafter.py``), as poolside publishes the checkpoints (config
``model_type: laguna`` with a ``dflash_config``):

- Each captured target layer is normed on its own (``aux_hidden_norms``) before ``fc``.
- Attention projects q, k and v in one matrix (``qkv_proj``; split q/k/v checkpoints are
  fused on load), norms q and k per head, and scales each head's output by a softplus gate
  of the block (``g_proj``).
- Every layer is sliding: all block rows see the last ``sliding_window - 1`` context
  positions, and the block is causal (``dflash_config.causal``), not bidirectional.

The drafter borrows the target's embedding and head unchanged. It drafts; it is not
trained here (``train`` makes v1 drafters).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.rope_utils import initialize_rope

from ..errors import DFlashError
from .caches import WindowKVCache
from .drafter import MLP, Blocks, Cache, DecoderLayer, Drafter, DrafterArgs

SPLIT = ("q_proj", "k_proj", "v_proj")


@dataclass
class LagunaArgs(DrafterArgs):
    qkv_bias: bool = False
    gating: str = "per-head"
    draft_vocab_size: Optional[int] = None
    eagle_aux_hidden_state_layer_ids: Optional[list[int]] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.gating != "per-head":
            raise DFlashError(f"Laguna DFlash drafter gating {self.gating!r}: only per-head gating is published")
        if set(self.layer_types) != {"sliding_attention"} or not self.sliding_window:
            raise DFlashError("a Laguna DFlash drafter's layers are all sliding_attention, with a sliding_window")
        if self.draft_vocab_size not in (None, self.vocab_size):
            raise DFlashError(f"Laguna DFlash draft_vocab_size {self.draft_vocab_size} differs from its vocab_size "
                              f"{self.vocab_size}: it drafts over the target's vocabulary")
        if "causal" in self.dflash_config and not self.dflash_config["causal"]:
            raise DFlashError("Laguna DFlash drafters draft causally (dflash_config.causal true)")


class LagunaAttention(nn.Module):
    def __init__(self, args: LagunaArgs, window: Optional[int] = None):
        super().__init__()
        self.window = window
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.scale = self.head_dim**-0.5
        dim = args.hidden_size
        self.qkv_proj = nn.Linear(dim, (self.n_heads + 2 * self.n_kv_heads) * self.head_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=False)
        self.g_proj = nn.Linear(dim, self.n_heads, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.rope = initialize_rope(self.head_dim, base=args.rope_theta, traditional=False,
                                    scaling_config=args.rope_scaling, max_position_embeddings=args.max_position_embeddings)

    def _split(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        B, T, _ = x.shape
        q, k, v = mx.split(self.qkv_proj(x), [self.n_heads * self.head_dim, (self.n_heads + self.n_kv_heads) *
                                              self.head_dim], axis=-1)
        return (q.reshape(B, T, self.n_heads, -1), k.reshape(B, T, self.n_kv_heads, -1),
                v.reshape(B, T, self.n_kv_heads, -1))

    def context_kv(self, x: mx.array, offset: Union[int, mx.array]) -> tuple[mx.array, mx.array]:
        """Keys (normed, rotated from ``offset``) and values [B, kv heads, T, d] for the rows of ``x``."""
        _, k, v = self._split(x)
        return self.rope(self.k_norm(k).transpose(0, 2, 1, 3), offset=offset), v.transpose(0, 2, 1, 3)

    def __call__(self, x: mx.array, context: mx.array, cache: Union[Cache, Blocks]) -> mx.array:
        if isinstance(cache, Blocks):
            raise DFlashError("a Laguna DFlash drafter is not trained here (train makes DFlash v1 drafters)")
        B, L, _ = x.shape
        C = context.shape[1]
        q, k, v = self._split(mx.concatenate([context, x], axis=1) if C else x)
        first = cache.offset + C  # the block's first position; the context sits right before it
        q = self.rope(self.q_norm(q[:, C:]).transpose(0, 2, 1, 3), offset=first)
        k = self.rope(self.k_norm(k).transpose(0, 2, 1, 3), offset=cache.offset)
        mask = self._mask(cache, C, L)
        k, v = cache.update_and_fetch(k, v.transpose(0, 2, 1, 3))
        out = scaled_dot_product_attention(q, k, v, cache=None, scale=self.scale, mask=mask).transpose(0, 2, 1, 3)
        gate = nn.softplus(self.g_proj(x).astype(mx.float32)).astype(out.dtype)  # one scale per head and row
        return self.o_proj((out * gate[..., None]).reshape(B, L, -1))

    @staticmethod
    def _mask(cache: Any, n_context: int, n_block: int) -> mx.array:
        """[n_block, keys]: every row sees the last ``window - 1`` context positions, and the block causally."""
        first = cache.offset + n_context
        positions = cache.key_positions(n_context + n_block)[None]
        rows = mx.arange(first, first + n_block)[:, None]
        context = (positions < first) & (positions >= first - (cache.window - 1))
        return (positions >= 0) & (context | ((positions >= first) & (positions <= rows)))


class LagunaDecoderLayer(DecoderLayer):
    def __init__(self, args: LagunaArgs, window: Optional[int] = None):
        nn.Module.__init__(self)
        self.self_attn = LagunaAttention(args, window)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class LagunaDrafter(Drafter):
    """A Laguna DFlash drafter with the published parameter names (q/k/v fused into ``qkv_proj`` on load)."""

    decoder_layer = LagunaDecoderLayer

    def __init__(self, args: LagunaArgs):
        super().__init__(args)
        self.aux_hidden_norms = [nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps) for _ in args.target_layer_ids]

    def fuse(self, features: mx.array) -> mx.array:
        parts = mx.split(features, len(self.aux_hidden_norms), axis=-1)
        return self.hidden_norm(self.fc(mx.concatenate([norm(p) for norm, p in zip(self.aux_hidden_norms, parts)],
                                                       axis=-1)))

    def make_cache(self, window: Optional[int] = None, sinks: int = 0, block_size: int = 16) -> list[Cache]:
        own = self.args.sliding_window
        return [WindowKVCache(min(own, window or own), 0, slack=2 * block_size) for _ in self.layers]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Unprefixed names, and split q/k/v projections (a Transformers export) fused as poolside's are."""
        weights = {k.removeprefix("model."): v for k, v in weights.items()}
        for i in range(len(self.layers)):
            names = [f"layers.{i}.self_attn.{p}.weight" for p in SPLIT]
            if any(n in weights for n in names):
                if not all(n in weights for n in names):
                    raise DFlashError(f"Laguna DFlash drafter layer {i} has some of q/k/v_proj but not all three")
                fused = f"layers.{i}.self_attn.qkv_proj.weight"
                if fused in weights:
                    raise DFlashError(f"Laguna DFlash drafter layer {i} has both qkv_proj and q/k/v_proj weights")
                weights[fused] = mx.concatenate([weights.pop(n) for n in names], axis=0)
        return weights
