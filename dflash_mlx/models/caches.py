"""A sliding-window KV cache that speculative decoding can roll back.

mlx-lm's RotatingKVCache cannot be trimmed once it wraps, and its multi-token path
copies the whole window on every update. ``WindowKVCache`` keeps a ring of
``window + slack`` slots (plus ``sinks`` slots that are never evicted) and writes
new keys in place. Because rolled-back tokens only ever overwrite slots whose
positions have already left every future query's window, undoing up to ``slack``
tokens is just moving the offset back, at any fill state. A drafter's context ring may also
``skip`` positions that no future query's window reaches (a long prompt's head): they are never
computed, and no rollback goes back to where they would show.

Attention semantics: the query at absolute position q sees the sink positions
``[0, sinks)`` and the positions ``(q - window, q]``. Keys are stored after RoPE
at absolute positions, so slot order does not matter; the mask says which slot
holds which position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

import mlx.core as mx
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, QuantizedKVCache, _BaseCache

from ..errors import DFlashError

MAX_WINDOW = 2**30  # positions a window may span: far beyond any model's, and within MLX's 32-bit indices


def check_window(window: Optional[int], sinks: int = 0, block_size: int = 1) -> None:
    """Reject window settings that cannot give the promised semantics (sinks are kept positions of a window)."""
    if window is None:
        if sinks:
            raise DFlashError(f"sinks ({sinks}) are the first positions a window keeps: give a window too")
        return
    if window < 1:
        raise DFlashError(f"window must be >= 1, got {window}")
    if window > MAX_WINDOW:
        raise DFlashError(f"window must be at most {MAX_WINDOW:,} positions, got {window:,} (leave it out to keep "
                          "the whole context)")
    if window < block_size:
        raise DFlashError(f"window ({window}) must be at least the block size ({block_size})")
    if sinks < 0:
        raise DFlashError(f"sinks must be >= 0, got {sinks}")
    if sinks >= window:
        raise DFlashError(f"sinks ({sinks}) must be smaller than the window ({window})")


def check_window_fits(window: Optional[int], target: Any) -> None:
    """A window within the model's positions (a wider one keeps what no window keeps), over attention caches one per
    layer: a layer that keeps several (mlx-lm's ``CacheList``: a sparse-attention indexer beside its keys, a
    recurrent state beside attention) is not bounded by it, and its model may write those caches directly."""
    if window is not None and target.max_positions is not None and window > target.max_positions:
        raise DFlashError(f"--window {window:,} is beyond this model's {target.max_positions:,} positions: leave it "
                          "out to keep the whole context")
    if window is not None and "group" in target.kinds:
        raise DFlashError(f"--window: this {target.model_type} target keeps several caches per layer, which a window "
                          "does not bound; run it without --window")


FULL_CONTEXT = 0  # ``draft_window`` for a drafter that attends to its whole context


def check_draft_window(draft_window: Optional[int], block_size: int = 1) -> None:
    """A drafter window holds at least a block (0: the whole context)."""
    if draft_window is None:
        return
    if isinstance(draft_window, bool) or not isinstance(draft_window, int) or draft_window < 0:
        raise DFlashError(f"draft window must be an integer >= 0 (0: the whole context), got {draft_window!r}")
    if draft_window > MAX_WINDOW:
        raise DFlashError(f"draft window must be at most {MAX_WINDOW:,} positions, got {draft_window:,} (0: the whole "
                          "context)")
    if draft_window != FULL_CONTEXT and draft_window < block_size:
        raise DFlashError(f"draft window ({draft_window}) must be at least the block size ({block_size}), "
                          "or 0 for the whole context")


COPY_BLOCK = 16  # a verify block copy drafts may fill beyond the block of a drafter trained for fewer positions


def copy_block(drafter: Any) -> int:
    """The default verify block: the drafter's, or ``COPY_BLOCK`` where that is larger. The drafter drafts no deeper
    than its own block (beyond it, it would draft masks it never learnt); copies fill the rest."""
    return max(drafter.block_size, COPY_BLOCK)


def check_block_size(block_size: int, drafter: Any) -> None:
    """A block of 1 up to the drafter's, or up to ``COPY_BLOCK`` (the drafter drafts its own, copies fill it)."""
    if not isinstance(block_size, int) or block_size < 1:
        raise DFlashError(f"block_size must be an integer >= 1, got {block_size!r}")
    if block_size > copy_block(drafter):
        raise DFlashError(f"block size {block_size} is larger than the block this drafter was trained for "
                          f"({drafter.block_size}): use {copy_block(drafter)} or less")


KV_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize takes
KV_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class KVQuantization:
    """mlx-lm's quantized KV cache (``--kv-bits``): the target's full-attention layers turn into
    ``QuantizedKVCache``s once they hold ``start`` tokens, and stay so.

    The switch happens where mlx-lm's ``generate_step`` makes it: after a prefill chunk
    (the chunks run over the prompt but its last token, which runs alone) or a decode
    step, once the cache holds at least ``start`` tokens. A verified block never
    straddles that point (``DFlashCache.room``), so every position is computed against
    the same keys, full or quantized, as plain decoding computes it.
    """

    bits: int
    group_size: int = 64
    start: int = DEFAULT_QUANTIZED_KV_START

    @classmethod
    def of(cls, kv_bits: Optional[int] = None, kv_group_size: int = group_size, quantized_kv_start: int = start
           ) -> Optional[KVQuantization]:
        """From mlx-lm's three settings (None: no quantization)."""
        return None if kv_bits is None else cls(kv_bits, kv_group_size, quantized_kv_start)

    def keywords(self) -> dict[str, int]:
        """As mlx-lm's ``generate_step`` (and ``stream_generate``) take it."""
        return {"kv_bits": self.bits, "kv_group_size": self.group_size, "quantized_kv_start": self.start}

    def check(self, head_dims: set[int]) -> None:
        if self.bits not in KV_BITS:
            raise DFlashError(f"--kv-bits must be one of {', '.join(map(str, KV_BITS))}, got {self.bits}")
        if self.group_size not in KV_GROUP_SIZES:
            raise DFlashError(f"--kv-group-size must be one of {', '.join(map(str, KV_GROUP_SIZES))}, "
                              f"got {self.group_size}")
        if self.start < 0:
            raise DFlashError(f"--quantized-kv-start must be 0 or more, got {self.start}")
        odd = sorted(d for d in head_dims if d % self.group_size)
        if odd:
            raise DFlashError(f"--kv-group-size {self.group_size} does not divide the target's head size {odd[0]}: "
                              f"use {' or '.join(str(g) for g in KV_GROUP_SIZES if g <= odd[0] and odd[0] % g == 0) or 'none'}")


def check_kv(kv: Optional[KVQuantization], target: Any, window: Optional[int]) -> None:
    """Refuse what mlx-lm's quantized cache cannot hold, before a request relies on it."""
    if kv is None:
        return
    if window is not None:
        raise DFlashError("--kv-bits and --window do not combine: a window bounds the cache already (choose one)")
    if "sliding" in target.kinds:
        raise DFlashError("--kv-bits: this target has sliding-window layers, whose caches mlx-lm cannot quantize "
                          "either")
    if not any(kind == "full" for kind in target.kinds):
        raise DFlashError("--kv-bits: this target has no full-attention layer cache to quantize")
    kv.check(target.attention_dims)
    if problem := target.quantized_problem(kv.bits, kv.group_size):
        raise DFlashError(f"--kv-bits: this {target.model_type} target does not run on mlx-lm's quantized KV cache "
                          f"({problem})")


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
        self.first = 0  # the oldest non-sink position whose keys the ring still holds (older: overwritten or skipped)

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
        self.first = max(self.first, first + L - self.ring)  # the positions these slots held are gone
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
        self._grow(keys, values, n)  # after a skip the buffer may not reach the slots its offset names yet
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
        """Mask [n_block, keys] for a drafter block written right after ``n_context`` new context tokens.

        The block attends to all of itself (non-causally) and to the sinks. Block row
        i, at absolute position q = first + i, sees context position k when
        q - k < window: the last ``window - 1 - i`` context positions. That is the
        public DFlash training recipe's mask (and the rule the target's window
        follows), so a drafter infers as it was trained.
        """
        positions = self.key_positions(n_context + n_block)[None]
        first = self.offset + n_context
        rows = mx.arange(first, first + n_block)[:, None]
        visible = (positions < self.sinks) | (positions >= first) | (positions > rows - self.window)
        return (positions >= 0) & visible

    def history(self) -> tuple[mx.array, mx.array]:
        """Keys and values by absolute position [B, heads, offset, dim]: the positions a query at ``offset`` or
        later sees, the last ``window`` (and the sinks), each at its place; zeros where no such query looks."""
        first = max(self.sinks, self.offset - self.window)
        positions = list(range(min(self.sinks, self.offset))) + list(range(first, self.offset))
        slots = mx.array([self._slot(p) for p in positions], dtype=mx.int32)
        at = mx.array(positions, dtype=mx.int32)[None, None, :, None]

        def placed(stored: mx.array) -> mx.array:
            out = mx.zeros(stored.shape[:2] + (self.offset,) + stored.shape[3:], stored.dtype)
            return mx.put_along_axis(out, at, mx.take(stored, slots, axis=2), axis=2)

        return placed(self.keys), placed(self.values)

    @classmethod
    def holding(cls, keys: mx.array, values: mx.array, window: int, sinks: int = 0, slack: int = 16) -> WindowKVCache:
        """A window over a history given by absolute position [B, heads, length, dim] (``history``'s layout): its
        sinks and its last ``window`` positions, as if it had been written one update after another."""
        cache, length = cls(window, sinks, slack), keys.shape[2]
        first = max(sinks, length - window)
        cache._grow(keys, values, cache._stored(length))
        if sinks:
            cache._write(keys[..., : min(sinks, length), :], values[..., : min(sinks, length), :], 0)
        if first < length:
            cache._write(keys[..., first:, :], values[..., first:, :], first)
        cache.offset, cache.first = length, first
        return cache

    def skip(self, n: int) -> None:
        """Advance ``n`` positions without keys: positions no future query sees (the caller's promise), such as the
        head of a long prompt beyond a drafter's window. No rollback returns to where they, or earlier ones, would
        be seen."""
        self.offset += n
        self.first = max(self.first, self.offset)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Undo the last ``n`` tokens, as far back as every position a query there sees is still held: ``slack``
        tokens after a write at any fill state (less after a ``skip``, more while the ring has not wrapped)."""
        n = min(self.offset, n)
        end = self.offset - n
        if max(self.sinks, end - self.window + 1) < min(end, self.first):  # a position a query at ``end`` sees
            raise ValueError(f"WindowKVCache cannot roll back {n} tokens: it no longer holds what a query there sees")
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
        return tuple(map(str, (self.window, self.sinks, self.slack, self.offset, self.first)))

    @meta_state.setter
    def meta_state(self, v):
        self.window, self.sinks, self.slack, self.offset, self.first = map(int, v)
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
        self.offset = 0  # tokens consumed, so that every layer's cache can say where it stands

    def record(self, conv: mx.array, state: mx.array, replay: Optional[Callable[[int], tuple[mx.array, mx.array]]],
               tokens: int) -> None:
        """An update of ``tokens`` positions: the states after it, and how to undo its tail (None: it cannot be,
        a prefill chunk)."""
        self[0], self[1] = conv, state
        self.replay, self.last_update = (replay, tokens) if replay is not None else (None, 0)
        self.offset += tokens

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        if n == 0:
            return 0
        if self.replay is None or n > self.last_update:
            raise ValueError(f"RecurrentCache can only undo its last update ({self.last_update} tokens), asked {n}")
        self[0], self[1] = self.replay(self.last_update - n)
        self.replay, self.last_update = None, 0
        self.offset -= n
        return n


class ReplayCache(ArraysCache):
    """A recurrent layer's state (mlx-lm's ``ArraysCache``: LFM2's short convolutions, Mamba, Nemotron-H, Falcon-H1,
    Granite hybrids) that can go back to before its last update.

    The layer computes its states inside the model's own forward, so there are no per-step
    states to keep: before an update that may be rolled back the target saves the states
    (``save``; MLX arrays are values, so this copies nothing), and ``trim`` restores them. To
    keep part of an update, the target restores every layer and runs the kept tokens again
    (``Target.rewind``).
    """

    def __init__(self, size: int):
        super().__init__(size)
        self.offset = 0  # tokens consumed, as every layer's cache says where it stands
        self.saved: Optional[list[Optional[mx.array]]] = None  # the states before the last update, while undoable
        self.last_update = 0
        self.tokens: Optional[mx.array] = None  # the last update's input, for the target to run again in part

    def save(self, tokens: Optional[mx.array]) -> None:
        """Before an update over ``tokens`` ([B, S]); None: it cannot be undone (a prefill chunk)."""
        undoable = tokens is not None
        self.saved = [a if a is None else a[...] for a in self.cache] if undoable else None
        self.tokens, self.last_update = tokens, (tokens.shape[1] if undoable else 0)

    def advanced(self, tokens: int) -> None:
        """After an update of ``tokens`` positions."""
        self.offset += tokens

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Undo the whole last update (``n`` its length); a partial undo is a restore and a replay."""
        if n == 0:
            return 0
        if self.saved is None or n != self.last_update:
            raise ValueError(f"a recurrent layer undoes only its whole last update ({self.last_update} tokens), "
                             f"asked {n}")
        self.cache, self.saved, self.tokens, self.last_update = self.saved, None, None, 0
        self.offset -= n
        return n


class CacheGroup(CacheList):
    """The caches of one layer that go back together (mlx-lm's ``CacheList``: the latent KV and a sparse-attention
    indexer's keys, or a hybrid layer's recurrent state beside its attention)."""

    def __init__(self, *caches: Any):
        super().__init__(*caches)
        self.caches = list(caches)

    @property
    def offset(self) -> int:
        return self.caches[0].offset

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        trimmed = {c.trim(n) for c in self.caches}
        if len(trimmed) != 1:
            raise ValueError(f"the caches of one layer went back by {sorted(trimmed)} tokens, not alike")
        return trimmed.pop()

    @property
    def state(self) -> list[Any]:
        return [c.state for c in self.caches]

    @state.setter
    def state(self, v: list[Any]) -> None:
        for c, s in zip(self.caches, v):
            c.state = s

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)


def leaves(caches: Iterable[Any]) -> Iterator[Any]:
    """Every layer cache, those inside a ``CacheGroup`` one by one."""
    for c in caches:
        if isinstance(c, CacheGroup):
            yield from leaves(c.caches)
        else:
            yield c


def trim_to(caches: list[Any], length: int) -> None:
    """Trim every layer's cache back to ``length`` tokens; layers already there are left alone.

    Idempotent, unlike trimming by a count: a trim interrupted halfway can be finished.
    """
    for i, c in enumerate(caches):
        extra = c.offset - length
        if extra < 0 or (extra and c.trim(extra) != extra):
            raise RuntimeError(f"layer {i} ({type(c).__name__}) holds {c.offset} tokens, cannot return to {length}")


# A layer's cache as plain data: its kind, its arrays and its integers. What a snapshot holds and a file stores.
LayerState = tuple[str, list[mx.array], dict[str, int]]
GROUP = "group:"  # the kind of a ``CacheGroup``'s state: "group:" and its parts' kinds, joined by "+"


def layer_state(c: Any) -> LayerState:
    """What a layer's cache holds, in new array objects: later writes to the cache never reach them.

    (MLX shares the buffers, copying on the first write, so taking a state costs no copy.)
    """
    if isinstance(c, WindowKVCache):
        n = c._stored(c.offset)
        arrays = [] if c.keys is None else [c.keys[..., :n, :], c.values[..., :n, :]]
        return "window", arrays, {"window": c.window, "sinks": c.sinks, "slack": c.slack, "offset": c.offset,
                                  "first": c.first}
    if isinstance(c, (RecurrentCache, ReplayCache)):
        return "recurrent", [a[...] for a in c.cache if a is not None], {"offset": c.offset}
    if isinstance(c, KVCache):
        arrays = [] if c.keys is None else [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
        return "full", arrays, {"offset": c.offset}
    if isinstance(c, QuantizedKVCache):  # (data, scales, biases) of the keys, then of the values
        arrays = [] if c.keys is None else [a[..., : c.offset, :] for a in (*c.keys, *c.values)]
        return "quantized", arrays, {"offset": c.offset, "bits": c.bits, "group_size": c.group_size}
    if isinstance(c, CacheGroup):
        parts = [layer_state(part) for part in c.caches]
        meta = {f"{i}.{k}": v for i, (_, arrays, m) in enumerate(parts) for k, v in {**m, "arrays": len(arrays)}.items()}
        return GROUP + "+".join(kind for kind, _, _ in parts), [a for _, arrays, _ in parts for a in arrays], meta
    raise TypeError(f"no snapshot for a {type(c).__name__}")


def group_parts(state: LayerState) -> list[LayerState]:
    """A ``CacheGroup``'s state as its parts' states; ValueError where its fields do not say how (a forged one)."""
    kind, arrays, meta = state
    kinds, parts, at = kind[len(GROUP):].split("+"), [], 0
    for i, part in enumerate(kinds):
        own = {k.split(".", 1)[1]: v for k, v in meta.items() if k.split(".", 1)[0] == str(i)}
        n = own.pop("arrays", None)
        if n is None or n < 0 or at + n > len(arrays):
            raise ValueError(f"a layer group's part {i} does not say its arrays")
        parts.append((part, arrays[at : at + n], own))
        at += n
    if at != len(arrays):
        raise ValueError("a layer group holds arrays none of its parts claims")
    return parts


def misfit(state: LayerState, reference: LayerState, fresh: Any, kv: Optional[KVQuantization]) -> Optional[str]:
    """Why ``state`` cannot be this model's layer (None: it can): its kind, its arrays' count, dtypes and shapes
    against ``reference``, what one token leaves in the ``fresh`` cache of this layer.

    A snapshot from a file passes its checksums yet may come from another model or be forged: its arrays
    would restore, then fail the first pass that concatenates them (or, same shapes, answer wrongly).
    """
    kind, arrays, meta = state
    ref_kind, refs, _ = reference
    if kind.startswith(GROUP) and ref_kind == kind and isinstance(fresh, CacheGroup):
        try:
            parts = group_parts(state)
        except ValueError as e:
            return str(e)
        for i, (part, ref, c) in enumerate(zip(parts, group_parts(reference), fresh.caches)):
            if problem := misfit(part, ref, c, kv):
                return f"part {i} {problem}"
        return None
    if kind == "quantized" and ref_kind == "full" and kv is not None:
        if (meta.get("bits"), meta.get("group_size")) != (kv.bits, kv.group_size):
            return f"is quantized to {meta.get('bits')} bits in groups of {meta.get('group_size')}, not as --kv-bits"
        quantized = [q for r in refs for q in mx.quantize(r, kv.group_size, kv.bits)]  # keys', then values' parts
        refs = [(q.shape, q.dtype) for q in quantized]
    elif kind != ref_kind:
        return f"is a {kind} layer, this model's a {ref_kind} one"
    else:
        refs = [(r.shape, r.dtype) for r in refs]
    if arrays and len(arrays) != len(refs):
        return f"has {len(arrays)} arrays, this model's {len(refs)}"
    if "offset" not in meta:
        return "does not say how many tokens it holds"
    length = None if kind == "recurrent" else fresh._stored(meta["offset"]) if kind == "window" else meta["offset"]
    for a, (shape, dtype) in zip(arrays, refs):
        want = tuple(shape) if length is None else (*shape[:-2], length, shape[-1])
        if a.dtype != dtype or tuple(a.shape) != want:
            name = str(a.dtype).removeprefix("mlx.core."), str(dtype).removeprefix("mlx.core.")
            return f"holds a {name[0]} array of shape {tuple(a.shape)}, this model's are {name[1]} {want}"
    return None


def set_layer_state(c: Any, state: LayerState) -> Any:
    """Put ``state`` (from ``layer_state``) into a fresh cache of the same kind, in array objects of its own; the
    cache that holds it (a quantized layer's state takes a ``QuantizedKVCache`` in place of a fresh ``KVCache``)."""
    kind, arrays, meta = state
    if kind == "quantized" and type(c) is KVCache:
        c = QuantizedKVCache(meta["group_size"], meta["bits"])
    if kind != layer_state(c)[0]:
        raise ValueError(f"a {kind} layer state does not fit a {type(c).__name__}")
    if isinstance(c, CacheGroup):
        c.caches = [set_layer_state(part, s) for part, s in zip(c.caches, group_parts(state))]
        return c
    sizes = {"quantized": 6, "recurrent": len(getattr(c, "cache", ()))}
    if len(arrays) not in (0, sizes.get(kind, 2)):
        raise ValueError(f"a {kind} layer state of {len(arrays)} arrays does not fit a {type(c).__name__}")
    arrays = [a[...] for a in arrays]  # writes to this cache must not reach the snapshot's objects
    if kind == "quantized":
        c.keys, c.values = (tuple(arrays[:3]), tuple(arrays[3:])) if arrays else (None, None)
    elif kind == "window":
        if (meta["window"], meta["sinks"], meta["slack"]) != (c.window, c.sinks, c.slack):
            raise ValueError("window settings differ")
        c.keys, c.values = arrays if arrays else (None, None)
        c.first = meta.get("first", max(0, meta["offset"] - c.ring))  # a file from before skips: what a ring held
    elif kind == "recurrent":
        c.cache = arrays if arrays else [None] * len(c.cache)
        if isinstance(c, ReplayCache):
            c.saved, c.tokens, c.last_update = None, None, 0
        else:
            c.replay, c.last_update = None, 0
    else:
        c.keys, c.values = arrays if arrays else (None, None)
    c.offset = meta["offset"]
    return c


REWINDABLE = ("full", "quantized")  # layer kinds that go back to any point of their history (``layer_state``'s)


def rewindable_kinds(kinds: Iterable[str]) -> bool:
    """Whether layers of these kinds can all go back to any point of their history: the one definition, for
    caches in memory, their snapshots and their files."""
    return all(kind in REWINDABLE or (kind.startswith(GROUP) and rewindable_kinds(kind[len(GROUP):].split("+")))
               for kind in kinds)


def rewindable(layers: list[Any]) -> bool:
    """Whether these layer caches can go back to any point of their history (full attention, quantized or not)."""
    return rewindable_kinds(layer_kind(c) for c in layers)


def layer_kind(c: Any) -> str:
    """The kind ``layer_state`` gives this cache, without taking its arrays."""
    if isinstance(c, CacheGroup):
        return GROUP + "+".join(layer_kind(part) for part in c.caches)
    kinds = {WindowKVCache: "window", RecurrentCache: "recurrent", ReplayCache: "recurrent", KVCache: "full",
             QuantizedKVCache: "quantized"}
    return kinds.get(type(c), "other")
