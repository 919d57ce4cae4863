"""How many tokens to draft each cycle.

The decode loop asks its policy before every cycle and tells it what happened
after. Any depth is lossless (verification keeps only what the target agrees
with); the policy only decides speed. 0 means a plain decoding step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class DraftPolicy(Protocol):
    def draft_length(self, context_tokens: int) -> int:
        """Tokens to draft in the next cycle, given how many the caches hold (the loop caps it)."""
        ...

    def observe(self, drafted: int, accepted: int) -> None:
        """The outcome of a verified cycle: ``accepted`` of ``drafted`` tokens agreed with the target."""
        ...


@dataclass
class FixedBlock:
    """Always fill the block: ``block_size - 1`` drafted tokens after the last verified one."""

    block_size: int

    def draft_length(self, context_tokens: int) -> int:
        return self.block_size - 1

    def observe(self, drafted: int, accepted: int) -> None:
        pass
