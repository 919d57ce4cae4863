"""`serve --max-batch N`: requests decode together, each as it would alone, and a long prefill does not hold the others."""

from __future__ import annotations

import json
import threading
import time

import httpx2 as httpx
import pytest
from helpers import finish, start_server

from dflash_mlx import generate, load
from dflash_mlx.models import fixtures

LONG = "the quick brown fox jumps over the lazy dog. " * 400


def _stream(url: str, body: dict, out: dict, key: str) -> None:
    """A streamed /v1/completions: its text, tokens' logprobs, finish reason and when its first token came (the
    clock's time, comparable across requests)."""
    text, logprobs, finish_reason, first = "", [], None, None
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            if choice["text"] and first is None:
                first = time.perf_counter()
            text += choice["text"]
            if choice.get("logprobs"):
                logprobs += choice["logprobs"]["token_logprobs"]
            finish_reason = choice.get("finish_reason") or finish_reason
    out[key] = {"text": text, "logprobs": logprobs, "finish_reason": finish_reason, "first": first}


def _together(url: str, bodies: dict[str, dict], delays: dict[str, float] | None = None) -> dict:
    out: dict = {}
    threads = []
    for key, body in bodies.items():
        threads.append(threading.Thread(target=_stream, args=(url, body, out, key)))
        threads[-1].start()
        time.sleep((delays or {}).get(key, 0.0))
    for t in threads:
        t.join(timeout=300)
    return out


@pytest.fixture(scope="module")
def batched(models_dir):
    proc, url = start_server(models_dir / "qwen3-dflash", models_dir / "qwen3", "--max-batch", "4",
                             "--prefill-step", "64")
    yield url
    proc.send_signal(2)
    out, err = finish(proc, 30)
    assert proc.returncode == 0 and "Traceback" not in err, err


def _each_as_alone(got: dict, bodies: dict[str, dict], pair: tuple) -> None:
    """Every streamed answer is what ``generate`` gives its request alone: text, finish reason, logprobs."""
    target, drafter, tokenizer = pair
    for key, body in bodies.items():
        settings = dict(max_tokens=body["max_tokens"], temperature=body["temperature"], seed=body.get("seed"),
                        stop=body.get("stop"), logprobs=0 if "logprobs" in body else None)
        alone = generate(target, drafter, tokenizer, body["prompt"], **settings)
        assert got[key]["text"] == alone.text, key
        assert got[key]["finish_reason"] == ("stop" if alone.finish_reason == "stop" else "length"), key
        if "logprobs" in body:
            assert got[key]["logprobs"] == pytest.approx(alone.logprobs, abs=1e-4)


def test_requests_in_one_batch_get_what_each_gets_alone(batched, pairs):
    """Different prompts, budgets, stops, sampling settings and logprobs, decoding together."""
    bodies = {
        "greedy": dict(prompt="def fibonacci(n):\n    return", max_tokens=120, temperature=0),
        "short": dict(prompt="The quick brown fox", max_tokens=7, temperature=0, logprobs=1),
        "stop": dict(prompt="import json\nimport os\n\nclass", max_tokens=150, temperature=0, stop=["\n\n"]),
        "seeded": dict(prompt="hi", max_tokens=60, temperature=0.8, seed=3),
    }
    _each_as_alone(_together(batched, bodies), bodies, pairs["qwen3"])
    metrics = httpx.get(f"{batched}/metrics").text
    assert "dflash_batch_rows" in metrics


def test_a_request_that_joins_during_a_long_prefill_answers_first(batched, pairs):
    """A 3,000-token prompt prefills in 64-token chunks; a short request sent meanwhile is prefilled and decodes
    between those chunks, so its first token comes long before the long prompt's, and both answers are exact."""
    target, drafter, tokenizer = pairs["qwen3"]
    ids = tokenizer.encode(LONG)[:3000]
    bodies = {"long": dict(prompt=ids, max_tokens=20, temperature=0),
              "short": dict(prompt="The quick brown fox", max_tokens=30, temperature=0)}
    got = _together(batched, bodies, delays={"long": 0.5})
    assert got["short"]["first"] < got["long"]["first"], got
    assert got["long"]["text"] == generate(target, drafter, tokenizer, ids, max_tokens=20).text
    assert got["short"]["text"] == generate(target, drafter, tokenizer, "The quick brown fox", max_tokens=30).text
    health = httpx.get(f"{batched}/health").json()
    assert health["batch"]["max"] == 4 and health["batch"]["decoding"] == 0


def test_one_at_a_time_keeps_the_queue_in_order(models_dir, pairs):
    """--max-batch 1 is the FIFO server: the short request waits for the long one."""
    _, _, tokenizer = pairs["qwen3"]
    proc, url = start_server(models_dir / "qwen3-dflash", models_dir / "qwen3", "--max-batch", "1",
                             "--prefill-step", "64")
    try:
        ids = tokenizer.encode(LONG)[:3000]
        got = _together(url, {"long": dict(prompt=ids, max_tokens=20, temperature=0),
                              "short": dict(prompt="The quick brown fox", max_tokens=30, temperature=0)},
                        delays={"long": 0.5})
        assert got["short"]["first"] > got["long"]["first"]
        assert httpx.get(f"{url}/health").json()["batch"] == {"max": 1}
    finally:
        proc.send_signal(2)
        finish(proc, 30)


def test_a_batch_that_cannot_be_says_so_at_start_up(models_dir):
    """--max-batch with --window serves one request at a time: said once, not silently (issue 49, 7). (--kv-bits
    says so the same way; no group size fits this fixture's heads of 16.)"""
    for flags, why in ((["--window", "64"], "--window"),):
        proc, url = start_server(models_dir / "qwen3-dflash", models_dir / "qwen3", "--max-batch", "4", *flags)
        try:
            assert httpx.get(f"{url}/health").json()["batch"] == {"max": 1}
        finally:
            proc.send_signal(2)
            _, err = finish(proc, 30)
        assert f"--max-batch 4: requests run one at a time: {why} keeps rows from sharing a pass" in err, err


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A served Qwen3.5-layout target (GatedDeltaNet and full attention) whose replies repeat (copies pay), and its
    pair loaded here: (URL, pair)."""
    root = tmp_path_factory.mktemp("hybrid")
    config = fixtures.target_config("qwen3_5")
    fixtures.write_target(root / "target", config, seed=7, init_scale=0.3)
    fixtures.write_drafter(root / "draft", fixtures.drafter_config(config, 2, target_layer_ids=[0, 2]))
    proc, url = start_server(root / "draft", root / "target", "--max-batch", "4")
    yield url, load(str(root / "draft"), str(root / "target"))
    proc.send_signal(2)
    out, err = finish(proc, 30)
    assert proc.returncode == 0 and "Traceback" not in err, err


@pytest.mark.parametrize("served", ["batched", "hybrid"])
def test_a_client_that_leaves_the_batch_leaves_the_others_exact(request, pairs, served):
    """One of three streams is dropped after its first pieces: the other two finish as they would alone (a hybrid's
    recurrent states of the others untouched by the row undone), and the dropped request is counted as cancelled."""
    batched, (target, drafter, tokenizer) = ((request.getfixturevalue("batched"), pairs["qwen3"]) if served == "batched"
                                             else request.getfixturevalue("hybrid"))
    cancelled = httpx.get(f"{batched}/health").json()["cancelled"]
    prompts = {"a": "def fibonacci(n):\n    return", "b": "The quick brown fox"}
    got: dict = {}
    threads = [threading.Thread(target=_stream, args=(batched, dict(prompt=p, max_tokens=150, temperature=0), got, k))
               for k, p in prompts.items()]
    for t in threads:
        t.start()
    body = {"prompt": "import json\nimport os\n\nclass", "max_tokens": 3000, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{batched}/v1/completions", json=body, timeout=60) as r:
        pieces = 0
        for line in r.iter_lines():
            pieces += line.startswith("data: {")
            if pieces == 5:
                break  # the client leaves mid-reply, while the others decode beside it
    for t in threads:
        t.join(timeout=300)
    for key, prompt in prompts.items():
        assert got[key]["text"] == generate(target, drafter, tokenizer, prompt, max_tokens=150).text
    for _ in range(100):
        if httpx.get(f"{batched}/health").json()["cancelled"] == cancelled + 1:
            break
        time.sleep(0.1)
    assert httpx.get(f"{batched}/health").json()["cancelled"] == cancelled + 1


def test_hybrid_and_sliding_window_targets_decode_together(hybrid, tmp_path):
    """A hybrid target's recurrent layers and gpt-oss's sliding-window layers batch too: four requests at once, each
    what it is alone (greedy with copies accepted, a stop, seeded sampling with logprobs)."""
    config = fixtures.target_config("gpt_oss")
    fixtures.write_target(tmp_path / "target", config, seed=7, init_scale=0.3)  # replies that repeat: copies pay
    fixtures.write_drafter(tmp_path / "draft", fixtures.drafter_config(config, 2, target_layer_ids=[0, 2]))
    proc, url = start_server(tmp_path / "draft", tmp_path / "target", "--max-batch", "4")
    bodies = {
        "greedy": dict(prompt="def fibonacci(n):\n    return", max_tokens=150, temperature=0),
        "long": dict(prompt="The quick brown fox " * 30, max_tokens=120, temperature=0),
        "stop": dict(prompt="import json\nimport os\n\nclass", max_tokens=150, temperature=0, stop=["\n"]),
        "seeded": dict(prompt="hi", max_tokens=60, temperature=0.8, seed=3, logprobs=1),
    }
    try:
        for served, pair in [(url, load(str(tmp_path / "draft"), str(tmp_path / "target"))), hybrid]:
            _each_as_alone(_together(served, bodies), bodies, pair)
            assert httpx.get(f"{served}/health").json()["batch"]["max"] == 4  # batched, not one at a time
    finally:
        proc.send_signal(2)
        out, err = finish(proc, 30)
    assert proc.returncode == 0 and "Traceback" not in err, err


@pytest.mark.parametrize("model_type, batches", [("gemma3_text", True), ("falcon_h1", False)])
def test_other_architectures_in_the_server(tmp_path, model_type, batches):
    """Gemma 3's sliding layers batch; Falcon-H1's layers (a recurrent state beside attention, saved and replayed)
    decode one request at a time, said at start-up. Either way, three requests at once each get what they get
    alone."""
    config = fixtures.target_config(model_type)
    fixtures.write_target(tmp_path / "target", config, seed=7)
    fixtures.write_drafter(tmp_path / "draft", fixtures.drafter_config(config, 2, target_layer_ids=[0, 2]))
    proc, url = start_server(tmp_path / "draft", tmp_path / "target", "--max-batch", "4")
    bodies = {
        "greedy": dict(prompt="def fibonacci(n):\n    return", max_tokens=60, temperature=0),
        "stop": dict(prompt="import json\nimport os\n\nclass", max_tokens=60, temperature=0, stop=["\n"]),
        "seeded": dict(prompt="hi", max_tokens=40, temperature=0.8, seed=3, logprobs=1),
    }
    try:
        _each_as_alone(_together(url, bodies), bodies, load(str(tmp_path / "draft"), str(tmp_path / "target")))
        assert httpx.get(f"{url}/health").json()["batch"]["max"] == (4 if batches else 1)
    finally:
        proc.send_signal(2)
        out, err = finish(proc, 30)
    assert proc.returncode == 0 and "Traceback" not in err, err
    said = f"--max-batch 4: requests run one at a time: this {model_type} target's architecture keeps rows"
    assert (said in err) != batches, err


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_alone_is_noticed_within_a_cycle(batched, models_dir, stream):
    """A client killed while its request decodes alone in the batch (nothing else arriving): the row stops within a
    cycle. A whole answer's pieces kept coming while it decoded, so its client's leaving was noticed only when the
    request ended or the next one arrived (minutes of 100% CPU after an agent was killed)."""
    cancelled = httpx.get(f"{batched}/health").json()["cancelled"]
    # The end-of-text token is barred: this target's greedy reply ends after ~1,000 tokens, which a fast machine
    # decoded within the client's 1.5 s, so the client got its answer instead of leaving.
    eos = json.loads((models_dir / "qwen3" / "config.json").read_text())["eos_token_id"]
    body = {"prompt": "The quick brown fox", "max_tokens": 100000, "temperature": 0, "stream": stream,
            "logit_bias": {str(eos): -100}}
    try:  # the client gives up mid-reply (a whole one times out, a stream stops reading) and closes its connection
        with httpx.stream("POST", f"{batched}/v1/completions", json=body, timeout=1.5) as r:
            began = time.monotonic()
            for _ in r.iter_bytes():
                if time.monotonic() - began > 1.0:
                    break
    except httpx.TimeoutException:
        pass
    health = {}
    for _ in range(40):  # within 2 s: a cycle of this pair is milliseconds
        health = httpx.get(f"{batched}/health").json()
        if health["cancelled"] == cancelled + 1 and health["batch"]["decoding"] == 0:
            break
        time.sleep(0.05)
    assert health["cancelled"] == cancelled + 1 and health["batch"]["decoding"] == 0, health
