"""Stop strings: generation ends just before the first one, and no part of it is ever shown.

Matching is on text, not token ids: a stop string can begin or end inside a token,
and the same string tokenizes differently in different contexts. Text that could be
the start of a stop string is held back until the next token decides it.
"""

from __future__ import annotations

from typing import Iterable, Optional, Union

from ..errors import DFlashError


def stop_list(stop: Union[None, str, Iterable[str]]) -> tuple[str, ...]:
    """A stop argument (None, one string or several) as a tuple of non-empty strings."""
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, (list, tuple)) else (stop,)
    if not all(isinstance(s, str) and s for s in stops):
        raise DFlashError(f"stop strings must be non-empty text, got {list(stops)!r}")
    return stops


def held_back(text: str, stops: Iterable[str]) -> int:
    """How many trailing characters of ``text`` could be the start of a stop string."""
    return max((k for s in stops for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])),
               default=0)


class StopStrings:
    """Filters a stream of text pieces: what may be shown now, and the stop string that ended it."""

    def __init__(self, stops: Iterable[str]):
        self.stops = stop_list(tuple(stops))
        self._held = ""

    def feed(self, piece: str) -> tuple[str, Optional[str]]:
        """(text that can be shown, the stop string found or None); nothing may follow a found one."""
        text = self._held + piece
        found = [(i, s) for s in self.stops if (i := text.find(s)) >= 0]
        if found:
            i, stop = min(found, key=lambda f: f[0])
            self._held = ""
            return text[:i], stop
        keep = held_back(text, self.stops)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], None

    def flush(self) -> str:
        """The text held back, at the end of generation: no stop string can complete any more."""
        text, self._held = self._held, ""
        return text
