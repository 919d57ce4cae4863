"""DFlash greedy output equals mlx-lm's plain greedy output, token for token."""

from __future__ import annotations

import json

import pytest
from conftest import MAX_TOKENS, PROMPTS
from helpers import plain_greedy

from dflash_mlx import DFlashError, generate, load, make_cache
from dflash_mlx.decode.policy import COPY, DRAFTER, Plan
from dflash_mlx.decode.repeats import Repeats


@pytest.fixture(scope="module")
def references(pairs) -> dict:
    refs = {}
    for name, (target, _, tokenizer) in pairs.items():
        for p in PROMPTS:
            ids = tokenizer.encode(p)
            refs[name, p] = (ids, plain_greedy(target.model, ids, MAX_TOKENS))
    return refs


@pytest.mark.parametrize("name", ["qwen3", "llama"])
@pytest.mark.parametrize("block_size", [1, 2, 4, 8, 16, None])  # None: the adaptive policy
def test_greedy_equals_plain(pairs, references, name, block_size):
    target, drafter, tokenizer = pairs[name]
    for p in PROMPTS:
        ids, ref = references[name, p]
        out = generate(target, drafter, tokenizer, ids, max_tokens=MAX_TOKENS, block_size=block_size, eos_token_ids=[])
        assert out.tokens == ref, f"{name} B={block_size} prompt {p!r}"
        assert out.finish_reason == "length" and out.generation_tokens == MAX_TOKENS
        assert sum(a + 1 for a in out.acceptance) + 1 >= MAX_TOKENS  # every token came from a cycle


def test_text_matches_tokens(pairs):
    target, drafter, tokenizer = pairs["qwen3"]
    out = generate(target, drafter, tokenizer, PROMPTS[0], max_tokens=40, eos_token_ids=[])
    assert out.text == tokenizer.decode(out.tokens)


@pytest.mark.parametrize("block_size", [4, 16])
def test_long_accepted_runs_stay_lossless(looping, block_size):
    target, drafter, tokenizer, ids, ref, _ = looping
    out = generate(target, drafter, tokenizer, ids, max_tokens=MAX_TOKENS, block_size=block_size, eos_token_ids=[])
    assert out.tokens == ref
    assert out.tau > 1.5 and max(out.acceptance) == block_size - 1


@pytest.mark.parametrize("batched", [False, True])
def test_copies_fill_a_verify_beyond_a_small_drafters_block(looping_dir, tmp_path, batched):
    """A drafter trained for blocks of 8 drafts at most 7 tokens, while copies fill the default verify of 16 (edits
    and loops keep their long copies); the output is the target's own."""
    from dflash_mlx import batch_generate
    from dflash_mlx.models import fixtures

    config = json.loads((looping_dir / "target" / "config.json").read_text())
    fixtures.write_drafter(tmp_path / "b8", fixtures.drafter_config(config, block_size=8))
    target, drafter, tokenizer = load(str(tmp_path / "b8"), str(looping_dir / "target"))
    prompts = [tokenizer.encode("hello world"), tokenizer.encode("The quick brown fox")]
    if batched:
        results = batch_generate(target, drafter, tokenizer, prompts, max_tokens=MAX_TOKENS, eos_token_ids=[])
    else:
        results = [generate(target, drafter, tokenizer, ids, max_tokens=MAX_TOKENS, eos_token_ids=[]) for ids in prompts]
    cycles = [cycle for r in results for cycle in zip(r.drafted, r.sources)]
    for ids, result in zip(prompts, results):
        assert result.tokens == plain_greedy(target.model, ids, MAX_TOKENS)
    assert max(k for k, source in cycles if source == DRAFTER) <= 7
    assert max(k for k, source in cycles if source == COPY) > 7
    with pytest.raises(DFlashError, match=r"larger than the block this drafter was trained for \(8\): use 16 or"):
        generate(target, drafter, tokenizer, prompts[0], max_tokens=8, block_size=17)


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 13, 31, 50])
@pytest.mark.parametrize("block_size", [4, 16, None])
@pytest.mark.parametrize("source", ["auto", "copy"])
def test_max_tokens_cuts_mid_block(looping, max_tokens, block_size, source):
    target, drafter, tokenizer, ids, ref, _ = looping
    out = generate(target, drafter, tokenizer, ids, max_tokens=max_tokens, block_size=block_size, eos_token_ids=[],
                   draft_source=source)
    assert out.tokens == ref[:max_tokens]
    assert out.finish_reason == "length"


def _first_run_end(ref: list[int], token: int) -> int:
    """Index of the first token that follows a run of ``token`` long enough to be accepted."""
    run = 0
    for i, t in enumerate(ref):
        if t == token:
            run += 1
        elif run >= 3:
            return i
        else:
            run = 0
    raise AssertionError("no run in the reference output")


@pytest.mark.parametrize("block_size", [4, 16, None])
@pytest.mark.parametrize("source", ["auto", "copy"])
def test_eos_inside_accepted_run(looping, block_size, source):
    """The loop token as EOS: it sits inside every accepted run; stop at its first occurrence."""
    target, drafter, tokenizer, ids, ref, loop_token = looping
    first = ref.index(loop_token)
    out = generate(target, drafter, tokenizer, ids, max_tokens=MAX_TOKENS, block_size=block_size,
                   eos_token_ids=[loop_token], draft_source=source)
    assert out.tokens == ref[:first]
    assert out.finish_reason == "stop"


@pytest.mark.parametrize("block_size", [4, 16])
def test_eos_as_bonus_after_accepted_run(looping, block_size):
    """EOS arriving as the target's own token right after accepted drafts, mid-block."""
    target, drafter, tokenizer, ids, ref, loop_token = looping
    end = _first_run_end(ref, loop_token)
    eos = ref[end]
    assert eos not in ref[:end]
    responses = []
    out = generate(target, drafter, tokenizer, ids, on_response=responses.append, max_tokens=MAX_TOKENS,
                   block_size=block_size, eos_token_ids=[eos])
    assert out.tokens == ref[:end]
    assert out.finish_reason == "stop"
    assert responses[-1].accepted > 0  # the EOS came inside a block with accepted drafts


@pytest.mark.parametrize("block_size", [4, 16, None])
@pytest.mark.parametrize("source", ["auto", "copy"])
def test_a_stop_string_inside_an_accepted_run(looping, block_size, source):
    """A stop string completed mid-block: the text ends before it, the tokens with the one completing it, the
    caches hold the committed history, and the next call on them is lossless."""
    target, drafter, tokenizer, ids, ref, loop_token = looping
    full = tokenizer.decode(ref)
    end = _first_run_end(ref, loop_token)
    stop = tokenizer.decode(ref[end - 2 : end + 1])  # ends with the token after an accepted run
    assert stop and stop in full
    cache = make_cache(target, drafter, block_size=block_size)
    responses = []
    out = generate(target, drafter, tokenizer, ids, on_response=responses.append, max_tokens=MAX_TOKENS,
                   block_size=block_size, eos_token_ids=[], stop=["never in this text", stop], cache=cache,
                   draft_source=source)
    assert out.text == full[: full.index(stop)] and stop not in out.text
    assert out.finish_reason == "stop" and out.stop_sequence == stop
    assert out.tokens == ref[: len(out.tokens)] and stop in tokenizer.decode(out.tokens)
    assert stop not in tokenizer.decode(out.tokens[:-1])  # the last token is the one that completed it
    assert block_size is None or responses[-1].accepted > 0  # in a cycle with accepted drafts
    cache.check()
    again = generate(target, drafter, tokenizer, ids, max_tokens=MAX_TOKENS, block_size=block_size,
                     eos_token_ids=[], cache=cache)
    assert again.tokens == ref and again.prompt_cached == len(ids) - 1


def test_several_eos_ids(pairs, references):
    target, drafter, tokenizer = pairs["llama"]
    ids, ref = references["llama", PROMPTS[1]]
    a, b = ref[60], ref[25]
    stop = min(ref.index(a), ref.index(b))
    out = generate(target, drafter, tokenizer, ids, max_tokens=MAX_TOKENS, block_size=8, eos_token_ids=[a, b])
    assert out.tokens == ref[:stop]
    assert out.finish_reason == "stop"


def test_eos_as_first_token(pairs, references):
    target, drafter, tokenizer = pairs["qwen3"]
    ids, ref = references["qwen3", PROMPTS[0]]
    out = generate(target, drafter, tokenizer, ids, max_tokens=MAX_TOKENS, eos_token_ids=[ref[0]])
    assert out.tokens == [] and out.finish_reason == "stop" and out.text == ""


def test_tokenizer_eos_by_default(pairs):
    """Without eos_token_ids the tokenizer's EOS ids (from config/tokenizer) stop generation."""
    target, drafter, tokenizer = pairs["qwen3"]
    assert tokenizer.eos_token_ids  # the fixture tokenizer declares <|im_end|>
    ids = tokenizer.encode(PROMPTS[2])
    ref = plain_greedy(target.model, ids, MAX_TOKENS, eos=tokenizer.eos_token_ids)
    out = generate(target, drafter, tokenizer, ids, max_tokens=MAX_TOKENS)
    assert out.tokens == ref


def test_prompt_longer_than_block_and_single_token_prompt(pairs):
    target, drafter, tokenizer = pairs["llama"]
    for ids in ([5], list(range(10, 90))):
        ref = plain_greedy(target.model, ids, 64)
        out = generate(target, drafter, tokenizer, ids, max_tokens=64, block_size=16, eos_token_ids=[])
        assert out.tokens == ref


class _Alternating:
    """Copy drafts and the drafter's blocks, cycle by cycle."""

    def __init__(self):
        self.repeats, self.i = Repeats(), 0

    def start(self) -> None:
        self.repeats.reset()

    def plan(self, history) -> Plan:
        self.i += 1
        return Plan(3, COPY, 3) if self.i % 2 else Plan(3)

    def observe(self, plan, drafted, accepted, seconds, source="drafter") -> None:
        pass


@pytest.mark.parametrize("name", ["qwen3", "llama", "copies between"])
def test_drafts_use_exactly_the_committed_context(pairs, looping_dir, name):
    """Every cycle's drafts equal a fresh drafter pass over the features of all committed tokens.

    Lossless output cannot catch a drafter fed the wrong context (it only costs
    acceptance), so this replays each cycle from scratch: target features of the
    committed prefix, then the block [last token, MASK...] right after it. "copies
    between": a looping target whose copy cycles alternate with the drafter's, which
    must draft as if it had run all along.
    """
    import mlx.core as mx

    from dflash_mlx.decode.generate import stream_generate

    if name == "copies between":
        target, drafter, tokenizer = load(str(looping_dir / "random"), str(looping_dir / "target"))
        seq, policy = tokenizer.encode("hello world"), _Alternating()
    else:
        (target, drafter, tokenizer), policy = pairs[name], None
        seq = tokenizer.encode(PROMPTS[1])
    checked, copied = 0, 0
    for r in stream_generate(target, drafter, tokenizer, list(seq), max_tokens=60, block_size=4, eos_token_ids=[],
                             policy=policy):
        copied += r.source == COPY and r.accepted
        if r.drafted and r.source == DRAFTER:
            committed, last = seq[:-1], seq[-1]
            _, feats = target(mx.array(committed)[None], target.make_cache())
            block = mx.array([last] + [drafter.mask_token_id] * len(r.drafted))
            h = drafter(target.embed(block[None]), feats, drafter.make_cache())
            expected = mx.argmax(target.lm_head(h[:, 1:]), axis=-1)[0].tolist()
            assert r.drafted == expected, f"cycle {checked}"
            checked += 1
        seq = seq + r.tokens
    assert checked > (10 if policy else 20) and (policy is None or copied > 10)
