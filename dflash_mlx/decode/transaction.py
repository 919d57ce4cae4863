"""A pair's caches as one transaction: ``DFlashCache`` keeps the target's layers, the drafter's context and the
committed history in agreement through every cycle, however the caller leaves it.

``CacheState`` is what it holds at a point of its history, apart from it (a prompt-cache entry, a file).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ..errors import DFlashError
from ..models.caches import (
    KVQuantization,
    LayerState,
    WindowKVCache,
    layer_state,
    misfit,
    rewindable,
    rewindable_kinds,
    set_layer_state,
    trim_to,
)
from .per_pair import PerPair
from .settings import PREFILL_STEP, CacheLayout


@dataclass
class CacheState:
    """What a ``DFlashCache`` holds at a point of its history, apart from it: a prompt-cache entry."""

    tokens: list[int]
    target: list[LayerState]
    drafter: list[LayerState]
    context: Optional[mx.array]  # the pending features
    window: Optional[int]
    sinks: int
    block_size: int
    draft_window: int = 0  # the layout's, resolved (0: the drafter's whole context)

    @property
    def arrays(self) -> list[mx.array]:
        layers = [a for _, arrays, _ in self.target + self.drafter for a in arrays]
        return layers + ([self.context] if self.context is not None else [])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    @property
    def rewindable(self) -> bool:
        """Whether the caches can go back to any point of the history: every target layer full attention (the
        drafter's context, windowed or not, is made again from the target where it cannot follow)."""
        return rewindable_kinds(kind for kind, _, _ in self.target)


def common_prefix(held: Sequence[int], ids: Sequence[int]) -> int:
    """How many leading tokens two histories share."""
    return next((i for i, (a, b) in enumerate(zip(held, ids)) if a != b), min(len(held), len(ids)))


@dataclass(eq=False)
class DFlashCache:
    """Target and drafter caches that outlive one generation, and the history they hold.

    Invariant between cycles: every target layer holds exactly ``tokens``; the
    drafter's context caches hold the features of all of them but the last
    ``pending``, whose features wait in ``context`` for the next draft (with a
    drafter window, only those of positions it can still see: ``_prune``). Only the
    methods below move that state, each keeping the invariant: ``draft`` and
    ``absorb_context`` (the drafter takes the pending features), ``commit`` (a
    verified cycle or a prefill chunk), ``abandon`` (whatever an unfinished cycle
    applied is undone) and ``reset``.

    Pass the same cache to successive calls of ``stream_generate`` (a chat): each
    call prefills only the prompt tokens the cache does not already hold.
    """

    target: list[Any]
    drafter: list[Any]  # empty when the block size is 1 (the drafter never runs)
    layout: CacheLayout  # what the caches were made for, its block size resolved
    tokens: list[int] = field(default_factory=list)  # the committed history, in order
    fresh: Callable[[], tuple[list[Any], list[Any]]] = field(default=lambda: ([], []), repr=False)
    pair: tuple[Any, Any] = field(default=(None, None), repr=False)  # the (target, drafter) it was made for
    _owner: object = field(default=None, repr=False)
    # Features the drafter has not seen, one array per commit: joined once, when the drafter takes them
    # (joining at every commit would copy the growing pending block again and again).
    _parts: list[mx.array] = field(default_factory=list, repr=False)
    _pending: int = field(default=0, repr=False)  # positions in _parts, counted as they come (asked every step)

    @classmethod
    def empty(cls, target: Any, drafter: Any, layout: CacheLayout) -> DFlashCache:
        """Empty caches for generations of this pair with this layout (checked against the pair)."""
        layout = layout.of_pair(target, drafter)
        window, sinks, block_size = layout.window, layout.sinks, layout.block_size
        draft_window, draft_sinks = layout.drafter_window()

        def fresh() -> tuple[list[Any], list[Any]]:
            drafter_caches = drafter.make_cache(draft_window, draft_sinks, block_size) if block_size > 1 else []
            return target.make_cache(window, sinks, slack=block_size), drafter_caches

        target_caches, drafter_caches = fresh()
        return cls(target_caches, drafter_caches, layout, fresh=fresh, pair=(target, drafter))

    @property
    def window(self) -> Optional[int]:
        return self.layout.window

    @property
    def sinks(self) -> int:
        return self.layout.sinks

    @property
    def block_size(self) -> int:
        return self.layout.block_size  # type: ignore[return-value]  (resolved when the cache was made)

    @property
    def kv(self) -> Optional[KVQuantization]:
        return self.layout.kv

    @property
    def draft_window(self) -> int:
        return self.layout.draft_window  # type: ignore[return-value]  (resolved when the cache was made)

    @property
    def reach(self) -> Optional[int]:
        """How far back the next block sees the drafter's context: its widest layer window, where every layer has one
        (and no sinks); None: to the beginning."""
        if not self.drafter or not all(isinstance(c, WindowKVCache) and not c.sinks for c in self.drafter):
            return None
        return max(c.window for c in self.drafter)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.target + self.drafter)

    @property
    def pending(self) -> int:
        return self._pending

    @property
    def context(self) -> Optional[mx.array]:
        """[1, pending, F] target features of the last ``pending`` tokens, which the drafter has not seen."""
        if len(self._parts) > 1:
            self._parts = [mx.concatenate(self._parts, axis=1)]
        return self._parts[0] if self._parts else None

    @context.setter
    def context(self, value: Optional[mx.array]) -> None:
        self._parts = [] if value is None else [value]
        self._pending = 0 if value is None else value.shape[1]

    def begin(self, ids: list[int]) -> tuple[int, object]:
        """Hand the cache to a new generation over ``ids``: (how many leading ids it holds, the lease).

        A generation still in flight on this cache (a generator left suspended) is
        abandoned first and loses its lease. Of a history that ``ids`` does not
        extend, the common beginning is kept where the caches can return to it.
        """
        self.abandon()
        self._owner = lease = object()
        # At least the last prompt token runs: its logits start decoding.
        self._rewind(min(common_prefix(self.tokens, ids), len(ids) - 1))
        return len(self.tokens), lease

    def _rewind(self, n: int) -> None:
        """Keep the first ``n`` tokens of the history, where every layer can go back that far; else start over.

        Full-attention caches can; a window or a recurrent state only within the
        last cycle. A client resending a conversation whose reply re-tokenizes
        differently thus still reuses the part before it.
        """
        if n >= len(self.tokens):
            return
        held = len(self.tokens) - self.pending  # what the drafter's context caches hold
        try:
            self._target_to(n)
            if n < held:
                try:
                    trim_to(self.drafter, n)
                    self.context = None
                except (RuntimeError, ValueError):  # a window ring cannot return that far: made again
                    self._refill_drafter(n)
            elif self.context is not None:
                self.context = self.context[:, : n - held] if n > held else None
            del self.tokens[n:]
        except (RuntimeError, ValueError):
            self.reset()
        if not self.tokens:
            self.reset()

    def _refill_drafter(self, n: int) -> None:
        """The drafter's context caches made anew for the first ``n`` tokens of the history: the target computes the
        features of the positions the next block sees again, on copies of its caches (its own are left as they
        are), and they wait as pending features. Costs the target at most ``reach`` positions, against a prefill
        of all ``n`` that a cache starting over pays."""
        target, drafter = self.pair
        fresh_target, self.drafter = self.fresh()
        reach = self.reach
        start = 0 if reach is None else max(0, n - reach + 1)
        for c in self.drafter:
            c.skip(start)
        copies = [set_layer_state(c, layer_state(t)) for c, t in zip(fresh_target, self.target)]
        target.rewind(copies, start)
        self.context = None
        for first in range(start, n, PREFILL_STEP):
            ids = self.tokens[first : min(n, first + PREFILL_STEP)]
            self.absorb_context(drafter)
            _, features = target(mx.array(ids)[None], copies, last_logits_only=True, undoable=False)
            self._parts.append(features)
            self._pending += len(ids)
            mx.eval(features, [c.state for c in self.drafter])

    def _target_to(self, length: int) -> None:
        """The target's layers back to ``length`` tokens, as the target takes its caches back (a recurrent layer that
        keeps part of its last update runs that part again)."""
        target = self.pair[0]
        if target is None:
            trim_to(self.target, length)
        else:
            target.rewind(self.target, length)

    def check_pair(self, target: Any, drafter: Any) -> None:
        """Refuse to serve another pair: one of the same shapes would run on these caches and answer wrongly."""
        if self.pair[0] is not target or self.pair[1] is not drafter:
            raise DFlashError("this cache was made for another target/drafter pair: "
                              "make one for this pair with make_cache(target, drafter)")

    def holds_lease(self, lease: object) -> bool:
        return self._owner is lease

    def draft(self, drafter: Any, target: Any, last: mx.array, n: int, sampling: Any, key: Optional[mx.array]) -> Any:
        """The drafter's proposal of ``n`` tokens after ``last``; its pass absorbs the pending features.

        The features are dropped only once the pass has taken them, so an interrupt
        in between leaves state that ``abandon`` can still read.
        """
        proposal = drafter.propose(target, last, self.context, self.drafter, n, sampling, key)
        self.context = None
        return proposal

    def absorb_context(self, drafter: Any) -> None:
        """Append the pending features to the drafter's context caches without drafting (lazily)."""
        if self.context is not None:
            drafter.add_context(self.context, self.drafter)
            self.context = None

    def commit(self, kept: list[int], features: mx.array) -> None:
        """End a cycle: the target keeps its first ``len(kept)`` new positions and drops the rest.

        ``features`` are the target's features of the kept tokens; they are
        appended to the pending context (never replace it: a cycle that did not
        draft has not passed the earlier ones to the drafter).
        """
        self._target_to(len(self.tokens) + len(kept))
        self.tokens.extend(kept)
        if self.drafter:
            self._parts.append(features)
            self._pending += features.shape[1]
            self._prune()
        if self.kv is not None and len(self.tokens) >= self.kv.start:
            self.target = [c.to_quantized(self.kv.group_size, self.kv.bits) if type(c) is KVCache else c
                           for c in self.target]

    def _prune(self) -> None:
        """Drop the pending features no block can see any more (beyond the drafter's window from the next block's
        first row, at ``len(tokens)``): a long prompt's head is never run through the drafter."""
        reach = self.reach
        unseen = 0 if reach is None else self._pending - reach + 1
        if unseen > 0:
            self.context = self.context[:, unseen:]
            for c in self.drafter:
                c.skip(unseen)

    def room(self) -> Optional[int]:
        """The most positions the next block may take: up to where the KV cache turns quantized, if it is still
        ahead (None: no bound). A block across that point would compute its first positions against quantized keys
        that plain decoding computes against full ones."""
        if self.kv is None or len(self.tokens) >= self.kv.start or all(type(c) is not KVCache for c in self.target):
            return None
        return self.kv.start - len(self.tokens)

    def abandon(self) -> None:
        """Undo what an unfinished cycle applied: the caches hold ``tokens`` again.

        Safe from any point a generation can stop at (a break, ``close()``, an
        exception, Ctrl-C). Where an undo is impossible, which the decode loop never
        leads to, it starts over empty rather than keep a state that disagrees.
        """
        n = len(self.tokens)
        try:
            self._target_to(n)
            for c in self.drafter:  # a drafter pass stopped before dropping its block
                if c.offset > n:
                    trim_to([c], n)
            seen = {c.offset for c in self.drafter}
            if len(seen) > 1:
                raise RuntimeError("drafter layers disagree")
            unseen = n - seen.pop() if seen else 0
            if unseen > self.pending:
                raise RuntimeError("pending features lost")
            self.context = self.context[:, self.pending - unseen :] if unseen else None
        except (RuntimeError, ValueError):
            self.reset()

    def reset(self) -> None:
        """Forget everything: empty caches."""
        self.target, self.drafter = self.fresh()
        self.tokens = []
        self.context = None

    @property
    def rewindable(self) -> bool:
        """Whether the caches can return to any point of their history (else only to where a snapshot was kept):
        the target's can (the drafter's context is made again where it cannot follow, ``_refill_drafter``)."""
        return rewindable(self.target)

    def snapshot(self) -> CacheState:
        """What the caches hold now (between cycles or prefill chunks), kept apart from them."""
        context = self.context
        return CacheState(list(self.tokens), [layer_state(c) for c in self.target], [layer_state(c) for c in self.drafter],
                          None if context is None else context[...], self.window, self.sinks, self.block_size,
                          self.draft_window)

    def restore(self, state: CacheState) -> None:
        """Take over a snapshot's history (a generation in flight loses the cache); refused if it does not fit."""
        if (state.window, state.sinks, state.block_size, state.draft_window) != (
                self.window, self.sinks, self.block_size, self.draft_window):
            raise DFlashError(f"the snapshot was taken with window={state.window}, sinks={state.sinks}, "
                              f"block_size={state.block_size}, draft_window={state.draft_window}; this cache uses "
                              f"{self.layout.describe()}")
        target, drafter = self.fresh()
        if len(state.target) != len(target) or len(state.drafter) != len(drafter):
            raise DFlashError("the snapshot was taken of another model's caches (their layers differ)")
        self._check_fits(state, target, drafter)
        try:
            target = [set_layer_state(c, layer) for c, layer in zip(target, state.target)]
            drafter = [set_layer_state(c, layer) for c, layer in zip(drafter, state.drafter)]
        except (ValueError, KeyError) as e:
            raise DFlashError(f"the snapshot does not fit these caches ({e})") from None
        self.abandon()
        self._owner = None
        self.target, self.drafter, self.tokens = target, drafter, list(state.tokens)
        self.context = None if state.context is None else state.context[...]
        try:
            self.check()
        except RuntimeError as e:
            self.reset()
            raise DFlashError(f"the snapshot's caches disagree with its history ({e})") from None

    def _check_fits(self, state: CacheState, target: list[Any], drafter: list[Any]) -> None:
        """Refuse a snapshot whose arrays are not this model's (another model's file, a corrupt or forged one), layer
        by layer against what one token leaves in fresh caches of this pair."""
        reference = _reference(self)
        for where, states, refs, fresh in (("target", state.target, reference[0], target),
                                           ("drafter", state.drafter, reference[1], drafter)):
            for i, (got, ref, c) in enumerate(zip(states, refs, fresh)):
                problem = misfit(got, ref, c, self.kv)
                if problem is not None:
                    raise DFlashError(f"the snapshot's {where} layer {i} {problem}")
        context, features = state.context, reference[2]
        if context is not None and (context.dtype != features.dtype or context.ndim != 3 or context.shape[0] != 1
                                    or context.shape[2] != features.shape[2]
                                    or context.shape[1] > len(state.tokens)):
            raise DFlashError(f"the snapshot's pending features are {context.dtype} {tuple(context.shape)}, this "
                              f"model's {features.dtype} (1, n, {features.shape[2]})")

    def check(self) -> None:
        """Raise RuntimeError unless the invariant holds (tests call this after every call)."""
        n = len(self.tokens)
        for i, c in enumerate(self.target):
            if c.offset != n:
                raise RuntimeError(f"target layer {i} holds {c.offset} tokens, the history {n}")
        for i, c in enumerate(self.drafter):
            if c.offset + self.pending != n:
                raise RuntimeError(
                    f"drafter layer {i} holds {c.offset} tokens and {self.pending} are pending, the history {n}"
                )
        if not self.drafter and self.context is not None:
            raise RuntimeError("pending features without drafter caches")


_references = PerPair()


def _reference(cache: DFlashCache) -> tuple[list[LayerState], list[LayerState], mx.array]:
    """What one token leaves in fresh caches of ``cache``'s pair and layout: (target layers, drafter layers, the
    features), each layer's arrays of this model's dtypes and shapes. Computed once per loaded pair and layout."""
    target, drafter = cache.pair

    def one_token() -> tuple[list[LayerState], list[LayerState], mx.array]:
        target_caches, drafter_caches = cache.fresh()
        _, features = target(mx.array([[0]]), target_caches, last_logits_only=True, undoable=False)
        if drafter_caches:
            drafter.add_context(features, drafter_caches)
        mx.eval(features, [c.state for c in target_caches + drafter_caches])
        return [layer_state(c) for c in target_caches], [layer_state(c) for c in drafter_caches], features

    return _references.get(target, drafter, cache.layout, one_token)


def make_cache(
    target: Any, drafter: Any, window: Optional[int] = CacheLayout.window, sinks: int = CacheLayout.sinks,
    block_size: Optional[int] = CacheLayout.block_size, kv: Optional[KVQuantization] = CacheLayout.kv,
    draft_window: Optional[int] = CacheLayout.draft_window,
) -> DFlashCache:
    """Empty caches for generations of this pair with these settings (see ``stream_generate``); ``kv``: the
    target's KV cache quantized as mlx-lm's ``--kv-bits`` does."""
    return DFlashCache.empty(target, drafter, CacheLayout(window, sinks, block_size, kv, draft_window))
