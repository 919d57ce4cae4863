"""WindowKVCache against dense attention with an explicit band mask over the full history."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_mlx import DFlashError
from dflash_mlx.models.caches import WindowKVCache

H, D = 2, 8


def _attend(q, k, v, mask):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=mask)


def _reference(q, hist_k, hist_v, start, window, sinks):
    """Dense attention over every position ever kept, with the band mask built explicitly."""
    n = hist_k.shape[2]
    qpos = np.arange(start, start + q.shape[2])[:, None]
    kpos = np.arange(n)[None]
    mask = (kpos <= qpos) & ((kpos < sinks) | (kpos > qpos - window))
    return _attend(q, hist_k, hist_v, mx.array(mask))


@st.composite
def traffic(draw):
    window = draw(st.sampled_from([3, 8, 17, 40, 200]))
    sinks = draw(st.sampled_from([0, 0, 1, 4]).filter(lambda s: s < window))
    slack = 16
    steps = []
    for _ in range(draw(st.integers(5, 40))):
        size = draw(st.one_of(st.integers(1, 16), st.integers(17, 60)) if draw(st.booleans()) and not steps else st.integers(1, 16))
        rollback = draw(st.integers(0, min(size - 1, slack - 1)))
        steps.append((size, rollback))
    return window, sinks, slack, steps


@settings(max_examples=60, deadline=None)
@given(traffic(), st.integers(0, 2**16))
def test_matches_band_masked_dense_attention(case, seed):
    window, sinks, slack, steps = case
    rng = np.random.default_rng(seed)
    cache = WindowKVCache(window, sinks=sinks, slack=slack)
    hist_k = mx.zeros((1, H, 0, D))
    hist_v = mx.zeros((1, H, 0, D))
    for size, rollback in steps:
        q, k, v = (mx.array(rng.standard_normal((1, H, size, D)).astype(np.float32)) for _ in range(3))
        start = cache.offset
        mask = cache.make_mask(size)
        ck, cv = cache.update_and_fetch(k, v)
        out = _attend(q, ck, cv, mask)
        hist_k = mx.concatenate([hist_k, k], axis=2)
        hist_v = mx.concatenate([hist_v, v], axis=2)
        ref = _reference(q, hist_k, hist_v, start, window, sinks)
        np.testing.assert_allclose(np.array(out), np.array(ref), rtol=1e-5, atol=1e-5)
        cache.trim(rollback)
        hist_k, hist_v = hist_k[:, :, : cache.offset], hist_v[:, :, : cache.offset]
        assert cache.keys.shape[2] <= sinks + window + slack  # O(window + slack) memory


def test_rollback_long_after_wrapping():
    """Over a thousand positions through a small ring: verify-sized updates, rollbacks, single steps."""
    window, sinks = 32, 2
    cache = WindowKVCache(window, sinks=sinks, slack=16)
    rng = np.random.default_rng(0)
    hist_k = hist_v = mx.zeros((1, H, 0, D))

    def step(size):
        nonlocal hist_k, hist_v
        q, k, v = (mx.array(rng.standard_normal((1, H, size, D)).astype(np.float32)) for _ in range(3))
        start, mask = cache.offset, cache.make_mask(size)
        out = _attend(q, *cache.update_and_fetch(k, v), mask)
        hist_k = mx.concatenate([hist_k, k], axis=2)
        hist_v = mx.concatenate([hist_v, v], axis=2)
        ref = _reference(q, hist_k, hist_v, start, window, sinks)
        np.testing.assert_allclose(np.array(out), np.array(ref), rtol=1e-5, atol=1e-5)

    for i in range(300):
        size = 1 + i % 16
        step(size)
        cache.trim(size // 2)
        hist_k, hist_v = hist_k[:, :, : cache.offset], hist_v[:, :, : cache.offset]
        step(1)
    assert cache.offset > 1000


def test_memory_constant_once_full():
    cache = WindowKVCache(64, sinks=4, slack=16)
    sizes = []
    for _ in range(200):
        cache.update_and_fetch(mx.zeros((1, H, 5, D)), mx.zeros((1, H, 5, D)))
        cache.trim(2)
        sizes.append(cache.nbytes)
    full = sizes[-1]
    assert full == 2 * (4 + 64 + 16) * H * D * 4
    assert sizes[sizes.index(full) :] == [full] * (len(sizes) - sizes.index(full))


@pytest.mark.parametrize("window,sinks,match", [(0, 0, "window must be >= 1"), (8, -1, "sinks must be >= 0"), (8, 8, "sinks .8. must be smaller")])
def test_bad_settings(window, sinks, match):
    with pytest.raises(DFlashError, match=match):
        WindowKVCache(window, sinks=sinks)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("window,sinks", [(8, 0), (8, 2), (5, 1)])
def test_rollbacks_and_skips_go_exactly_as_far_as_what_a_query_sees_is_held(window, sinks, seed):
    """Random writes, rollbacks of any size and skips (a drafter window's pruned prompt head): a rollback is refused
    exactly when a query at the new end would see a position the ring no longer holds (overwritten, or skipped);
    every query attends as dense attention over the whole history does."""
    slack, ring = 4, window + 4
    rng = np.random.default_rng(seed)
    cache = WindowKVCache(window, sinks=sinks, slack=slack)
    hist_k = hist_v = mx.zeros((1, H, 0, D))
    held: set[int] = set()

    def write(size: int, check: bool) -> None:
        nonlocal hist_k, hist_v
        q, k, v = (mx.array(rng.standard_normal((1, H, size, D)).astype(np.float32)) for _ in range(3))
        start, mask = cache.offset, cache.make_mask(size)
        out = _attend(q, *cache.update_and_fetch(k, v), mask)
        hist_k, hist_v = mx.concatenate([hist_k, k], axis=2), mx.concatenate([hist_v, v], axis=2)
        held.update(range(start, start + size))
        held.difference_update(p for p in range(sinks, start + size - ring))  # their slots were written over
        if check:
            ref = _reference(q, hist_k, hist_v, start, window, sinks)
            np.testing.assert_allclose(np.array(out), np.array(ref), rtol=1e-5, atol=1e-5)

    for _ in range(60):
        action = rng.integers(0, 10)
        if action < 6:
            write(int(rng.integers(1, 2 * slack)), check=True)
        elif action < 9:
            n = int(rng.integers(1, 3 * slack))
            end = max(0, cache.offset - n)
            seen = range(min(sinks, end)), range(max(sinks, end - window + 1), end)
            legitimate = all(p in held for part in seen for p in part)
            if legitimate:
                cache.trim(n)
            else:
                with pytest.raises(ValueError, match="no longer holds"):
                    cache.trim(n)
                continue
            held.difference_update(range(end, end + n))
            hist_k, hist_v = hist_k[:, :, :end], hist_v[:, :, :end]
        elif cache.offset >= sinks:  # skip k positions, then the window's worth of context a query needs
            k = int(rng.integers(1, 3 * window))
            filler = mx.array(rng.standard_normal((1, H, k, D)).astype(np.float32))  # what the ring never gets
            cache.skip(k)
            held.difference_update(range(sinks, cache.offset))  # nothing before a skip is returned to either
            hist_k, hist_v = mx.concatenate([hist_k, filler], axis=2), mx.concatenate([hist_v, filler], axis=2)
            write(window - 1, check=False)  # context rows: no query of theirs reaches back to the skipped ones


@pytest.mark.parametrize("sinks", [0, 2])
def test_a_window_unrolls_to_positions_and_back(sinks):
    """``history`` lays a ring out by position (what a batch holds of a sliding layer) and ``holding`` makes a ring
    of that again: every position a later query sees is where it was, rolled-back writes included, so the next
    update attends alike in both."""
    window, slack, heads, dim = 8, 4, 2, 4
    ring, by_position = WindowKVCache(window, sinks, slack), []
    for step in range(20):
        keys = mx.random.normal((1, heads, 3, dim))
        ring.update_and_fetch(keys, keys + 1)
        by_position.append(keys)
        if step % 3 == 1:  # a verify that kept one of its three positions
            ring.trim(2)
            by_position[-1] = keys[:, :, :1]
    full = mx.concatenate(by_position, axis=2)
    keys, values = ring.history()
    assert keys.shape[2] == ring.offset == full.shape[2]
    seen = list(range(sinks)) + list(range(ring.offset - window, ring.offset))
    assert mx.array_equal(keys[:, :, seen], full[:, :, seen]) and mx.array_equal(values[:, :, seen], full[:, :, seen] + 1)
    back = WindowKVCache.holding(keys, values, window, sinks, slack)
    assert back.offset == ring.offset
    new, query = mx.random.normal((1, heads, 3, dim)), mx.random.normal((1, heads, 3, dim))
    attended = []
    for cache in (ring, back):
        mask = cache.make_mask(3)
        k, v = cache.update_and_fetch(new, new)
        attended.append(mx.fast.scaled_dot_product_attention(query, k, v, scale=0.5, mask=mask))
    assert mx.allclose(*attended, atol=1e-6)
