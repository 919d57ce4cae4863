"""A sliding-window KV cache that speculative decoding can roll back.

mlx-lm's RotatingKVCache cannot be trimmed once it wraps, and its multi-token path
copies the whole window on every update. ``WindowKVCache`` keeps a ring of
``window + slack`` slots (plus ``sinks`` slots that are never evicted) and writes
new keys in place. Because rolled-back tokens only ever overwrite slots whose
positions have already left every future query's window, undoing up to ``slack``
tokens is just moving the offset back, at any fill state.

Attention semantics: the query at absolute position q sees the sink positions
``[0, sinks)`` and the positions ``(q - window, q]``. Keys are stored after RoPE
at absolute positions, so slot order does not matter; the mask says which slot
holds which position.
"""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, _BaseCache

from .errors import DFlashError


def check_window(window: int, sinks: int = 0, block_size: int = 1) -> None:
    """Reject window settings that cannot give the promised semantics."""
    if window < 1:
        raise DFlashError(f"window must be >= 1, got {window}")
    if window < block_size:
        raise DFlashError(f"window ({window}) must be at least the block size ({block_size})")
    if sinks < 0:
        raise DFlashError(f"sinks must be >= 0, got {sinks}")
    if sinks >= window:
        raise DFlashError(f"sinks ({sinks}) must be smaller than the window ({window})")


class WindowKVCache(_BaseCache):
    step = 256

    def __init__(self, window: int, sinks: int = 0, slack: int = 16):
        check_window(window, sinks)
        if slack < 1:
            raise DFlashError(f"slack must be >= 1, got {slack}")
        self.window = window
        self.sinks = sinks
        self.slack = slack
        self.ring = window + slack  # slots for non-sink positions
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None
        self.offset = 0  # absolute position of the next token

    # -- slot bookkeeping -------------------------------------------------
    def _slot(self, pos: int) -> int:
        return pos if pos < self.sinks else self.sinks + (pos - self.sinks) % self.ring

    def _slot_positions(self, n_slots: int, offset: int) -> mx.array:
        """Absolute position held by each of the first ``n_slots`` slots when ``offset`` tokens are written.

        -1 marks an empty slot. A slot whose last write was rolled back reports an
        older position, which no future query's window reaches.
        """
        S, R = self.sinks, self.ring
        j = mx.arange(n_slots)
        r = j - S
        latest = S + r + R * mx.floor_divide(offset - 1 - S - r, R)
        ring_pos = mx.where((r >= 0) & (offset - 1 - S - r >= 0), latest, -1)
        return mx.where(j < S, mx.where(j < offset, j, -1), ring_pos)

    def _stored(self, offset: int) -> int:
        """Slots in use for ``offset`` written tokens (all of them once the ring has wrapped)."""
        return min(offset, self.sinks + self.ring)

    def _mask(self, positions: mx.array, start: int, n: int, window: int) -> mx.array:
        q = mx.arange(start, start + n)[:, None]
        k = positions[None]
        return (k >= 0) & (k <= q) & ((k < self.sinks) | (k > q - window))

    # -- mlx-lm cache protocol ---------------------------------------------
    def _grow(self, keys: mx.array, values: mx.array, needed: int) -> None:
        full = self.sinks + self.ring
        size = 0 if self.keys is None else self.keys.shape[2]
        if size >= min(needed, full):
            return
        new = min(full, max(needed, size + self.step))
        B, H, _, Dk = keys.shape
        k = mx.zeros((B, H, new - size, Dk), keys.dtype)
        v = mx.zeros((B, H, new - size, values.shape[3]), values.dtype)
        self.keys = k if self.keys is None else mx.concatenate([self.keys, k], axis=2)
        self.values = v if self.values is None else mx.concatenate([self.values, v], axis=2)

    def _write(self, keys: mx.array, values: mx.array, first: int) -> None:
        """Store positions ``first .. first + L - 1`` in their slots (at most two slices per kind)."""
        L = keys.shape[2]
        pos, i = first, 0
        while i < L:
            slot = self._slot(pos)
            if pos < self.sinks:
                run = min(L - i, self.sinks - pos)
            else:
                run = min(L - i, self.sinks + self.ring - slot)
            self.keys[..., slot : slot + run, :] = keys[..., i : i + run, :]
            self.values[..., slot : slot + run, :] = values[..., i : i + run, :]
            pos, i = pos + run, i + run

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        L = keys.shape[2]
        start = self.offset
        if L <= self.slack:
            # Small update (decode, verify): write in place, attend over the buffer.
            self._grow(keys, values, self._stored(start + L))
            self._write(keys, values, start)
            self.offset += L
            n = self._stored(self.offset)
            return self.keys[..., :n, :], self.values[..., :n, :]
        # Large update (a prefill chunk): attend over [buffer ; new], then keep what fits.
        n = self._stored(start)
        if n:
            all_k = mx.concatenate([self.keys[..., :n, :], keys], axis=2)
            all_v = mx.concatenate([self.values[..., :n, :], values], axis=2)
        else:
            all_k, all_v = keys, values
        self._grow(keys, values, self._stored(start + L))
        keep_from = max(0, L - self.ring)
        if start < self.sinks and keep_from > 0:  # sink positions inside the dropped head
            head = min(self.sinks - start, keep_from)
            self._write(keys[..., :head, :], values[..., :head, :], start)
        self._write(keys[..., keep_from:, :], values[..., keep_from:, :], start + keep_from)
        self.offset += L
        return all_k, all_v

    def key_positions(self, n_new: int) -> mx.array:
        """Absolute positions of the keys ``update_and_fetch`` returns for an update of ``n_new`` tokens."""
        start = self.offset
        if n_new <= self.slack:
            return self._slot_positions(self._stored(start + n_new), start + n_new)
        old = self._slot_positions(self._stored(start), start)
        return mx.concatenate([old, mx.arange(start, start + n_new)])

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False) -> mx.array:
        window = min(self.window, window_size or self.window)
        return self._mask(self.key_positions(N), self.offset, N, window)

    def block_mask(self, n_context: int, n_block: int) -> mx.array:
        """Mask for a drafter block written right after ``n_context`` new context tokens.

        The block attends to all of itself (non-causally), the sinks, and the
        ``window`` context positions just before it.
        """
        positions = self.key_positions(n_context + n_block)
        first = self.offset + n_context
        return ((positions >= 0) & ((positions < self.sinks) | (positions >= first - self.window)))[None]

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Undo the last ``n`` tokens; exact for ``n <= slack`` at any fill state."""
        if n > self.slack:
            raise ValueError(f"WindowKVCache can roll back at most {self.slack} tokens, asked {n}")
        n = min(self.offset, n)
        self.offset -= n
        return n

    def size(self) -> int:
        return min(self.offset, self.sinks + self.window)

    @property
    def state(self):
        return self.keys, self.values

    @state.setter
    def state(self, v):
        self.keys, self.values = v

    @property
    def meta_state(self):
        return tuple(map(str, (self.window, self.sinks, self.slack, self.offset)))

    @meta_state.setter
    def meta_state(self, v):
        self.window, self.sinks, self.slack, self.offset = map(int, v)
        self.ring = self.window + self.slack

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


class RecurrentCache(ArraysCache):
    """Conv and SSM state of a GatedDeltaNet layer, able to undo the tail of its last update.

    mlx-lm's ArraysCache cannot be trimmed. The layer's forward (see target.py)
    leaves a ``replay(keep)`` function here that gives the state after only the
    first ``keep`` tokens of the update, from what the verify already computed:
    the conv state is a slice of the conv input; the SSM state is either the
    per-step state the verify kept (``step_states``, for updates of at most
    ``slack`` tokens) or the recurrence rerun over ``keep`` tokens from the
    previous state. Never the projections.
    """

    def __init__(self, slack: int = 16, step_states: bool = True):
        super().__init__(size=2)
        self.slack = slack
        self.step_states = step_states
        self.replay: Optional[Callable[[int], tuple[mx.array, mx.array]]] = None
        self.last_update = 0

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        if n == 0:
            return 0
        if self.replay is None or n > self.last_update:
            raise ValueError(f"RecurrentCache can only undo its last update ({self.last_update} tokens), asked {n}")
        self[0], self[1] = self.replay(self.last_update - n)
        self.replay, self.last_update = None, 0
        return n
