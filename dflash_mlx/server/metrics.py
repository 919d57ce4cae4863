"""What ``GET /metrics`` reports, in Prometheus' text format."""

from __future__ import annotations

from typing import Any

from ..decode.responses import GenerationResult


class Metrics:
    """What ``GET /metrics`` reports, in Prometheus' text format (a registry of this server's own)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
            return Counter(f"dflash_{name}", doc, labels, registry=self.registry)

        self.requests = counter("requests", "Requests answered, by endpoint and HTTP status", ("endpoint", "status"))
        self.prompt = counter("prompt_tokens", "Prompt tokens of the requests run")
        self.cached = counter("cached_prompt_tokens", "Prompt tokens reused from the cache, not prefilled")
        self.generated = counter("generated_tokens", "Tokens generated")
        self.drafted = counter("drafted_tokens", "Tokens proposed (by the drafter or copied from the context)")
        self.accepted = counter("accepted_tokens", "Drafted tokens the target accepted")
        self.batch = Gauge("dflash_batch_rows", "Requests decoding together (one pass verifies them all)",
                           registry=self.registry)
        self.ttft = Histogram("dflash_time_to_first_token_seconds", "Seconds from the start of a request's "
                              "generation to its first token", registry=self.registry,
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.speed = Histogram("dflash_decode_tokens_per_second", "Decode speed of each request (tokens after the "
                               "first)", registry=self.registry,
                               buckets=(1, 5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 500, 1000))

    def record(self, run: GenerationResult, ttft: float) -> None:
        self.prompt.inc(run.prompt_tokens)
        self.cached.inc(run.prompt_cached)
        self.generated.inc(len(run.tokens))
        self.drafted.inc(sum(run.drafted))
        self.accepted.inc(sum(run.acceptance))
        self.ttft.observe(ttft)
        if len(run.tokens) > 1:
            self.speed.observe(run.generation_tps)

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


