"""Where the history repeats itself: how long its end occurred before, and what followed there.

Two uses of one index. The adaptive policy keeps its acceptance apart by how long
the end of the history repeats (drafters follow repeated text far better than new
text). And a copy draft proposes what followed the earlier occurrence: an agent
rewriting a file with one change, a function repeated with a fix, a quote, a loop
the model fell into. Such a proposal costs no drafter pass, only its verify.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class Repeats:
    """How long a suffix of the history also occurred earlier in it, kept up as the history grows.

    Drafters follow text that repeats itself (a reply fallen into a loop, a line of
    code written again, a name from the prompt) far better than new text. Measured
    on the CPU pair of ``bench/build_pair.py``, a one-token draft was accepted
    26-38% of the time where the last three tokens had not occurred before, and
    84-94% where the last twelve had, in code and chat alike. The policy keeps its
    acceptance apart for each ``bucket`` of this length, so it can draft
    where the text repeats and decode plainly where it does not, without waiting
    for a probe to notice the change. Each new token costs a dict lookup; a new
    generation indexes the last ``horizon`` tokens of its history once, and a long
    one again every ``3 * horizon`` tokens, which bounds the index. The horizon is
    long enough for an agent's prompt, whose file to copy back may sit well before
    its last few thousand tokens (indexing 16k tokens takes milliseconds, next to
    seconds of prefill).
    """

    n: int = 3  # the shortest repeat that counts
    long: int = 12  # from here on a repeat is a bucket of its own (and the length stops growing)
    horizon: int = 16384
    _ends: dict[tuple[int, ...], int] = field(default_factory=dict, repr=False)  # n-gram -> index past its latest
    _first: int = 0  # the first token indexed
    _seen: int = 0  # tokens of the history indexed
    _length: int = 0
    _next: int = 0  # where the earlier occurrence of the repeating suffix continues

    def reset(self) -> None:
        self._ends, self._seen, self._length = {}, 0, 0

    def length(self, history: Sequence[int]) -> int:
        """Length (``n`` .. ``long``) of the suffix of ``history`` seen earlier in it; 0 if none is."""
        if len(history) < self._seen or len(history) - self._first > 4 * self.horizon:  # another history, or
            self.reset()  # a long generation: indexed afresh over the last ``horizon`` tokens
        if self._seen == 0:
            self._first = self._seen = max(0, len(history) - self.horizon)
        for i in range(max(self._seen, self._first + self.n - 1), len(history)):
            key = tuple(history[i - self.n + 1 : i + 1])
            if self._length and history[self._next] == history[i]:  # the repeat goes on
                self._length, self._next = min(self._length + 1, self.long), self._next + 1
            else:
                end = self._ends.get(key)
                self._length, self._next = (0, 0) if end is None else (self.n, end)
            self._ends[key] = i + 1
        self._seen = len(history)
        return self._length

    def bucket(self, history: Sequence[int]) -> int:
        """0: the end of the history is new; 1: it repeats a short stretch; 2: a long one."""
        length = self.length(history)
        return 0 if length < self.n else 1 if length < self.long else 2

    def continuation(self, history: Sequence[int], last: int, k: int) -> list[int]:
        """A copy draft: up to ``k`` tokens that followed the latest earlier occurrence of ``history + [last]``'s end.

        The repeat being followed if ``last`` continues it (the longest match), else
        the latest earlier ``n``-gram ending in ``last``; none: empty. Copied as LZ77
        copies, so a match close behind (a loop of short period) extends itself.
        """
        self.length(history)
        if self._length and history[self._next] == last:
            start = self._next + 1
        elif self.n > 1 and len(history) >= self.n - 1:
            start = self._ends.get((*history[len(history) - self.n + 1 :], last))
        else:
            start = None
        if start is None or k <= 0:
            return []
        seen, out = len(history) + 1, []
        for j in range(start, start + k):
            out.append(history[j] if j < len(history) else last if j == len(history) else out[j - seen])
        return out
