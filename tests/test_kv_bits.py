"""``--kv-bits``: the target's KV cache quantized as mlx-lm quantizes it, rollback exact, output equal to mlx-lm's."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import QuantizedKVCache
from typer.testing import CliRunner

from dflash_mlx import DFlashError, generate, load, make_cache
from dflash_mlx.cli.main import app
from dflash_mlx.decode.batch import Batch
from dflash_mlx.decode.cache_files import fingerprint, read_state, write_state
from dflash_mlx.decode.settings import CacheLayout
from dflash_mlx.models import fixtures
from dflash_mlx.models.caches import KVQuantization

PROMPT = "def fibonacci(n):\n    return fib"


@pytest.fixture(scope="module")
def kv_dir(tmp_path_factory):
    """A target whose heads are 64 wide (mlx-lm's default group size) and that loops (copies are accepted)."""
    root = tmp_path_factory.mktemp("kv")
    config = fixtures.target_config("qwen3", hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    fixtures.write_target(root / "target", config, seed=0, init_scale=1.0)
    fixtures.write_drafter(root / "draft", fixtures.drafter_config(config, 1, target_layer_ids=[1, 2]))
    return root


@pytest.fixture(scope="module")
def kv_pairs(kv_dir):
    return {"drafter": load(str(kv_dir / "draft"), str(kv_dir / "target")), "alone": load(str(kv_dir / "target"))}


def mlx_lm_tokens(model, ids, n, **settings):
    return [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=n, **settings)]


# (bits, quantized_kv_start, prefill_step_size): from the start; in the prefill at a chunk's end; at the prompt's
# last token, which mlx-lm runs alone (16 of 17: chunks of 5 end at 5, 10, 15, 16); at its end; while decoding.
CASES = [(4, 0, 4), (8, 7, 3), (4, 16, 5), (4, 17, 4), (4, 40, 2048)]


@pytest.mark.parametrize("kind", ["drafter", "alone"])
@pytest.mark.parametrize("bits,start,chunk", CASES)
def test_greedy_output_equals_mlx_lm_with_the_same_quantized_cache(kv_pairs, kind, bits, start, chunk):
    target, drafter, tokenizer = kv_pairs[kind]
    ids = tokenizer.encode(PROMPT)
    assert len(ids) == 17
    settings = dict(kv_bits=bits, quantized_kv_start=start, prefill_step_size=chunk)
    reference = mlx_lm_tokens(target.model, ids, 100, **settings)
    assert reference != mlx_lm_tokens(target.model, ids, 100, prefill_step_size=chunk)  # quantizing changes it
    results = [generate(target, drafter, tokenizer, ids, max_tokens=100, eos_token_ids=[], block_size=block_size,
                        **settings) for block_size in (None, 16)]
    assert [r.tokens for r in results] == [reference, reference]
    assert results[0].by_source["copy"]["accepted"] > 10  # blocks were accepted: rollbacks ran on quantized caches


def test_the_cache_turns_quantized_where_mlx_lm_does_and_holds_its_history(kv_pairs, tmp_path):
    target, drafter, tokenizer = kv_pairs["drafter"]
    ids = tokenizer.encode(PROMPT)
    kv = KVQuantization(4, 64, 30)
    cache = make_cache(target, drafter, kv=kv)
    generate(target, drafter, tokenizer, ids, max_tokens=8, eos_token_ids=[], cache=cache, kv_bits=4,
             quantized_kv_start=30)
    assert all(type(c) is not QuantizedKVCache for c in cache.target) and len(cache.tokens) < 30
    generate(target, drafter, tokenizer, cache.tokens + [5], max_tokens=40, eos_token_ids=[], cache=cache, kv_bits=4,
             quantized_kv_start=30)
    assert all(type(c) is QuantizedKVCache for c in cache.target)
    cache.check()
    state = cache.snapshot()  # a prompt-cache entry of a quantized cache restores into a fresh one
    fresh = make_cache(target, drafter, kv=kv)
    fresh.restore(state)
    fresh.check()
    assert fresh.tokens == cache.tokens and all(type(c) is QuantizedKVCache for c in fresh.target)
    print_ = fingerprint(target, drafter, cache.layout)  # and through a file, as --prompt-cache-dir
    write_state(tmp_path / "entry.safetensors", state, print_)
    read, _ = read_state(tmp_path / "entry.safetensors", print_)
    again = make_cache(target, drafter, kv=kv)
    again.restore(read)
    again.check()
    assert again.tokens == cache.tokens and all(type(c) is QuantizedKVCache for c in again.target)
    assert print_ != fingerprint(target, drafter, CacheLayout(block_size=cache.block_size))  # never read into an unquantized run


def test_what_does_not_combine_with_kv_bits_is_refused(kv_pairs, pairs):
    target, drafter, tokenizer = kv_pairs["drafter"]
    with pytest.raises(DFlashError, match="do not combine"):
        generate(target, drafter, tokenizer, PROMPT, max_tokens=4, kv_bits=4, window=64)
    with pytest.raises(DFlashError, match="--kv-bits must be one of"):
        generate(target, drafter, tokenizer, PROMPT, max_tokens=4, kv_bits=7)
    small, small_drafter, small_tokenizer = pairs["qwen3"]  # heads 16 wide
    with pytest.raises(DFlashError, match="does not divide the target's head size 16"):
        generate(small, small_drafter, small_tokenizer, PROMPT, max_tokens=4, kv_bits=4)
    assert not Batch.fits(target, make_cache(target, drafter, kv=KVQuantization(4)))


def test_generate_takes_kv_bits(kv_pairs, kv_dir):
    target, drafter, tokenizer = kv_pairs["alone"]
    flags = ["--kv-bits", "4", "--quantized-kv-start", "10", "--no-chat-template", "--json"]
    result = CliRunner().invoke(app, ["generate", str(kv_dir / "target"), "-p", PROMPT, "-m", "40", *flags])
    assert result.exit_code == 0, result.output
    import json

    ids = tokenizer.encode(PROMPT)
    assert json.loads(result.stdout)["tokens"] == mlx_lm_tokens(target.model, ids, 40, kv_bits=4,
                                                                 quantized_kv_start=10)
    refused = CliRunner().invoke(app, ["generate", str(kv_dir / "target"), "-p", "hi", "--kv-bits", "4", "-w", "64"])
    assert refused.exit_code != 0 and "do not combine" in refused.output and "Traceback" not in refused.output


def test_serve_and_bench_take_kv_bits(kv_pairs, kv_dir):
    """The server answers as mlx-lm's quantized decoding (one request at a time: a quantized cache does not batch);
    bench compares with mlx-lm quantized alike, and its JSON says so."""
    import httpx2 as httpx
    from helpers import finish, start_server

    target, drafter, tokenizer = kv_pairs["drafter"]
    proc, url = start_server(kv_dir / "draft", kv_dir / "target", "--kv-bits", "4", "--quantized-kv-start", "10",
                             "--max-batch", "4")
    try:
        body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0}
        text = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        reference = mlx_lm_tokens(target.model, tokenizer.encode(PROMPT), 40, kv_bits=4, quantized_kv_start=10)
        assert text == tokenizer.decode(reference)
        assert httpx.get(f"{url}/health").json()["batch"] == {"max": 1}
    finally:
        proc.send_signal(2)
        finish(proc, 30)
    import json

    out = kv_dir / "bench.json"
    result = CliRunner().invoke(app, ["bench", str(kv_dir / "draft"), "--target", str(kv_dir / "target"),
                                      "--num-prompts", "1", "-m", "24", "--kv-bits", "8", "--quantized-kv-start", "0",
                                      "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["kv_bits"] == 8 and report["records"][0]["identical"]


def test_chat_keeps_a_quantized_cache_across_turns(kv_dir):
    """The second turn prefills only its new message, onto the cache the first turn left quantized."""
    result = CliRunner().invoke(app, ["chat", str(kv_dir / "target"), "--kv-bits", "4", "--quantized-kv-start", "8",
                                      "-m", "20"], input="hello\nand more\n")
    assert result.exit_code == 0, result.output
    assert "error" not in result.output.lower() and result.output.count("prefilled") == 2


def test_a_quantized_entry_read_back_from_disk_serves_a_shared_prefix(kv_pairs, tmp_path):
    """Issue 49, item 6: a quantized cache goes back to any point of its history in memory, so after a restart too
    (one definition of rewindable): a prompt that shares only a prefix with the stored one reuses that prefix."""
    from dflash_mlx import make_cache
    from dflash_mlx.decode.cache_files import fingerprint
    from dflash_mlx.server.prompt_cache import CacheLimits, PromptCache

    target, drafter, tokenizer = kv_pairs["drafter"]
    kv = KVQuantization(4, 64, 0)
    settings = dict(kv_bits=4, kv_group_size=64, quantized_kv_start=0, max_tokens=6, eos_token_ids=[])
    first = tokenizer.encode(PROMPT * 6)
    second, third = (first[:60] + tokenizer.encode(ending) for ending in (" a different ending", " and another"))

    def ask(store, ids):
        store.prepare(ids)
        out = generate(target, drafter, tokenizer, ids, cache=store.cache,
                       prompt_progress_callback=lambda done, total: done == total and store.prompt_done(), **settings)
        store.keep()
        return out

    def store():
        return PromptCache(make_cache(target, drafter, kv=kv), CacheLimits(directory=tmp_path),
                           fingerprint(target, drafter, CacheLayout(block_size=drafter.block_size, kv=kv)))

    before = store()
    ask(before, first)
    before.flush()
    assert before.cache.rewindable and ask(before, third).prompt_cached == 60  # in memory
    before.close()
    after = store()
    assert after.entries and all(e.rewindable for e in after.entries)
    assert ask(after, second).prompt_cached == 60
    after.close()


@pytest.mark.parametrize("model_type, refused", [
    ("lfm2", None),  # its attention layers quantize; its short-convolution states are saved and replayed as ever
    ("deepseek_v3", "does not run on mlx-lm's quantized KV cache"),  # its MLA reads its keys as arrays (mlx-lm too)
    ("gemma3_text", "sliding-window layers"),
    ("falcon_h1", "no full-attention layer cache to quantize"),  # its attention caches sit in CacheLists
])
def test_other_architectures_quantize_their_cache_or_say_why_not(tmp_path, model_type, refused):
    heads = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64}  # groups of 64
    extra = {"lfm2": dict(heads, block_dim=128), "gemma3_text": heads, "falcon_h1": heads,
             "deepseek_v3": {"kv_lora_rank": 64, "qk_rope_head_dim": 64}}.get(model_type, {})
    config = fixtures.target_config(model_type, **extra)
    fixtures.write_target(tmp_path / "target", config, seed=0)
    fixtures.write_drafter(tmp_path / "draft", fixtures.drafter_config(config, 1, target_layer_ids=[1]))
    target, drafter, tokenizer = load(str(tmp_path / "draft"), str(tmp_path / "target"))
    ids = tokenizer.encode(PROMPT)
    settings = dict(kv_bits=4, quantized_kv_start=8, prefill_step_size=5)
    if refused is not None:
        with pytest.raises(DFlashError, match=refused):
            generate(target, drafter, tokenizer, ids, max_tokens=4, **settings)
        return
    reference = mlx_lm_tokens(target.model, ids, 60, **settings)
    cache = make_cache(target, drafter, block_size=8, kv=KVQuantization(4, 64, 8))
    out = generate(target, drafter, tokenizer, ids, max_tokens=60, eos_token_ids=[], block_size=8, cache=cache,
                   **settings)
    assert out.tokens == reference
    assert any(type(c) is QuantizedKVCache for c in cache.target)  # rollbacks ran on quantized caches
