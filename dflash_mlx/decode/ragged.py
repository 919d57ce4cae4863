"""The target's layer caches while rows decode together: one per layer, a length per row.

Rows accept different lengths each cycle. Each row's block is written right after its
own history (RoPE at the row's own positions) and attends to that alone; what a row
rejected lies past its length and is overwritten by its next block. Nothing moves when
rows diverge: no padding shifts, no copies of the history.

- ``RaggedKVCache``: an attention layer's keys and values by absolute position, full
  attention or a sliding window (the window is the mask's: the row's whole history stays,
  attention reads from the shortest row's window on; a row that joins with a ring of the
  last positions leaves with one).
- ``RaggedRecurrentCache``: a GatedDeltaNet layer's conv and SSM states, a row each;
  a row takes back the tail of the last update from the states the verify computed.

A row's ``DFlashCache`` sees its part of each layer through a ``RowView``: a length that
can go back, so commit, abandon and the cache invariant work per row as they do alone.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache, _BaseCache

from ..models.caches import RecurrentCache, WindowKVCache


class RaggedKVCache(_BaseCache):
    """One attention layer's keys and values for rows of different lengths ([rows, heads, capacity, dim]), by
    absolute position. ``window``: a sliding-window layer's (a query at q sees (q - window, q])."""

    step = 256

    def __init__(self, window: Optional[int] = None) -> None:
        self.window = window
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None
        self.lengths: list[int] = []
        self.slacks: list[int] = []  # a windowed row's rollback room, which its ring keeps when it leaves

    @property
    def offset(self) -> Any:
        """Each row's next position: where RoPE puts its new tokens (one row: a number, as a solo cache's)."""
        return self.lengths[0] if len(self.lengths) == 1 else mx.array(self.lengths)

    def _capacity(self, needed: int) -> None:
        if self.keys is not None and needed <= self.keys.shape[2]:
            return
        grow = -(-needed // self.step) * self.step - (0 if self.keys is None else self.keys.shape[2])
        pad = [(0, 0), (0, 0), (0, grow), (0, 0)]
        self.keys, self.values = mx.pad(self.keys, pad), mx.pad(self.values, pad)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write each row's ``N`` new positions after its own history; every row's keys up to the longest (from the
        first any of them can see)."""
        n, first = keys.shape[2], self._first()
        end = max(self.lengths) + n
        self._capacity(end)
        for i, length in enumerate(self.lengths):
            self.keys[i : i + 1, :, length : length + n] = keys[i : i + 1]
            self.values[i : i + 1, :, length : length + n] = values[i : i + 1]
        self.lengths = [length + n for length in self.lengths]
        return self.keys[..., first:end, :], self.values[..., first:end, :]

    def _first(self) -> int:
        """The first position any row's next block can see: 0, or for a windowed layer the oldest position still in
        the shortest row's window (rows of like lengths, a shared prompt's subagents, attend a window, not all)."""
        return 0 if self.window is None else max(0, min(self.lengths) - self.window + 1)

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None) -> Any:
        """[rows, 1, N, T]: a row's new position q sees its history and its block up to q (within the window),
        nothing past them; T the keys ``update_and_fetch`` returns."""
        window = self.window if window_size is None else min(window_size, self.window or window_size)
        if len(self.lengths) == 1 and window is None:  # one row: the plain causal mask (none for one query),
            return "causal" if N > 1 else None  # as a solo cache gives
        lengths = mx.array(self.lengths)[:, None, None, None]
        queries = lengths + mx.arange(N)[None, None, :, None]
        keys = mx.arange(self._first(), max(self.lengths) + N)[None, None, None, :]
        visible = keys <= queries
        return visible if window is None else visible & (keys > queries - window)

    def append(self, cache: Any) -> None:
        """A new last row holding ``cache``'s history: a ``KVCache``, or for a windowed layer the
        ``WindowKVCache`` ring (the positions a future query can see, at their places)."""
        length = cache.offset
        if self.window is None:
            keys, values, slack = cache.keys[..., :length, :], cache.values[..., :length, :], 0
        else:
            (keys, values), slack = cache.history(), cache.slack
        if self.keys is None:
            shape = (0, keys.shape[1], 0, keys.shape[3])
            self.keys, self.values = mx.zeros(shape, keys.dtype), mx.zeros(shape[:3] + (values.shape[3],), values.dtype)
        self._capacity(length)
        pad = [(0, 0), (0, 0), (0, self.keys.shape[2] - length), (0, 0)]
        self.keys = mx.concatenate([self.keys, mx.pad(keys, pad)])
        self.values = mx.concatenate([self.values, mx.pad(values, pad)])
        self.lengths.append(length)
        self.slacks.append(slack)

    def pop(self, row: int) -> Any:
        """Take row ``row`` out, as a plain cache of its own (a ``WindowKVCache`` for a windowed layer)."""
        length, slack = self.lengths.pop(row), self.slacks.pop(row)
        keys, values = self.keys[row : row + 1, :, :length], self.values[row : row + 1, :, :length]
        if self.window is None:
            cache = KVCache()
            cache.keys, cache.values, cache.offset = mx.contiguous(keys), mx.contiguous(values), length
        else:  # the ring holds the positions a future query sees: the last ``window``
            cache = WindowKVCache.holding(keys, values, self.window, slack=slack)
        keep = _others(row, self.keys.shape[0])
        capacity = -(-max(self.lengths, default=0) // self.step) * self.step  # a long row gone: its width goes too
        self.keys, self.values = self.keys[keep, :, :capacity], self.values[keep, :, :capacity]
        return cache

    def trim_row(self, row: int, n: int) -> int:
        n = min(n, self.lengths[row])
        self.lengths[row] -= n
        return n

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    @property
    def state(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values]


class RaggedRecurrentCache(_BaseCache):
    """A GatedDeltaNet layer's conv and SSM states, one row each, for rows of different lengths.

    Every row's state advances by the whole (padded) block; a row that keeps less takes
    the state after its own part from the update's ``replay`` (see ``RecurrentCache``),
    once, before the next update. Padding comes after a row's real positions, so it never
    reaches the states a row keeps.
    """

    def __init__(self) -> None:
        self.cache: list[Optional[mx.array]] = [None, None]
        self.lengths: list[int] = []
        self.slacks: list[int] = []
        self.slack, self.step_states = 0, True
        self.replay: Optional[Callable[[int], tuple[mx.array, mx.array]]] = None
        self.last_update = 0
        self._replayed: dict[int, tuple[mx.array, mx.array]] = {}  # keep -> states: rows keeping alike share one
        self._trimmed: set[int] = set()

    def __getitem__(self, i: int) -> Optional[mx.array]:
        return self.cache[i]

    def record(self, conv: mx.array, state: mx.array, replay: Optional[Callable[[int], tuple[mx.array, mx.array]]],
               tokens: int) -> None:
        """An update of ``tokens`` positions for every row (see ``RecurrentCache.record``)."""
        self.cache = [conv, state]
        self.replay, self.last_update = (replay, tokens) if replay is not None else (None, 0)
        self._replayed, self._trimmed = {}, set()
        self.lengths = [n + tokens for n in self.lengths]

    def trim_row(self, row: int, n: int) -> int:
        """Row ``row`` keeps all but the last ``n`` positions of the last update."""
        if n == 0:
            return 0
        if self.replay is None or n > self.last_update or row in self._trimmed:
            raise ValueError(f"a batch's recurrent layer undoes only its last update ({self.last_update} tokens) once "
                             f"per row, asked {n}")
        keep = self.last_update - n
        if keep not in self._replayed:
            self._replayed[keep] = self.replay(keep)
        self.cache = [_with_row(whole, row, part) for whole, part in zip(self.cache, self._replayed[keep])]
        self._trimmed.add(row)
        self.lengths[row] -= n
        return n

    def append(self, cache: RecurrentCache) -> None:
        """A new last row holding ``cache``'s states (after its prefill: it has some)."""
        if not self.lengths:
            self.slack, self.step_states = cache.slack, cache.step_states
        self.cache = [a[...] if b is None else mx.concatenate([b, a]) for a, b in zip(cache.cache, self.cache)]
        self.lengths.append(cache.offset)
        self.slacks.append(cache.slack)
        self.replay, self.last_update = None, 0  # rows move: the last update cannot be undone any more

    def pop(self, row: int) -> RecurrentCache:
        cache = RecurrentCache(self.slacks.pop(row), self.step_states)
        cache.cache = [mx.contiguous(a[row : row + 1]) for a in self.cache]
        cache.offset = self.lengths.pop(row)
        keep = _others(row, self.cache[0].shape[0])
        self.cache = [a[keep] if self.lengths else None for a in self.cache]
        self.replay, self.last_update = None, 0
        return cache

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.cache if a is not None)

    @property
    def state(self) -> list[mx.array]:
        return [a for a in self.cache if a is not None]


def _others(row: int, rows: int) -> mx.array:
    """The indices of every row but ``row``: what stays when it leaves."""
    return mx.array([i for i in range(rows) if i != row], dtype=mx.int32)


def _with_row(whole: mx.array, row: int, part: mx.array) -> mx.array:
    """``whole`` with row ``row`` taken from ``part`` (a new array: the replay's arrays stay as they were)."""
    out = whole[...]
    out[row : row + 1] = part[row : row + 1]
    return out


def ragged_layer(cache: Any) -> Any:
    """The batch's cache for a target layer whose cache alone is ``cache`` (a fresh one: ``Target.make_cache``)."""
    if isinstance(cache, RecurrentCache):
        return RaggedRecurrentCache()
    if isinstance(cache, WindowKVCache):
        return RaggedKVCache(cache.window)
    if type(cache) is KVCache:
        return RaggedKVCache()
    raise ValueError(f"a batch does not take a {type(cache).__name__}")


class RowView:
    """One row of a batch's layer, as the row's ``DFlashCache`` sees its target layer: a length that can go back."""

    def __init__(self, layer: Any, place: Callable[[], int]) -> None:
        self.layer, self.place = layer, place

    @property
    def offset(self) -> int:
        return self.layer.lengths[self.place()]

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        return self.layer.trim_row(self.place(), n)

    @property
    def nbytes(self) -> int:
        """This row's share of the layer."""
        rows = len(self.layer.lengths)
        return self.layer.nbytes // rows if rows else 0
