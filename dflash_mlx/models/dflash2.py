"""DFlash2 drafters: v1 plus a two-tap dynamic convolution around every sublayer and a candidate-path selector.

Everything v1 does stays as it is (fc + hidden_norm context, KV injection, the
[anchor, MASK...] block drafted in one non-causal pass, context-only caches,
sliding-window masks). Two things are added:

- Each attention and MLP sublayer is wrapped by a grouped convolution over block
  positions: tap 0 reads the position itself, tap 1 its predecessor (zero for the
  anchor). Its kernel is a learned base plus a per-position correction projected
  from the normed sublayer input. It runs inside the block only, so the context
  K/V and the caches are exactly v1's.
- The drafts are not independent argmaxes: a selector walks the block from the
  anchor, scoring each position's top-k candidates by their logit plus a low-rank
  bilinear term between the previous draft and the candidate, gated by the hidden
  state. At temperature > 0 it samples from the softmax of those scores, and the
  proposal says so (a sparse q), which keeps rejection sampling exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Union

import mlx.core as mx
import mlx.nn as nn

from ..errors import DFlashError
from ..sampling import Proposal, Sampling
from .drafter import Blocks, Cache, DecoderLayer, Drafter, DrafterArgs

if TYPE_CHECKING:
    from .target import Target

CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


@dataclass
class DFlash2Args(DrafterArgs):
    """A DFlash2 config: v1's keys, the conv and selector sizes in ``dflash_config``.

    The published configs keep ``block_size`` only inside ``dflash_config``; a reader
    falling back to a top-level value (or v1's default 16) runs the wrong block, so
    it is required there.
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        if "block_size" not in self.dflash_config:
            raise DFlashError("DFlash2 drafter config has no dflash_config.block_size")
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            if int(self.dflash_config.get(name, 1)) < 1:
                raise DFlashError(f"DFlash2 dflash_config.{name} must be >= 1, got {self.dflash_config[name]}")
        if self.hidden_size % self.conv_group_size:
            raise DFlashError(
                f"DFlash2 conv_group_size {self.conv_group_size} does not divide hidden_size {self.hidden_size}"
            )

    # Defaults are the values of every published DFlash2 checkpoint.
    @property
    def conv_kernel_size(self) -> int:
        return int(self.dflash_config.get("conv_kernel_size", 2))

    @property
    def conv_group_size(self) -> int:
        return int(self.dflash_config.get("conv_group_size", 16))

    @property
    def selector_rank(self) -> int:
        return int(self.dflash_config.get("selector_rank", 256))

    @property
    def selector_top_k(self) -> int:
        return int(self.dflash_config.get("selector_top_k", 16))


class GroupedDynamicConv(nn.Module):
    """The two convolutions (pre- and post-sublayer) around one sublayer, over block positions.

    ``Conv(y)_t[c] = sum_j (base[j, c] + D_t[j, c // gs]) * y_{t-j}[c]`` with
    ``y_{t-j} = 0`` before the block's first position. Both corrections D (pre and
    post) come from one projection of the normed sublayer input.
    """

    def __init__(self, dim: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        groups = dim // group_size
        # The trainers' identity start: tap 0 passes through, no correction (the layer equals v1).
        self.base_kernel = mx.concatenate(
            [mx.ones((2, 1, dim)), mx.zeros((2, kernel_size - 1, dim))], axis=1
        )
        self.kernel_projection = nn.Linear(dim, 2 * kernel_size * groups, bias=False)
        self.kernel_projection.weight = mx.zeros_like(self.kernel_projection.weight)

    def corrections(self, x: mx.array) -> mx.array:
        """Per-position kernel corrections [batch, T, 2 (pre/post), K, groups] from the normed input ``x``."""
        B, T, _ = x.shape
        return self.kernel_projection(x).reshape(B, T, 2, self.kernel_size, -1)

    def __call__(self, y: mx.array, corrections: mx.array, stage: int) -> mx.array:
        """Convolve ``y`` [batch, T, H] with stage ``stage`` (0 pre, 1 post) of the kernel."""
        B, T, H = y.shape
        out = mx.zeros_like(y)
        for j in range(min(self.kernel_size, T)):  # taps reaching before the block read zeros
            shifted = y if j == 0 else mx.pad(y[:, : T - j], [(0, 0), (j, 0), (0, 0)])
            grouped = shifted.reshape(B, T, -1, self.group_size) * corrections[:, :, stage, j, :, None]
            out = out + self.base_kernel[stage, j] * shifted + grouped.reshape(B, T, H)
        return out


class DFlash2DecoderLayer(DecoderLayer):
    """v1's layer with each sublayer's input and output convolved over the block."""

    def __init__(self, args: DFlash2Args, window: Optional[int] = None):
        super().__init__(args, window)
        self.attention_conv = GroupedDynamicConv(args.hidden_size, args.conv_kernel_size, args.conv_group_size)
        self.mlp_conv = GroupedDynamicConv(args.hidden_size, args.conv_kernel_size, args.conv_group_size)

    def __call__(self, x: mx.array, context: mx.array, cache: Union[Cache, Blocks]) -> mx.array:
        if isinstance(cache, Blocks):
            raise DFlashError("DFlash2 drafters cannot be trained here yet")
        # The context reaches the attention as v1's (hidden_norm(fc(features))), never convolved.
        n = self.input_layernorm(x)
        d = self.attention_conv.corrections(n)
        h = x + self.attention_conv(self.self_attn(self.attention_conv(n, d, 0), context, cache), d, 1)
        n = self.post_attention_layernorm(h)
        d = self.mlp_conv.corrections(n)
        return h + self.mlp_conv(self.mlp(self.mlp_conv(n, d, 0)), d, 1)


class CandidateSelector(nn.Module):
    """The candidate-path walk over a drafted block.

    Position j keeps the top-k tokens C_j of its logits U_j and scores them as
    ``S_j(b) = U_j(b) + sum_r A[a_j, r] g_j[r] Bc[b, r]`` with ``g_j`` the gate
    projected from the hidden state and ``a_j`` the token drafted just before (the
    anchor for j = 0). Only the k-wide scores are sequential; everything else is
    computed for all positions at once. Scores are fp32 (as the references).
    """

    def __init__(self, dim: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = min(top_k, vocab_size)
        self.hidden_projection = nn.Linear(dim, rank, bias=False)
        # Plain parameters, as published (no Embedding module, no ``.weight``).
        self.predecessor_codebook = mx.zeros((vocab_size, rank))
        self.successor_codebook = mx.zeros((vocab_size, rank))

    def __call__(
        self, h: mx.array, logits: mx.array, anchor: mx.array, temperature: float, key: Optional[mx.array]
    ) -> Proposal:
        """Walk ``h`` [n, H] / ``logits`` [n, V] from ``anchor`` [1]: argmax at temperature 0, else sample.

        At temperature > 0 the proposal's log-probs are each position's softmax(S/T)
        over its candidates, scattered onto the vocabulary (-inf elsewhere): the
        distribution the draft was drawn from, given the drafts before it.
        """
        n = logits.shape[0]
        candidates = mx.argpartition(-logits, kth=self.top_k - 1, axis=-1)[:, : self.top_k]  # [n, k]
        unary = mx.take_along_axis(logits, candidates, axis=-1).astype(mx.float32)
        gate = self.hidden_projection(h).astype(mx.float32)  # [n, r]
        # Fold the gate into the candidates' successor rows: S_j = u_j + W_j @ A[a_j].
        successors = self.successor_codebook[candidates].astype(mx.float32) * gate[:, None, :]  # [n, k, r]
        keys = [None] * n if temperature == 0 or key is None else list(mx.random.split(key, n))
        previous, drafts, logprobs = anchor[0], [], []
        for j in range(n):
            predecessor = self.predecessor_codebook[previous].astype(mx.float32)
            scores = unary[j] + successors[j] @ predecessor  # [k]
            if temperature == 0:
                pick = mx.argmax(scores)
            else:
                logq = scores / temperature
                logq = logq - mx.logsumexp(logq)
                pick = mx.random.categorical(logq, key=keys[j])
                logprobs.append(logq)
            previous = candidates[j, pick]
            drafts.append(previous)
        tokens = mx.stack(drafts)
        if temperature == 0:
            return Proposal(tokens)
        q = mx.full(logits.shape, -mx.inf, dtype=mx.float32)
        return Proposal(tokens, mx.put_along_axis(q, candidates, mx.stack(logprobs), axis=-1))


class DFlash2Drafter(Drafter):
    """A DFlash2 draft model (``architectures == ["DFlash2DraftModel"]``) with the published names."""

    decoder_layer = DFlash2DecoderLayer

    def __init__(self, args: DFlash2Args):
        super().__init__(args)
        self.candidate_selector = CandidateSelector(
            args.hidden_size, args.vocab_size, args.selector_rank, args.selector_top_k
        )

    @property
    def block_size(self) -> int:
        return int(self.args.dflash_config["block_size"])

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Accept the codebooks with or without ``.weight`` (converters add it); refuse a file with both."""
        weights = dict(weights)
        for name in CODEBOOKS:
            if f"{name}.weight" in weights:
                if name in weights:
                    raise DFlashError(f"drafter holds both {name} and {name}.weight: keep one spelling")
                weights[name] = weights.pop(f"{name}.weight")
        return weights

    def propose(
        self, target: "Target", last: mx.array, context: Optional[mx.array], cache: list[Cache], n: int,
        sampling: Sampling, key: Optional[mx.array],
    ) -> Proposal:
        """The selector's path over the block drafted after ``last`` (see ``CandidateSelector``).

        No top-p/top-k/min-p filter applies to the proposal: rejection sampling is
        exact against any q, as long as it is the one the drafts came from.
        """
        h = self.draft_hidden(target, last, context, cache, n)
        logits = self.compute_logits(target.lm_head(h))
        return self.candidate_selector(h, logits, last, sampling.temperature, key)
