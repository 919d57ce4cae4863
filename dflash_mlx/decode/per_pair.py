"""What this process keeps for a loaded pair: its adaptive policies, batch planners and reference cache states.

Kept while the pair is loaded and dropped with it: the target is held weakly, and the drafter (an
``nn.Module``, which cannot be a dictionary key) by a weak reference checked on every lookup, so a new
drafter loaded at the address a freed one had never inherits what the old one learned.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Hashable, TypeVar

T = TypeVar("T")


class PerPair:
    """Values by (target, drafter, setting), made on first use."""

    def __init__(self) -> None:
        self._by_target: "weakref.WeakKeyDictionary[Any, dict[tuple[int, Hashable], tuple[Any, Any]]]" = (
            weakref.WeakKeyDictionary())

    def get(self, target: Any, drafter: Any, setting: Hashable, make: Callable[[], T]) -> T:
        entries = self._by_target.setdefault(target, {})
        key = (id(drafter), setting)
        held = entries.get(key)
        if held is None or held[0]() is not drafter:
            held = entries[key] = (weakref.ref(drafter), make())
        return held[1]
