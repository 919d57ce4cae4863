"""`dflash-mlx serve` as a real server on a loopback port, driven by the official openai client."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import httpx2 as httpx
import pytest
from helpers import finish, plain_greedy, start_server

from dflash_mlx import generate, load

openai = pytest.importorskip("openai")

KEY = "sk-test"
MESSAGES = [{"role": "user", "content": "def fibonacci(n):"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(models_dir, *extra, draft: str = "qwen3-dflash", target: str = "qwen3") -> tuple[subprocess.Popen, str]:
    return start_server(models_dir / draft, models_dir / target, *extra)


def _ctrl_c(proc: subprocess.Popen, url: str) -> None:
    proc.send_signal(2)
    out, err = finish(proc, 30)
    assert proc.returncode == 0 and "Traceback" not in err and "terminate" not in err, err
    assert f"{url}/v1" in err and "stopped" in err


@pytest.fixture(scope="module")
def server(models_dir):
    proc, url = _start(models_dir, "--api-key", KEY)
    yield url
    _ctrl_c(proc, url)


def test_ctrl_c_during_a_reply_stops_cleanly(models_dir):
    proc, url = _start(models_dir)
    body = {"prompt": "hello", "max_tokens": 3000, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # generating now
        proc.send_signal(2)
        rest = list(lines)  # the stream ends (with an error event) instead of hanging
    assert any("shutting down" in line for line in rest) or not rest
    out, err = finish(proc, 30)
    assert proc.returncode == 0 and "Traceback" not in err and "stopped" in err, err


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)


def _expected(pairs, messages, max_tokens):
    """What `generate` gives for the same conversation (the chat template's prompt, EOS honoured)."""
    target, drafter, tokenizer = pairs["qwen3"]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return generate(target, drafter, tokenizer, ids, max_tokens=max_tokens)


def test_models_and_health(client, server):
    [model] = client.models.list().data
    assert model.id.endswith("qwen3-dflash") and model.owned_by == "dflash-mlx"
    assert httpx.get(f"{server}/health", headers={"x-api-key": KEY}).json()["status"] == "ok"


def test_chat_completion_equals_generate(client, pairs):
    ref = _expected(pairs, MESSAGES, 40)
    out = client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=40, temperature=0)
    assert out.choices[0].message.content == ref.text
    assert out.choices[0].finish_reason == ("length" if ref.finish_reason == "length" else "stop")
    assert out.usage.completion_tokens == len(ref.tokens) and out.usage.prompt_tokens == ref.prompt_tokens
    stream = client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=40, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        out.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == len(ref.tokens) and not chunks[-1].choices
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt as the request before
    figures = chunks[-1].usage.model_extra["dflash"]
    assert {"tau", "acceptance_rate", "cycles", "sources"} <= set(figures) and set(figures["sources"]) == {"drafter", "copy"}


def test_a_pinned_draft_source_is_served_losslessly(models_dir, pairs):
    """`serve --draft-source copy`: the official client gets plain greedy's text, drafted by copies only."""
    proc, url = _start(models_dir, "--draft-source", "copy")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="any", max_retries=0, timeout=120)
        prompt = "one two three four " * 12
        out = client.completions.create(model="any", prompt=prompt, max_tokens=60, temperature=0)
        target, drafter, tokenizer = pairs["qwen3"]
        assert out.choices[0].text == generate(target, drafter, tokenizer, prompt, max_tokens=60).text
        sources = out.usage.model_extra["dflash"]["sources"]
        assert sources["drafter"]["drafted"] == 0
    finally:
        _ctrl_c(proc, url)


def test_a_request_without_sampling_settings_gets_the_servers_defaults(client, pairs):
    """As mlx-lm's server: --temp (0, greedy) and --max-tokens for what a request leaves out, so a client that
    sends no temperature (the llm CLI) gets greedy text, not OpenAI's 1.0."""
    ref = _expected(pairs, MESSAGES, 40)
    for _ in range(2):
        out = client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=40)
        assert out.choices[0].message.content == ref.text


def test_text_completion_and_length(client, pairs):
    target, drafter, tokenizer = pairs["qwen3"]
    ids = tokenizer.encode("The quick brown fox")
    out = client.completions.create(model="any", prompt=ids, max_tokens=25, temperature=0)
    ref = generate(target, drafter, tokenizer, ids, max_tokens=25)
    assert ref.tokens == plain_greedy(target.model, ids, 25)[: len(ref.tokens)]
    assert out.choices[0].text == ref.text and out.usage.completion_tokens == len(ref.tokens)
    assert out.choices[0].finish_reason == ("length" if ref.finish_reason == "length" else "stop")


def test_stop_string_is_never_sent_and_the_next_turn_stays_lossless(client, pairs):
    target, drafter, tokenizer = pairs["qwen3"]
    ids = tokenizer.encode("import json\nimport os\n\nclass")
    full = generate(target, drafter, tokenizer, ids, max_tokens=60).text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop and stop in full
    for stream in (False, True):
        if stream:
            text = "".join(c.choices[0].text for c in client.completions.create(
                model="any", prompt=ids, max_tokens=60, temperature=0, stop=[stop], stream=True))
        else:
            out = client.completions.create(model="any", prompt=ids, max_tokens=60, temperature=0, stop=stop)
            text = out.choices[0].text
            assert out.choices[0].finish_reason == "stop"
        assert text == full[: full.index(stop)] and stop not in text
    after = client.completions.create(model="any", prompt=ids, max_tokens=60, temperature=0)
    assert after.choices[0].text == full  # the caches the stop left behind were valid


def test_eight_concurrent_clients_get_their_own_answers(client, pairs):
    prompts = [f"Question {i}: what comes after {i}?" for i in range(8)]
    expected = {p: _expected(pairs, [{"role": "user", "content": p}], 24).text for p in prompts}
    got: dict[str, str] = {}

    def ask(p: str) -> None:
        got[p] = client.chat.completions.create(model="any", messages=[{"role": "user", "content": p}],
                                                max_tokens=24, temperature=0).choices[0].message.content

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert got == expected


def test_a_dropped_stream_frees_the_server(server, client, pairs):
    cancelled = httpx.get(f"{server}/health", headers={"x-api-key": KEY}).json()["cancelled"]
    body = {"model": "any", "messages": MESSAGES, "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60) as r:
        lines = 0
        for line in r.iter_lines():
            lines += line.startswith("data:")
            if lines >= 3:
                break  # the client goes away mid-stream
    ref = _expected(pairs, MESSAGES, 30)
    out = client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=30, temperature=0)
    assert out.choices[0].message.content == ref.text
    # stopped early, not run to the end
    assert httpx.get(f"{server}/health", headers={"x-api-key": KEY}).json()["cancelled"] == cancelled + 1


def test_multi_turn_reuses_the_cache(client):
    turn1 = [{"role": "user", "content": "Tell me about the lazy dog."}]
    reply = client.chat.completions.create(model="any", messages=turn1, max_tokens=20, temperature=0)
    turn2 = turn1 + [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "And the fox?"}]
    out = client.chat.completions.create(model="any", messages=turn2, max_tokens=20, temperature=0)
    assert out.usage.prompt_tokens_details.cached_tokens > len(turn1[0]["content"]) // 4


@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, None),
    (json.dumps({"model": "x", "messages": MESSAGES, "n": 2}).encode(), 400, "n"),
    (json.dumps({"model": "x", "messages": MESSAGES, "logprobs": "yes"}).encode(), 400, "logprobs"),
    (json.dumps({"model": "x", "messages": MESSAGES, "logprobs": True, "top_logprobs": 21}).encode(), 400,
     "top_logprobs"),
    (json.dumps({"model": "x", "messages": MESSAGES, "response_format": {"type": "json_object"}}).encode(), 400,
     "response_format"),
    (json.dumps({"model": "x", "messages": MESSAGES, "tools": [{"type": "function"}]}).encode(), 400, "tools"),
    (json.dumps({"model": "x", "messages": "hi"}).encode(), 400, "messages"),
    (json.dumps({"model": "x", "messages": MESSAGES, "max_tokens": -1}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "x", "messages": MESSAGES, "temperature": "hot"}).encode(), 400, "temperature"),
    (json.dumps({"model": "x", "messages": MESSAGES, "temperature": 1, "seed": -1}).encode(), 400, "seed"),
    (json.dumps({"model": "x", "messages": MESSAGES, "temperature": 1, "seed": 2**64}).encode(), 400, "seed"),
    (b"[1, 2]", 400, None),
    (b"x" * (17 * 2**20), 413, None),
    (b"[" * 100_000 + b"]" * 100_000, 400, None),  # 200 kB of nesting: json's recursion limit was a 500
    # Python's JSON reader takes these (1e400 is standard JSON, beyond a float): a 400, never a plain-text 500
    (b'{"model": "x", "messages": [{"role": "user", "content": "a"}], "max_tokens": 1e400}', 400, None),
    (b'{"model": "x", "messages": [{"role": "user", "content": "a"}], "temperature": NaN}', 400, None),
    (b'{"model": "x", "messages": [{"role": "user", "content": "a"}], "top_p": -Infinity}', 400, None),
    # logits processors: mlx-lm's fields, checked
    (json.dumps({"model": "x", "messages": MESSAGES, "logit_bias": {"999999": 1}}).encode(), 400, "logit_bias"),
    (json.dumps({"model": "x", "messages": MESSAGES, "logit_bias": {"x": 1}}).encode(), 400, "logit_bias"),
    (json.dumps({"model": "x", "messages": MESSAGES, "repetition_penalty": -1}).encode(), 400, "repetition_penalty"),
    (json.dumps({"model": "x", "messages": MESSAGES, "presence_context_size": 1.5}).encode(), 400,
     "presence_context_size"),
    (json.dumps({"model": "x", "messages": MESSAGES, "xtc_probability": 0.5}).encode(), 400, "xtc_probability"),
    # what must be refused rather than guessed at
    (json.dumps({"model": "x", "messages": [{"role": "user"}]}).encode(), 400, "messages"),
    (json.dumps({"model": "x", "messages": MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]}).encode(), 400, "messages"),
])
def test_bad_requests_get_openai_errors_and_the_server_goes_on(server, client, body, status, param):
    r = httpx.post(f"{server}/v1/chat/completions", content=body, timeout=60,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["param"] == param
    assert client.completions.create(model="any", prompt="hello", max_tokens=3, temperature=0).choices[0].text is not None


def test_penalties_and_bias_are_mlx_lms_in_every_api(server, client, pairs):
    """repetition/presence/frequency penalties and logit bias, as mlx-lm's server reads them: the reply is mlx-lm's
    greedy one with the same processors, through OpenAI's chat API, Anthropic's and the Responses API alike."""
    from mlx_lm.sample_utils import make_logits_processors

    target, _, tokenizer = pairs["qwen3"]
    fields = {"repetition_penalty": 1.6, "repetition_context_size": 6, "presence_penalty": 0.4,
              "frequency_penalty": 0.2, "logit_bias": {"9": 2.5}}
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    processors = make_logits_processors(logit_bias={9: 2.5}, repetition_penalty=1.6, repetition_context_size=6,
                                        presence_penalty=0.4, frequency_penalty=0.2)
    ref = plain_greedy(target.model, ids, 24, eos=tokenizer.eos_token_ids, logits_processors=processors)
    assert ref != plain_greedy(target.model, ids, 24, eos=tokenizer.eos_token_ids)
    chat = client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=24, temperature=0,
                                          presence_penalty=0.4, frequency_penalty=0.2, logit_bias={"9": 2.5},
                                          extra_body={k: fields[k] for k in ("repetition_penalty",
                                                                             "repetition_context_size")})
    assert chat.choices[0].message.content == tokenizer.decode(ref)
    headers = {"Authorization": f"Bearer {KEY}", "x-api-key": KEY, "anthropic-version": "2023-06-01"}
    messages = httpx.post(f"{server}/v1/messages", headers=headers, timeout=60, json={
        "model": "any", "messages": MESSAGES, "max_tokens": 24, "temperature": 0, **fields}).json()
    responses = httpx.post(f"{server}/v1/responses", headers=headers, timeout=60, json={
        "model": "any", "input": MESSAGES, "max_output_tokens": 24, "temperature": 0, **fields}).json()
    assert "".join(b["text"] for b in messages["content"] if b["type"] == "text") == tokenizer.decode(ref)
    assert responses["output"][-1]["content"][0]["text"] == tokenizer.decode(ref)


def test_api_key_is_required(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(f"{server}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="nope", max_retries=0).models.list()


def test_an_unknown_route_and_a_wrong_method_say_which(server):
    """404 not_found and 405 method_not_allowed, in the shape of the API the path belongs to."""
    r = httpx.get(f"{server}/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    r = httpx.get(f"{server}/v1/messages")
    assert r.status_code == 405 and r.json()["type"] == "error" and r.json()["error"]["type"]
    r = httpx.post(f"{server}/v1/nothing", json={})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_soak_memory_does_not_grow(server, client):
    def active() -> int:
        return httpx.get(f"{server}/health", headers={"x-api-key": KEY}).json()["active_memory_bytes"]

    for i in range(20):
        client.completions.create(model="any", prompt=f"warm {i}", max_tokens=4, temperature=0)
    before = active()
    for i in range(200):
        client.completions.create(model="any", prompt=f"request number {i}", max_tokens=4, temperature=0)
    assert active() <= before * 1.1 + 2**20


def test_port_in_use_and_bad_model_are_one_line_errors(server, models_dir):
    port = server.rsplit(":", 1)[1]
    base = [sys.executable, "-c", "from dflash_mlx.cli.main import app; app()", "serve"]
    for args in ([str(models_dir / "qwen3-dflash"), "--target", str(models_dir / "qwen3"), "--port", port],
                 [str(models_dir / "nope"), "--port", port],
                 [str(models_dir / "qwen3-dflash"), "--target", str(models_dir / "qwen3"), "--keepalive", "0"]):
        done = subprocess.run(base + args, capture_output=True, text=True, timeout=120)
        lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr


def test_token_id_prompts_may_hold_added_tokens(agent_dir):
    """Ids are checked against the embedding's rows: an added token (Qwen's <|im_start|>, <tool_call>) lies past
    the tokenizer's vocab_size, and the same prompt sent as text is accepted, so its ids must be too."""
    target, drafter, tokenizer = load(str(agent_dir / "draft"), str(agent_dir / "target"))
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert max(ids) >= tokenizer.vocab_size  # "assistant\n" is an added token
    proc, url = _start(agent_dir, draft="draft", target="target")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        out = client.completions.create(model="any", prompt=ids, max_tokens=20, temperature=0)
        assert out.choices[0].text == generate(target, drafter, tokenizer, ids, max_tokens=20).text
        assert out.choices[0].text.startswith("<think>")
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [target.vocab_size], "max_tokens": 2}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    finally:
        _ctrl_c(proc, url)


def test_a_client_that_leaves_during_prefill_stops_it(models_dir, pairs):
    """Prefill stops at the next chunk once the client is gone: the next request does not wait for all of it,
    and the chunks done stay in the cache."""
    _, _, tokenizer = pairs["qwen3"]
    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog. " * 400)[:3000]
    proc, url = _start(models_dir, "--prefill-step", "64")  # ~4 s of prefill on this machine
    try:
        body = {"prompt": ids, "max_tokens": 5, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60):
            time.sleep(0.3)  # the engine is prefilling; the client leaves
        for _ in range(300):
            health = httpx.get(f"{url}/health").json()
            if health["cancelled"] == 1:
                break
            time.sleep(0.05)
        assert health["cancelled"] == 1
        assert 0 < health["cached_tokens"] < len(ids) // 2  # stopped between chunks, what was done kept
        out = httpx.post(f"{url}/v1/completions", json={"prompt": ids[:10], "max_tokens": 3, "temperature": 0},
                         timeout=60)
        assert out.status_code == 200
    finally:
        _ctrl_c(proc, url)


def test_chat_template_args_are_defaults_that_requests_override(models_dir, tmp_path, pairs):
    """serve --chat-template-args gives every chat request's template its arguments; a request's own
    chat_template_kwargs add to or override them, as mlx-lm's server does."""
    from test_cli import GREETING_TEMPLATE

    _, _, tokenizer = pairs["qwen3"]
    template = tmp_path / "greeting.jinja"
    template.write_text(GREETING_TEMPLATE)
    proc, url = _start(models_dir, "--chat-template", str(template), "--chat-template-args", '{"greeting": "Ahoy, "}')
    try:
        def prompt_tokens(**extra) -> int:
            body = {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **extra}
            return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["usage"]["prompt_tokens"]

        def expected(greeting: str) -> int:
            return len(tokenizer.encode(greeting + "hi"))

        assert prompt_tokens() == expected("Ahoy, ")
        assert prompt_tokens(chat_template_kwargs={"greeting": "Good morning to all of you, "}) == expected(
            "Good morning to all of you, ")
    finally:
        _ctrl_c(proc, url)


def test_max_tokens_is_bounded_by_what_a_context_holds(client, pairs):
    """10^12 (once taken, then decoded until the client gave up) is a 400 that names the bound; within it, the reply
    stops where the model's positions end (finish reason "length"), as an agent's 128,000 does on a small model."""
    for too_many in (10**12, 2**31):
        with pytest.raises(openai.BadRequestError, match="max_tokens must be between 1 and 2147483647"):
            client.completions.create(model="any", prompt="hi", max_tokens=too_many, temperature=0)
    ids = pairs["qwen3"][2].encode("the quick brown fox " * 2000)[:4080]  # 16 of the model's 4096 positions left
    out = client.completions.create(model="any", prompt=ids, max_tokens=128_000, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4096 - len(ids)
