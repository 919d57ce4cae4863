"""The decode cycle as a transaction: however a generation ends, the cache holds its committed history.

Every test checks ``DFlashCache.check()`` (target layers hold exactly ``cache.tokens``;
the drafter holds all of them but the pending features) after every call, then
continues on the same cache and compares with plain greedy decoding of the whole
history, or with what a fresh cache proposes for it.
"""

from __future__ import annotations

import pytest
from conftest import PROMPTS
from helpers import plain_greedy

from dflash_mlx import DFlashError, generate, load, make_cache, stream_generate
from dflash_mlx.decode.chat import ChatSession
from dflash_mlx.decode.cycle import CATCH_UP
from dflash_mlx.decode.policy import FixedBlock
from dflash_mlx.decode.settings import CacheLayout, DecodeSettings, RequestSettings
from dflash_mlx.models import fixtures

FOLLOW = " and then"


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A Qwen3.5 target (GatedDeltaNet + attention layers) and a drafter for it."""
    root = tmp_path_factory.mktemp("hybrid")
    config = fixtures.target_config("qwen3_5")
    fixtures.write_target(root / "t", config)
    fixtures.write_drafter(root / "d", fixtures.drafter_config(config, 1, target_layer_ids=[1]))
    return load(str(root / "d"), str(root / "t"))


@pytest.fixture(params=["qwen3", "looping", "hybrid"])
def pair(request, pairs, looping, hybrid):
    """(target, drafter, tokenizer, prompt ids): random drafts, long accepted runs, recurrent layers."""
    if request.param == "qwen3":
        target, drafter, tokenizer = pairs["qwen3"]
        return target, drafter, tokenizer, tokenizer.encode(PROMPTS[1])
    if request.param == "looping":
        target, drafter, tokenizer, ids, _, _ = looping
        return target, drafter, tokenizer, ids
    target, drafter, tokenizer = hybrid
    return target, drafter, tokenizer, tokenizer.encode(PROMPTS[0])


def _reference(target, ids, max_tokens, window):
    cache = target.make_cache(window, 0, 1) if window else None
    return plain_greedy(target.model, ids, max_tokens, prompt_cache=cache)


def _leave(how: str, stream, k: int) -> list[int]:
    """Consume ``k`` responses of ``stream``, then leave it the way ``how`` says; the tokens received."""
    got: list[int] = []
    if how == "break":
        for i, r in enumerate(stream):
            got.extend(r.tokens)
            if i + 1 == k:
                break
    elif how == "close":
        for _ in range(k):
            got.extend(next(stream).tokens)
        stream.close()
    elif how == "raise":
        with pytest.raises(RuntimeError, match="consumer failed"):
            for i, r in enumerate(stream):
                got.extend(r.tokens)
                if i + 1 == k:
                    raise RuntimeError("consumer failed")
    elif how == "interrupt":
        with pytest.raises(KeyboardInterrupt):
            for i, r in enumerate(stream):
                got.extend(r.tokens)
                if i + 1 == k:
                    raise KeyboardInterrupt
    return got


@pytest.mark.parametrize("window", [None, 32])
@pytest.mark.parametrize("how", ["break", "close", "raise", "interrupt"])
def test_leaving_the_generator_keeps_the_cache_valid(pair, how, window):
    target, drafter, tokenizer, ids = pair
    for k in range(1, 11):
        cache = make_cache(target, drafter, window=window, block_size=8)
        got = _leave(how, stream_generate(target, drafter, tokenizer, ids, max_tokens=120, block_size=8,
                                          eos_token_ids=[], window=window, cache=cache), k)
        cache.check()
        assert got == _reference(target, ids, len(got), window)
        history = ids + got
        assert history[: len(cache.tokens)] == cache.tokens and len(cache.tokens) >= len(history) - 1
        follow = history + tokenizer.encode(FOLLOW)
        out = generate(target, drafter, tokenizer, follow, max_tokens=30, block_size=8, eos_token_ids=[],
                       window=window, cache=cache)
        cache.check()
        assert out.prompt_cached >= len(history) - 1, f"k={k}: the cache was not reused"
        assert out.tokens == _reference(target, follow, 30, window), f"{how} after {k} responses"


def test_a_suspended_generation_loses_the_cache_to_a_new_one(pairs):
    """A generator left suspended mid-cycle: the next call on its cache abandons that cycle first."""
    target, drafter, tokenizer = pairs["qwen3"]
    ids = tokenizer.encode(PROMPTS[2])
    cache = make_cache(target, drafter, block_size=4)
    old = stream_generate(target, drafter, tokenizer, ids, max_tokens=60, block_size=4, eos_token_ids=[], cache=cache)
    got = [t for _ in range(3) for t in next(old).tokens]
    follow = ids + got + tokenizer.encode(FOLLOW)
    out = generate(target, drafter, tokenizer, follow, max_tokens=40, block_size=4, eos_token_ids=[], cache=cache)
    cache.check()
    assert out.prompt_cached >= len(ids + got) - 1
    assert out.tokens == plain_greedy(target.model, follow, 40)
    with pytest.raises(DFlashError, match="another generation took over this cache"):
        next(old)
    cache.check()  # the old generator's exit did not touch the new owner's cache


@pytest.mark.parametrize("window", [None, 32])
def test_next_turn_drafts_as_a_fresh_cache_does(pairs, window):
    """Every max_tokens from 1 to 40: the drafter's context survives one-token cycles.

    The next turn on the reused cache must propose, cycle by cycle, exactly the
    drafts a fresh cache proposes for the same history. A cycle that dropped
    pending features (the old one-token-cycle bug) drafts differently.
    """
    target, drafter, tokenizer = pairs["qwen3"]
    ids = tokenizer.encode(PROMPTS[0])
    opts = dict(block_size=4, eos_token_ids=[], window=window)
    for max_tokens in range(1, 41):
        cache = make_cache(target, drafter, window=window, block_size=4)
        first = generate(target, drafter, tokenizer, ids, max_tokens=max_tokens, cache=cache, **opts)
        cache.check()
        follow = ids + first.tokens + tokenizer.encode(FOLLOW)
        reused = list(stream_generate(target, drafter, tokenizer, follow, max_tokens=24, cache=cache, **opts))
        cache.check()
        fresh = list(stream_generate(target, drafter, tokenizer, follow, max_tokens=24, **opts))
        assert reused[0].prompt_cached > 0
        assert [r.drafted for r in reused] == [r.drafted for r in fresh], f"max_tokens={max_tokens}"
        assert [t for r in reused for t in r.tokens] == [t for r in fresh for t in r.tokens]


def test_interrupted_prefill_resumes(pairs):
    """Ctrl-C during a long prefill: the chunks done stay committed, the next call starts there."""
    target, drafter, tokenizer = pairs["llama"]
    ids = tokenizer.encode(" ".join(PROMPTS * 3))
    cache = make_cache(target, drafter, block_size=8)

    def interrupt(done: int, total: int) -> None:
        if done >= 30:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        generate(target, drafter, tokenizer, ids, max_tokens=40, block_size=8, eos_token_ids=[], cache=cache,
                 prefill_step_size=10, prompt_progress_callback=interrupt)
    cache.check()
    assert cache.tokens == ids[:30]
    out = generate(target, drafter, tokenizer, ids, max_tokens=40, block_size=8, eos_token_ids=[], cache=cache,
                   prefill_step_size=10)
    cache.check()
    assert out.prompt_cached == 30
    assert out.tokens == plain_greedy(target.model, ids, 40)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_chat_survives_an_error_mid_reply(pairs, error):
    """A reply that fails after a few cycles: the session's cache stays valid, the next turn is lossless."""
    target, drafter, tokenizer = pairs["qwen3"]
    session = ChatSession(target, drafter, tokenizer, decoding=DecodeSettings(CacheLayout(block_size=4)),
                          asked=RequestSettings(max_tokens=40, eos_token_ids=frozenset()))
    session.reply("hello there")
    session.cache.check()
    seen = []

    def fail(response) -> None:
        seen.append(response)
        if len(seen) == 3:
            raise error("stop")

    with pytest.raises(error):
        session.reply("tell me more", on_response=fail)
    session.cache.check()
    assert len(session.messages) == (4 if error is KeyboardInterrupt else 2)
    result = session.reply("and then?")
    session.cache.check()
    prompt = session.ids[: len(session.ids) - len(result.tokens)]
    assert result.tokens == plain_greedy(target.model, prompt, 40)
    if error is KeyboardInterrupt:  # the partial reply is in the history, so the caches were reused
        assert result.prompt_cached > 0


def test_repeated_target_layer_ids_generate_losslessly(tmp_path):
    """The published id rule gives [1, 1] for a 2-layer drafter on a 4-layer target."""
    config = fixtures.target_config("qwen3", num_hidden_layers=4)
    fixtures.write_target(tmp_path / "t", config)
    fixtures.write_drafter(tmp_path / "d", fixtures.drafter_config(config, 2, target_layer_ids=[1, 1]))
    target, drafter, tokenizer = load(str(tmp_path / "d"), str(tmp_path / "t"))
    ids = tokenizer.encode(PROMPTS[0])
    cache = make_cache(target, drafter, block_size=8)
    out = generate(target, drafter, tokenizer, ids, max_tokens=60, block_size=8, eos_token_ids=[], cache=cache)
    cache.check()
    assert out.tokens == plain_greedy(target.model, ids, 60)


def test_prefill_keeps_no_replay_buffers(hybrid):
    """A prefill chunk cannot be rolled back, so its recurrent layers keep no replay (memory)."""
    from dflash_mlx.models.caches import RecurrentCache

    target, drafter, tokenizer = hybrid
    cache = make_cache(target, drafter, block_size=4)
    gen = stream_generate(target, drafter, tokenizer, PROMPTS[2], max_tokens=20, block_size=4, cache=cache)
    next(gen)  # the prefill's token; the first cycle (a verify) is now in flight
    recurrent = [c for c in cache.target if isinstance(c, RecurrentCache)]
    assert recurrent and all(c.replay is not None and c.last_update == 4 for c in recurrent)
    gen.close()
    cache.check()
    assert all(c.replay is None for c in recurrent)
    prefill_only = make_cache(target, drafter, block_size=4)
    generate(target, drafter, tokenizer, PROMPTS[0], max_tokens=1, block_size=4, cache=prefill_only)
    prefill_only.check()
    assert all(c.replay is None for c in prefill_only.target if isinstance(c, RecurrentCache))


def _interrupt_after_commit(monkeypatch, at: int) -> None:
    """Simulate a Ctrl-C landing after a cycle's commit (from cycle ``at`` on, one that accepted drafts),
    before its tokens reach the caller."""
    from dflash_mlx.decode.policy import FixedBlock

    calls = {"n": 0}

    def observe(self, plan: object, drafted: int, accepted: int, seconds: float, source: str = "drafter") -> None:
        calls["n"] += 1
        if calls["n"] >= at and accepted > 0:
            raise KeyboardInterrupt

    monkeypatch.setattr(FixedBlock, "observe", observe)


def test_ctrl_c_between_commit_and_delivery(pairs, looping, monkeypatch):
    """The committed cycle stays committed: cache.tokens runs past what was received, and goes on."""
    target, drafter, tokenizer, ids, _, _ = looping
    _interrupt_after_commit(monkeypatch, 3)
    cache = make_cache(target, drafter, block_size=8)
    got = []
    with pytest.raises(KeyboardInterrupt):
        for r in stream_generate(target, drafter, tokenizer, ids, max_tokens=100, block_size=8, eos_token_ids=[],
                                 cache=cache):
            got.extend(r.tokens)
    cache.check()
    received = ids + got
    assert len(cache.tokens) > len(received) and cache.tokens[: len(received)] == received
    monkeypatch.undo()
    follow = cache.tokens + tokenizer.encode(FOLLOW)
    out = generate(target, drafter, tokenizer, follow, max_tokens=30, block_size=8, eos_token_ids=[], cache=cache)
    cache.check()
    assert out.prompt_cached == len(follow) - len(tokenizer.encode(FOLLOW))
    assert out.tokens == plain_greedy(target.model, follow, 30)


def test_chat_keeps_the_committed_reply_after_ctrl_c(tmp_path, monkeypatch):
    """A drafter that drafts the chat reply's loop token, so the interrupted cycle had accepted drafts."""
    import collections

    config = fixtures.target_config("qwen3")
    fixtures.write_target(tmp_path / "target", config, seed=0, init_scale=1.0)
    fixtures.write_drafter(tmp_path / "random", fixtures.drafter_config(config))
    target, drafter, tokenizer = load(str(tmp_path / "random"), str(tmp_path / "target"))
    prompt = ChatSession(target, drafter, tokenizer)
    prompt.messages.append({"role": "user", "content": "hello world"})
    loop_token = collections.Counter(plain_greedy(target.model, prompt._prompt(), 200)).most_common(1)[0][0]
    fixtures.write_constant_drafter(tmp_path / "constant", fixtures.drafter_config(config), tmp_path / "target", loop_token)
    target, drafter, tokenizer = load(str(tmp_path / "constant"), str(tmp_path / "target"))

    session = ChatSession(target, drafter, tokenizer, decoding=DecodeSettings(CacheLayout(block_size=8)),
                          asked=RequestSettings(max_tokens=200, eos_token_ids=frozenset()))
    _interrupt_after_commit(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        session.reply("hello world")
    monkeypatch.undo()
    session.cache.check()
    assert session.ids == session.cache.tokens and session.messages[-1]["role"] == "assistant"
    interrupted = list(session.ids)
    result = session.reply("go on")
    session.cache.check()
    prompt_ids = session.ids[: len(session.ids) - len(result.tokens)]
    assert prompt_ids[: len(interrupted)] == interrupted and result.prompt_cached == len(interrupted)
    assert result.tokens == plain_greedy(target.model, prompt_ids, 200)


@pytest.mark.parametrize("window", [None, 32])
def test_plain_decoding_keeps_the_drafter_context_caught_up(pairs, window):
    """A long run of plain steps (depth 0) leaves at most ``CATCH_UP`` positions for the next draft to
    absorb, and the drafts after it are those of a fresh cache over the same history."""
    target, drafter, tokenizer = pairs["qwen3"]
    ids = tokenizer.encode(PROMPTS[0])
    opts = dict(block_size=4, eos_token_ids=[], window=window)
    cache = make_cache(target, drafter, window=window, block_size=4)
    behind = []
    for _ in stream_generate(target, drafter, tokenizer, ids, max_tokens=3 * CATCH_UP, cache=cache,
                             policy=FixedBlock(1), **opts):
        behind.append(cache.pending)  # (mid-generation a plain step is already in flight: no check() here)
    cache.check()
    most = CATCH_UP if window is None else min(CATCH_UP, window)  # a window keeps only what a block still sees
    assert max(behind) == most - 1 and behind[-1] < most  # it fell behind by a pass's worth, then caught up
    follow = cache.tokens + tokenizer.encode(FOLLOW)
    reused = list(stream_generate(target, drafter, tokenizer, follow, max_tokens=24, cache=cache, **opts))
    fresh = list(stream_generate(target, drafter, tokenizer, follow, max_tokens=24, **opts))
    assert [r.drafted for r in reused] == [r.drafted for r in fresh]
    assert [t for r in reused for t in r.tokens] == [t for r in fresh for t in r.tokens]


def test_a_cache_serves_only_the_pair_it_was_made_for(models_dir, pairs):
    """Another pair of the very same shapes would run on these caches and answer wrongly: refused in one line."""
    target, drafter, tokenizer = pairs["qwen3"]
    twin = load(str(models_dir / "qwen3-dflash"), str(models_dir / "qwen3"))
    ids = tokenizer.encode(PROMPTS[0])
    cache = make_cache(target, drafter)
    generate(target, drafter, tokenizer, ids, max_tokens=8, cache=cache)
    for other in ((twin[0], drafter), (target, twin[1])):
        with pytest.raises(DFlashError, match="made for another target/drafter pair"):
            generate(*other, tokenizer, ids, max_tokens=8, cache=cache)
    cache.check()
    assert generate(target, drafter, tokenizer, ids, max_tokens=8, cache=cache).prompt_cached == len(ids) - 1
