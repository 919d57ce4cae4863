"""What a generation hands its caller: one response per decode cycle, and the run's result with its figures."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from .policy import COPY, DRAFTER


@dataclass
class GenerationResponse:
    """What one decode cycle produced, plus running statistics."""

    text: str
    tokens: list[int]
    accepted: int  # drafted tokens the target agreed with in this cycle
    drafted: list[int]  # what was proposed this cycle (empty for the prefill token and plain steps)
    prompt_tokens: int
    prompt_cached: int  # prompt tokens reused from the cache, not prefilled
    prompt_tps: float  # prefilled tokens per second
    generation_tokens: int
    generation_tps: float  # tokens after the first, per second after the first
    peak_memory: float  # GB
    cache_bytes: int  # KV caches of target and drafter together
    finish_reason: Optional[str] = None  # "stop" (EOS or a stop string), "length" (max_tokens) or None
    stop_sequence: Optional[str] = None  # the stop string that ended generation (not in the text)
    logprobs: Optional[list[float]] = None  # per token, with ``logprobs=``: log p under the target's distribution
    top_logprobs: Optional[list[list[tuple[int, float]]]] = None  # per token: (id, log p) of the most likely
    source: str = DRAFTER  # where ``drafted`` came from: the drafter, or a copy of the history


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    finish_reason: Optional[str]
    prompt_tokens: int
    prompt_cached: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    acceptance: list[int] = field(default_factory=list)  # accepted drafts, per cycle
    drafted: list[int] = field(default_factory=list)  # drafts proposed, per cycle
    stop_sequence: Optional[str] = None
    logprobs: Optional[list[float]] = None  # per token, when asked for
    sources: list[str] = field(default_factory=list)  # per cycle: where its drafts came from

    @classmethod
    def from_responses(cls, responses: list[GenerationResponse], finish_reason: Optional[str] = None) -> GenerationResult:
        """The run's text and figures from its responses (however many arrived); ``finish_reason`` overrides."""
        last, cycles = responses[-1], responses[1:]  # the first response is the prefill's token, not a verify cycle
        return cls(
            text="".join(r.text for r in responses), tokens=[t for r in responses for t in r.tokens],
            finish_reason=finish_reason or last.finish_reason, prompt_tokens=last.prompt_tokens,
            prompt_cached=last.prompt_cached, prompt_tps=last.prompt_tps, generation_tokens=last.generation_tokens,
            generation_tps=last.generation_tps, peak_memory=last.peak_memory,
            acceptance=[r.accepted for r in cycles], drafted=[len(r.drafted) for r in cycles],
            sources=[r.source for r in cycles], stop_sequence=last.stop_sequence,
            logprobs=None if last.logprobs is None else [lp for r in responses for lp in r.logprobs or []],
        )

    @property
    def cycles(self) -> int:
        return len(self.acceptance)

    @property
    def tau(self) -> float:
        """Mean tokens per verify cycle, the target's own (bonus) token included."""
        return sum(a + 1 for a in self.acceptance) / len(self.acceptance) if self.acceptance else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Share of drafted tokens the target accepted."""
        return sum(self.acceptance) / sum(self.drafted) if sum(self.drafted) else 0.0

    @property
    def histogram(self) -> list[int]:
        """``histogram[k]`` = number of cycles that accepted exactly k drafted tokens."""
        return _counts(self.acceptance)

    @property
    def by_source(self) -> dict[str, dict[str, int]]:
        """Per source: cycles that drafted from it, tokens drafted, tokens the target accepted."""
        totals = {s: {"cycles": 0, "drafted": 0, "accepted": 0} for s in (DRAFTER, COPY)}
        for source, drafted, accepted in zip(self.sources, self.drafted, self.acceptance):
            if drafted:
                t = totals[source]
                t["cycles"], t["drafted"], t["accepted"] = t["cycles"] + 1, t["drafted"] + drafted, t["accepted"] + accepted
        return totals

    @property
    def depth_histogram(self) -> list[int]:
        """``depth_histogram[k]`` = number of cycles that drafted k tokens (0: a plain decoding step)."""
        return _counts(self.drafted)

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "tokens": self.tokens,
            "finish_reason": self.finish_reason,
            "stop_sequence": self.stop_sequence,
            "prompt_tokens": self.prompt_tokens,
            "prompt_cached": self.prompt_cached,
            "prompt_tps": self.prompt_tps,
            "generation_tokens": self.generation_tokens,
            "generation_tps": self.generation_tps,
            "peak_memory_gb": self.peak_memory,
            "cycles": self.cycles,
            "tau": self.tau,
            "acceptance_histogram": self.histogram,
            "acceptance_rate": self.acceptance_rate,
            "depth_histogram": self.depth_histogram,
            "sources": self.by_source,
        }


def _counts(values: list[int]) -> list[int]:
    hist = [0] * (max(values, default=0) + 1)
    for v in values:
        hist[v] += 1
    return hist
