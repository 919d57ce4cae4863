"""The user's proof that DFlash is lossless on their machine and model (``doctor --selftest``).

Plain greedy decoding of the target (mlx-lm's ``generate_step``) and DFlash greedy
decoding (default policy) run on a few built-in prompts through ``bench.measure``;
their tokens must be equal. Where they are not, the target is run once more on
the prompt and the common prefix to see how close the call was at the first
differing position: verify (a block of tokens) and plain decoding (one token) go
through kernels of different shapes that sum in different orders, which can flip
a near-tie of the logits. Such a flip is rounding, not a DFlash bug; a divergence
with a clear winner is a bug.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import mlx.core as mx

from ..chat_template import prompt_ids, user
from ..errors import DFlashError
from . import bench
from .prompts import MIXED_SETS, Conversation, builtin

# Gap below which two tokens' logits count as a near-tie, by the dtype activations run in.
# Each layer's output is rounded to that dtype, so the different summation orders of
# verify and decoding kernels move hidden states by an ulp here and there, and the
# differences compound over the layers. bf16 keeps 8 significant bits: a logit of
# 16-32 (typical of a confident top-1) has an ulp of 0.125, and the margin between two
# such logits carries two roundings at the last layer alone. 0.5 is 4 ulps there:
# above it, rounding is an implausible cause; below it, one cannot tell. float16 has 3
# more bits (8x finer). float32 rounds 2^16 times finer than bf16; 1e-3 leaves a wide
# berth over its accumulated rounding. A bug has no reason to pick a token this close
# to the top, so the thresholds err towards calling a divergence real.
NEAR_TIE = {mx.bfloat16: 0.5, mx.float16: 0.0625, mx.float32: 1e-3}

# ``SelftestResult.exit_code``: every prompt identical, near-ties only, a real divergence.
EXIT_IDENTICAL, EXIT_NEAR_TIE, EXIT_DIVERGED = 0, 1, 3


def check_max_tokens(max_tokens: int) -> None:
    """Decode speed is measured from the second token on, so a selftest needs two."""
    if max_tokens < 2:
        raise DFlashError(f"--max-tokens must be >= 2 for a selftest, got {max_tokens}")


def near_tie_threshold(dtype: mx.Dtype) -> float:
    """The near-tie logit gap for activations in ``dtype`` (bf16's, the loosest, if unknown)."""
    return NEAR_TIE.get(dtype, NEAR_TIE[mx.bfloat16])


def is_near_tie(gap: float, threshold: float) -> bool:
    """Whether a divergence ``gap`` logits below the target's top-1 can be a rounding flip."""
    return gap < threshold


@dataclass
class Divergence:
    """The first position where DFlash's tokens differ from plain greedy decoding."""

    position: int  # index into the generated tokens
    plain_token: int
    dflash_token: int
    margin: float  # the target's top-1 minus top-2 logit there
    gap: float  # the target's top-1 logit minus the lower of the two tokens' logits
    near_tie: bool


@dataclass
class PromptCheck:
    name: str
    prompt_tokens: int
    generated_tokens: int
    plain_tps: float  # decode tok/s, after the first token
    dflash_tps: float
    divergence: Optional[Divergence] = None
    looping: bool = False  # the target's reply is a degenerate loop (``bench.degenerate``), which inflates the speedup

    @property
    def identical(self) -> bool:
        return self.divergence is None

    @property
    def speedup(self) -> float:
        return self.dflash_tps / self.plain_tps


@dataclass
class SelftestResult:
    prompts: list[PromptCheck]
    dtype: mx.Dtype  # what the target's activations run in
    threshold: float  # near-tie logit gap for that dtype

    @property
    def speedup(self) -> Optional[float]:
        """Plain decode time over DFlash decode time, summed over the prompts whose replies do not loop (same
        tokens); None when every reply loops: a loop measures itself, not the drafter (as ``bench`` leaves them out)."""
        fair = [p for p in self.prompts if not p.looping]
        if not fair:
            return None
        plain = sum((p.generated_tokens - 1) / p.plain_tps for p in fair)
        dflash = sum((p.generated_tokens - 1) / p.dflash_tps for p in fair)
        return plain / dflash

    @property
    def exit_code(self) -> int:
        """0 every prompt identical, 1 near-ties only, 3 a divergence that is no near-tie."""
        found = [p.divergence for p in self.prompts if p.divergence is not None]
        if not found:
            return EXIT_IDENTICAL
        return EXIT_NEAR_TIE if all(d.near_tie for d in found) else EXIT_DIVERGED


def logit_gaps(model: Any, ids: list[int], tokens: tuple[int, int]) -> tuple[float, float]:
    """The target's next-token (top-1 - top-2) margin after ``ids``, and top-1 minus the lower of ``tokens``."""
    logits = model(mx.array(ids)[None])[0, -1].astype(mx.float32)
    top2 = mx.sort(mx.topk(logits, 2))
    lowest = mx.minimum(logits[tokens[0]], logits[tokens[1]])
    return (top2[1] - top2[0]).item(), (top2[1] - lowest).item()


def first_divergence(
    model: Any, ids: list[int], plain: list[int], dflash: list[int], threshold: float
) -> Optional[Divergence]:
    """None when the two outputs are equal; otherwise where and how narrowly they part."""
    assert len(plain) == len(dflash), "both paths decode exactly max_tokens tokens"
    i = next((i for i, (a, b) in enumerate(zip(plain, dflash)) if a != b), None)
    if i is None:
        return None
    margin, gap = logit_gaps(model, ids + plain[:i], (plain[i], dflash[i]))
    return Divergence(i, plain[i], dflash[i], margin, gap, is_near_tie(gap, threshold))


def selftest(
    target: Any,
    drafter: Any,
    tokenizer: Any,
    *,
    max_tokens: int = 128,
    sets: tuple[str, ...] = MIXED_SETS,
    on_prompt: Callable[[dict[str, Any]], None] = lambda record: None,
) -> SelftestResult:
    """Plain and DFlash greedy decoding of the first built-in prompt of each of ``sets``, compared.

    Prompts go through the model's chat template when it has one; EOS does not stop
    either path, so both decode exactly ``max_tokens`` tokens. A divergence is a
    near-tie when both tokens' logits lie within ``near_tie_threshold`` (0.5 for
    bf16, 0.0625 for fp16, 1e-3 for fp32) of the target's top-1 logit there.
    """
    check_max_tokens(max_tokens)
    conversations = []
    for conv in (builtin(name)[0] for name in sets):
        text = conv.turns[0]
        ids = prompt_ids(tokenizer, user(text))
        conversations.append(Conversation(conv.name, [text], token_ids=ids))
    records = bench.measure(target, drafter, tokenizer, conversations, max_tokens=max_tokens, on_record=on_prompt)
    threshold = near_tie_threshold(target.dtype)
    checks = []
    for conv, r in zip(conversations, records):
        plain, dflash = r["plain"], r["dflash"]
        divergence = first_divergence(target.model, conv.token_ids, plain["tokens"], dflash["tokens"], threshold)
        checks.append(PromptCheck(r["prompt"], r["prompt_tokens"], r["generated_tokens"],
                                  plain["decode_tps"], dflash["decode_tps"], divergence,
                                  bench.degenerate(plain["tokens"])))
    return SelftestResult(checks, target.dtype, threshold)
