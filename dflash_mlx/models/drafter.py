"""The DFlash drafter: a small Qwen3-style stack that drafts a whole block in one pass.

It has no embedding and no LM head of its own; the target lends both. Context comes
from target hidden states, fused by ``fc`` + ``hidden_norm`` and injected as extra
keys/values in every layer, so the block attends to the committed context and,
bidirectionally in every layer, to itself. A sliding layer only limits how much
context each block row sees.

Inference passes per-layer context caches; training passes ``Blocks`` (many blocks
of a batch at once, explicit positions and masks) through the same modules, so a
layer cannot train differently from how it drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.activations import swiglu
from mlx_lm.models.base import BaseModelArgs, scaled_dot_product_attention
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from ..errors import DFlashError
from ..sampling import Proposal, Sampling
from .caches import WindowKVCache
from .vocabulary import DraftVocabulary

if TYPE_CHECKING:
    from .target import Target

Cache = Union[KVCache, WindowKVCache]

# How many context positions a drafter attends to unless its bundle or the caller says otherwise (0: all of them).
# The published drafters are trained on short contexts; see docs/long-contexts.md, "Long prompts", for the measurement.
DRAFT_WINDOW = 0
GEMMA4_MASK_TOKEN = 4


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The rule older checkpoints rely on when ``target_layer_ids`` is absent."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass
class DrafterArgs(BaseModelArgs):
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    num_target_layers: int
    head_dim: Optional[int] = None
    rms_norm_eps: float = 1e-6
    rope_theta: Optional[float] = None
    rope_scaling: Optional[dict[str, Any]] = None
    rope_parameters: Optional[dict[str, Any]] = None
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    block_size: int = 16
    dflash_config: dict[str, Any] = field(default_factory=dict)
    layer_types: Optional[list[str]] = None
    sliding_window: Optional[int] = None
    is_causal: Optional[bool] = None
    model_type: Optional[str] = None
    final_logit_softcapping: Optional[float] = None  # Transformers 5 exports (Gemma 4) keep it at the top level

    def __post_init__(self) -> None:
        # transformers >= 5 nests the rope settings under rope_parameters.
        if self.rope_parameters:
            if self.rope_theta is None:
                self.rope_theta = self.rope_parameters.get("rope_theta")
            if self.rope_scaling is None and self.rope_parameters.get("rope_type", "default") != "default":
                self.rope_scaling = self.rope_parameters
        if self.rope_theta is None:
            self.rope_theta = 1_000_000.0
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise DFlashError(
                f"drafter layer_types lists {len(self.layer_types)} layers, config has {self.num_hidden_layers}"
            )
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise DFlashError("drafter has sliding_attention layers but no sliding_window")
        if self.is_causal:
            # z-lab's code ignores the flag and drafts bidirectionally; refusing beats guessing.
            raise DFlashError("drafter config says is_causal: true, but DFlash drafts attend bidirectionally")

    def value(self, name: str, default: Any = None) -> Any:
        """A setting from dflash_config, else the top-level config (as the reference reads them)."""
        return self.dflash_config.get(name, getattr(self, name, default))

    def layer_window(self, i: int) -> Optional[int]:
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    @property
    def mask_token_id(self) -> int:
        if "mask_token_id" in self.dflash_config:
            return int(self.dflash_config["mask_token_id"])
        if str(self.model_type).startswith("gemma4"):  # z-lab's Gemma 4 drafters leave out Gemma's <mask> (id 4)
            return GEMMA4_MASK_TOKEN
        raise DFlashError("drafter config has no dflash_config.mask_token_id")

    @property
    def target_layer_ids(self) -> list[int]:
        ids = self.dflash_config.get("target_layer_ids")
        if ids is None:
            return default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        return [int(i) for i in ids]


def block_mask(anchors: np.ndarray, context_len: int, block_size: int, window: Optional[int] = None) -> np.ndarray:
    """Boolean [N*B, context_len]: may block row q (of blocks anchored at ``anchors``) see context position k.

    A block sees the context strictly before its anchor (the anchor's own features are not known
    when it drafts); it sees all of its own block, in both directions, and no other block (the
    attention takes its own block apart: ``Attention._blocks_attention``). With ``window`` W, row i
    at position anchor + i sees only context k with anchor + i - k < W, the public DFlash training
    recipe's rule (``WindowKVCache.block_mask`` at inference).
    """
    anchors = np.asarray(anchors)
    rows = (anchors[:, None] + np.arange(block_size)).reshape(-1, 1)  # absolute position of each row
    starts = np.repeat(anchors, block_size)[:, None]
    k = np.arange(context_len)[None, :]
    context = k < starts
    if window is not None:
        context &= rows - k < window
    return context


@dataclass
class Blocks:
    """Training input in place of the caches: N blocks per sequence, over the whole context at once.

    ``anchors`` [S, N] are the absolute positions of each block's first row; the
    context (features of positions 0..L-1) sits at its own positions. Masks come
    from ``block_mask`` for each layer's window.
    """

    anchors: np.ndarray
    context_len: int
    block_size: int
    window: Optional[int] = None  # a context window over every layer (a drafter window: ``CacheLayout.draft_window``)
    _masks: dict[Optional[int], mx.array] = field(default_factory=dict, repr=False)

    def mask(self, window: Optional[int]) -> mx.array:
        """[S, 1, 1, N, B, L]: which context positions each row sees, for a layer with this window (None: full
        attention), within ``self.window``."""
        if self.window is not None:
            window = self.window if window is None else min(window, self.window)
        if window not in self._masks:
            masks = [block_mask(a, self.context_len, self.block_size, window) for a in self.anchors]
            S, N = self.anchors.shape
            self._masks[window] = mx.array(np.stack(masks)).reshape(S, 1, 1, N, self.block_size, self.context_len)
        return self._masks[window]


class Attention(nn.Module):
    def __init__(self, args: DrafterArgs, window: Optional[int] = None):
        super().__init__()
        self.window = window  # a sliding layer's window over the context
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = head_dim = args.head_dim
        self.scale = head_dim**-0.5
        dim, bias = args.hidden_size, args.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=bias)
        self.q_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
        self.rope = initialize_rope(
            head_dim,
            base=args.rope_theta,
            traditional=False,
            scaling_config=args.rope_scaling,
            max_position_embeddings=args.max_position_embeddings,
        )

    def context_kv(self, x: mx.array, offset: Union[int, mx.array]) -> tuple[mx.array, mx.array]:
        """Keys (normed, rotated from ``offset``) and values [B, kv heads, T, d] for the rows of ``x``."""
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(B, T, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, T, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return self.rope(k, offset=offset), v

    def queries(self, x: mx.array, offset: Union[int, mx.array]) -> mx.array:
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        return self.rope(q, offset=offset)

    def __call__(self, x: mx.array, context: mx.array, cache: Union[Cache, Blocks]) -> mx.array:
        B, L, _ = x.shape
        if isinstance(cache, Blocks):
            return self.o_proj(self._blocks_attention(x, context, cache).reshape(B, L, -1))
        C = context.shape[1]
        # One projection over [new context ; block]: both parts share k/v weights.
        # Context sits at its absolute positions, the block right after it.
        k, v = self.context_kv(mx.concatenate([context, x], axis=1) if C else x, cache.offset)
        q = self.queries(x, cache.offset + C)
        mask = cache.block_mask(C, L) if isinstance(cache, WindowKVCache) else None
        k, v = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(q, k, v, cache=None, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def _blocks_attention(self, x: mx.array, context: mx.array, blocks: Blocks) -> mx.array:
        """Training's attention, [S, N*B, heads, d]: each block over the context before its anchor and over itself.

        Each block is rotated from its own anchor. Its scores are taken against the context and against its own
        rows apart, then softmaxed together: one mask over [context ; every block of the sequence] computed
        N*B scores per row for the B it keeps, and softmax's exponentials are most of a step on a CPU
        (``bench/train_speed.py`` times both).
        """
        S, T, H = x.shape
        n, b = T // blocks.block_size, blocks.block_size
        kv, rep = self.n_kv_heads, self.n_heads // self.n_kv_heads
        offsets = mx.array(blocks.anchors.reshape(-1))
        per_block = x.reshape(S * n, b, H)  # one row per block, so that each gets its own RoPE offset
        q = self.queries(per_block, offsets) * self.scale  # [S*n, heads, b, d]
        block_k, block_v = self.context_kv(per_block, offsets)  # [S*n, kv, b, d]
        context_k, context_v = self.context_kv(context, 0)  # [S, kv, L, d]
        L = context_k.shape[2]
        # Queries grouped by their kv head: [S, n, kv, rep, b, d], and [S, kv, rep, n*b, d] for the shared context.
        q = q.reshape(S, n, kv, rep, b, -1)
        by_context = q.transpose(0, 2, 3, 1, 4, 5).reshape(S, kv, rep, n * b, -1)
        to_context = (by_context @ context_k[:, :, None].swapaxes(-1, -2)).reshape(S, kv, rep, n, b, L)
        block_k = block_k.reshape(S, n, kv, 1, b, -1)
        to_block = (q @ block_k.swapaxes(-1, -2)).transpose(0, 2, 3, 1, 4, 5)  # [S, kv, rep, n, b, b]
        to_context = mx.where(blocks.mask(self.window), to_context, mx.finfo(to_context.dtype).min)
        p = mx.softmax(mx.concatenate([to_context, to_block], axis=-1), axis=-1, precise=True)
        out = p[..., :L].reshape(S, kv, rep, n * b, L) @ context_v[:, :, None]  # [S, kv, rep, n*b, d]
        own = p[..., L:].transpose(0, 3, 1, 2, 4, 5) @ block_v.reshape(S, n, kv, 1, b, -1)  # [S, n, kv, rep, b, d]
        out = out.reshape(S, kv, rep, n, b, -1) + own.transpose(0, 2, 3, 1, 4, 5)
        return out.reshape(S, kv * rep, n * b, -1).transpose(0, 2, 1, 3)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, args: DrafterArgs, window: Optional[int] = None):
        super().__init__()
        self.self_attn = Attention(args, window)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, context: mx.array, cache: Union[Cache, Blocks]) -> mx.array:
        # The fused context is already normalised by hidden_norm: only the block
        # goes through input_layernorm.
        h = x + self.self_attn(self.input_layernorm(x), context, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Drafter(nn.Module):
    """A DFlash draft model with the published (unprefixed) parameter names."""

    decoder_layer = DecoderLayer  # a drafter kind with other layers (DFlash2) swaps this

    def __init__(self, args: DrafterArgs):
        super().__init__()
        self.args = args
        n_features = len(args.target_layer_ids)
        self.fc = nn.Linear(n_features * args.hidden_size, args.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.layers = [self.decoder_layer(args, args.layer_window(i)) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.context_window = DRAFT_WINDOW  # a bundle's own, once loaded from one
        self.vocabulary: Optional[DraftVocabulary] = None  # the tokens it drafts from; None: the target's all

    @property
    def block_size(self) -> int:
        return int(self.args.value("block_size", 16))

    @property
    def input_embedding_scale(self) -> float:
        return float(self.args.value("input_embedding_scale", 1.0))

    def compute_logits(self, logits: mx.array) -> mx.array:
        """The published output transforms (multiplier, soft-capping) over the target head's logits."""
        multiplier = float(self.args.value("output_multiplier", 1.0))
        if multiplier != 1.0:
            logits = logits * multiplier
        softcap = self.args.value("final_logit_softcapping")
        if softcap:
            logits = mx.tanh(logits / float(softcap)) * float(softcap)
        return logits

    @property
    def mask_token_id(self) -> int:
        return self.args.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return self.args.target_layer_ids

    def make_cache(self, window: Optional[int] = None, sinks: int = 0, block_size: int = 16) -> list[Cache]:
        """Context caches, one per layer.

        Sliding layers keep their own window, others the user's (if any). A
        windowed update holds new context plus a block, hence 2B of slack.
        """
        caches: list[Cache] = []
        for i in range(len(self.layers)):
            own = self.args.layer_window(i)
            if own is not None:
                caches.append(WindowKVCache(min(own, window or own), 0, slack=2 * block_size))
            elif window is not None:
                caches.append(WindowKVCache(window, sinks, slack=2 * block_size))
            else:
                caches.append(KVCache())
        return caches

    def fuse(self, features: mx.array) -> mx.array:
        """The context the layers take from the target's features (its chosen layers, concatenated)."""
        return self.hidden_norm(self.fc(features))

    def add_context(self, features: mx.array, cache: list[Cache]) -> None:
        """Append context K/V without drafting (prefill): only fc, hidden_norm and k/v projections run."""
        context = self.fuse(features)
        for layer, c in zip(self.layers, cache):
            c.update_and_fetch(*layer.self_attn.context_kv(context, c.offset))

    def __call__(self, block: mx.array, features: mx.array, cache: Union[list[Cache], Blocks]) -> mx.array:
        """Hidden states of the block, given its embeddings and the new context features.

        ``features`` are target hidden states (the chosen layers, concatenated) of
        tokens not yet in ``cache``. Their K/V are appended to the cache; the block's
        own K/V are dropped again, so the cache holds committed context only.
        With ``Blocks`` (training) the features are the whole context and nothing is kept.
        """
        context = self.fuse(features)
        caches = [cache] * len(self.layers) if isinstance(cache, Blocks) else cache
        h = block
        for layer, c in zip(self.layers, caches):
            h = layer(h, context, c)
        if not isinstance(cache, Blocks):
            for c in cache:
                c.trim(block.shape[1])
        return self.norm(h)

    def embed_blocks(self, target: "Target", blocks: mx.array) -> mx.array:
        """The target's embeddings of block tokens [S, L], scaled as this drafter's inputs are."""
        embeddings = target.embed(blocks)
        return embeddings * self.input_embedding_scale if self.input_embedding_scale != 1.0 else embeddings

    def draft_hidden(
        self, target: "Target", last: mx.array, context: Optional[mx.array], cache: list[Cache], n: int
    ) -> mx.array:
        """Final hidden states [n, H] of the drafted positions of [last, MASK x n]; the pass absorbs ``context``."""
        if context is None:  # everything committed is in the caches already
            context = mx.zeros((1, 0, len(self.target_layer_ids) * self.args.hidden_size), dtype=target.dtype)
        block = mx.concatenate([last, mx.full((n,), self.mask_token_id, dtype=last.dtype)])
        return self(self.embed_blocks(target, block[None]), context, cache)[0, 1:]

    def head_logits(self, target: "Target", h: mx.array) -> mx.array:
        """Logits of final hidden states over the tokens this drafter drafts: the target's vocabulary, or its
        own (``vocabulary``: position i is token ``vocabulary.ids[i]``)."""
        head = target.lm_head if self.vocabulary is None else self.vocabulary.head(target)
        return self.compute_logits(head(h))

    def tokens(self, index: mx.array) -> mx.array:
        """Target token ids of positions in ``head_logits``' last axis."""
        return index if self.vocabulary is None else self.vocabulary.tokens(index)

    def draft_logits(
        self, target: "Target", last: mx.array, context: Optional[mx.array], cache: list[Cache], n: int
    ) -> mx.array:
        """``head_logits`` [n, V'] for the block [last, MASK x n], from one pass that also absorbs ``context``."""
        return self.head_logits(target, self.draft_hidden(target, last, context, cache, n))

    def propose(
        self, target: "Target", last: mx.array, context: Optional[mx.array], cache: list[Cache], n: int,
        sampling: Sampling, key: Optional[mx.array],
    ) -> Proposal:
        """Draft ``n`` tokens after ``last``; at temperature > 0 also the distribution they came from.

        A drafter kind with another proposal (a subclass) overrides this; the decode
        loop and verification take whatever ``Proposal`` it returns.
        """
        logits = self.draft_logits(target, last, context, cache, n)
        if sampling.greedy:
            return Proposal(self.tokens(mx.argmax(logits, axis=-1)))
        q = sampling.logprobs(logits)
        drawn = mx.random.categorical(q, key=key)
        if self.vocabulary is None:
            return Proposal(drawn, q)
        return Proposal(self.vocabulary.tokens(drawn), self.vocabulary.expand(q))

    def tensors(self) -> dict[str, mx.array]:
        """What its checkpoint holds: the weights, and its vocabulary where it has one."""
        weights = dict(tree_flatten(self.parameters()))
        return weights if self.vocabulary is None else {**weights, **self.vocabulary.tensors()}


class NoDrafter:
    """What stands in for the drafter of a target loaded alone: it never drafts.

    Cycles are plain steps, or copy drafts (the history's own continuation, verified
    like any draft) where the policy finds they pay; up to ``block_size - 1`` copied
    tokens a cycle. It holds no weights, no context and no caches.
    """

    target_layer_ids: list[int] = []  # the target keeps no features for it

    def __init__(self, block_size: int = 16) -> None:
        self.block_size = block_size
        self.source: Optional[Path] = None  # a saved prompt cache records the drafter it was made with: none

    def make_cache(self, window: Optional[int] = None, sinks: int = 0, block_size: int = 16) -> list[Cache]:
        return []

    def propose(self, *args: Any, **kwargs: Any) -> Any:
        raise DFlashError("a target loaded alone has no drafter to draft with; its drafts are copies")
