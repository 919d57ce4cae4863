"""A drafter's own vocabulary: the target tokens it drafts, so that its head projects onto those rows alone.

A drafter borrows the target's LM head, one row per token of the target's vocabulary (49k for SmolLM2,
152k for Qwen3): for a small drafter that projection is most of a draft pass (11-13 ms of 7 rows on 2 CPU
cores for SmolLM2's head). A drafter trained here has seen a few thousand distinct tokens as labels, and it
proposes almost nothing else: on the real pair's bench prompts, drafting over the 7,764 tokens of its training
text accepted as many tokens as drafting over all 49,152, with a head 7x cheaper (``docs/benchmarks.md``, "A
drafter's own vocabulary"). FR-Spec and EAGLE-3 restrict the draft head the same way.

Nothing about verification changes. Greedy drafts are compared with the target's own argmax; a sampled
draft comes from a distribution that is zero outside the subset, and rejection sampling is exact against
any distribution the drafts were really drawn from (``sampling.Proposal``).

The checkpoint keeps the ids, ascending, as the int32 tensor ``draft_vocab`` beside the weights, and its
config says how many in ``dflash_config.draft_vocab_size``.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Callable, Iterable, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import DFlashError

if TYPE_CHECKING:
    from .target import Target

TENSOR = "draft_vocab"
CONFIG_KEY = "draft_vocab_size"
DRAFT_VOCAB = 32768  # most tokens a trained drafter drafts from (EAGLE-3's Llama 3.1 drafters keep 32,000 of 128,256)
HEADS = (nn.Linear, nn.Embedding, nn.QuantizedLinear, nn.QuantizedEmbedding)  # one row per token, axis 0


class DraftVocabulary:
    """The ascending target token ids a drafter drafts from, and the target's head cut to them."""

    def __init__(self, ids: Iterable[int] | np.ndarray | mx.array, vocab_size: int) -> None:
        ids = np.asarray(ids)
        if ids.ndim != 1 or not len(ids) or not np.issubdtype(ids.dtype, np.integer):
            raise DFlashError(f"a draft vocabulary is a non-empty list of token ids, got shape {list(ids.shape)} "
                              f"of {ids.dtype}")
        if np.any(np.diff(ids) <= 0):
            raise DFlashError("the draft vocabulary's token ids must be ascending and distinct")
        if ids[0] < 0 or ids[-1] >= vocab_size:
            raise DFlashError(f"the draft vocabulary holds token {int(ids[-1] if ids[-1] >= vocab_size else ids[0])}, "
                              f"outside the vocabulary of {vocab_size}")
        self.ids = mx.array(ids.astype(np.int32))
        self.vocab_size = vocab_size
        self._head: Optional[tuple[nn.Module, Callable[[mx.array], mx.array]]] = None

    def __len__(self) -> int:
        return self.ids.shape[0]

    @classmethod
    def from_replies(cls, replies: Iterable[list[int]], prompts: Iterable[list[int]], vocab_size: int,
                     limit: int) -> Optional[DraftVocabulary]:
        """The ``limit`` tokens most frequent in the replies a drafter learns to draft, then in their prompts
        (None: ``limit`` 0, or at least the whole vocabulary)."""
        if limit <= 0:
            return None
        replied, prompted = Counter(t for r in replies for t in r), Counter(t for p in prompts for t in p)
        ranked = sorted(replied.keys() | prompted.keys(), key=lambda t: (-replied[t], -prompted[t], t))
        if len(ranked) >= vocab_size:
            return None
        return cls(sorted(ranked[:limit]), vocab_size)

    def head(self, target: Target) -> Callable[[mx.array], mx.array]:
        """The target's vocabulary projection onto this vocabulary's rows (gathered once, then kept)."""
        module = target.head_module
        if self._head is None or self._head[0] is not module:
            self._head = (module, self._cut(module, target))
        return self._head[1]

    def _cut(self, module: nn.Module, target: Target) -> Callable[[mx.array], mx.array]:
        if target.head_group is not None or not isinstance(module, HEADS):  # a slice per rank, or another layout
            return lambda h: mx.take(target.lm_head(h), self.ids, axis=-1)
        rows = {name: value[self.ids] for name, value in module.items() if isinstance(value, mx.array)}
        mx.eval(rows)
        bias = rows.get("bias")
        if "scales" in rows:
            def project(h: mx.array) -> mx.array:
                return mx.quantized_matmul(h, rows["weight"], scales=rows["scales"], biases=rows.get("biases"),
                                           transpose=True, group_size=module.group_size, bits=module.bits,
                                           mode=getattr(module, "mode", "affine"))
        else:
            def project(h: mx.array) -> mx.array:
                return h @ rows["weight"].T
        return project if bias is None else (lambda h: project(h) + bias)

    def tokens(self, index: mx.array) -> mx.array:
        """Target token ids of positions in this vocabulary."""
        return self.ids[index]

    def expand(self, logprobs: mx.array) -> mx.array:
        """[..., V] log-probabilities from [..., len(self)] ones: -inf for every token outside."""
        full = mx.full((*logprobs.shape[:-1], self.vocab_size), -mx.inf, dtype=logprobs.dtype)
        full[..., self.ids] = logprobs
        return full

    def tensors(self) -> dict[str, mx.array]:
        """What a checkpoint keeps beside the weights."""
        return {TENSOR: self.ids}
