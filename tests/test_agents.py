"""`serve` for agents and editors, end to end: a real server on a loopback port, driven by the official `openai` and
`anthropic` clients, over a scripted target (``fixtures.AGENT_SCRIPTS``): it answers a chat with a think block then
an answer, a tool call when tools are offered, and an answer after the tool's result, as Qwen3 writes them."""

from __future__ import annotations

import json
import random
import re
import threading
import time

import httpx2 as httpx
import mlx.core as mx
import numpy as np
import pytest
from helpers import finish, start_server
from mlx_lm.generate import generate_step

from dflash_mlx import load
from dflash_mlx.chat_template import fold_system, render
from dflash_mlx.models import fixtures
from dflash_mlx.server.replies import Reply, ToolCall
from dflash_mlx.server.request import APIError, chat_ids

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

KEY = "sk-agent"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "The weather in a city",
                    "input_schema": TOOLS[0]["function"]["parameters"]}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _start(draft, target, *extra):
    return start_server(draft, target, *extra)


def _stop(proc):
    proc.send_signal(2)
    _, err = finish(proc, 30)
    assert proc.returncode == 0 and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def server(agent_dir):
    proc, url = _start(agent_dir / "draft", agent_dir / "target", "--api-key", KEY, "--allowed-origins",
                       "https://editor.example", "--keepalive", "0.5")
    yield {"url": url}
    _stop(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server['url']}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server["url"], api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def pair(agent_dir):
    return load(str(agent_dir / "draft"), str(agent_dir / "target"))


# -- OpenAI: tools ------------------------------------------------------------------------------------


def test_a_tool_call_whole_and_streamed(client):
    out = client.chat.completions.create(model="any", messages=ASK, tools=TOOLS)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None  # no markup left in content
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    chunks = list(client.chat.completions.create(model="any", messages=ASK, tools=TOOLS, stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    assert deltas[0].role == "assistant" and all(d.role is None for d in deltas[1:])  # role once: clients concatenate
    assert not "".join(d.content or "" for d in deltas)
    [streamed] = [t for d in deltas for t in d.tool_calls or []]
    assert streamed.index == 0 and streamed.id.startswith("call_") and streamed.function.name == "get_weather"
    assert json.loads(streamed.function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    with client.chat.completions.stream(model="any", messages=ASK, tools=TOOLS) as stream:  # the client's helper
        final = stream.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_a_whole_tool_loop_reuses_the_cache(client):
    """Call, result, answer: the history with the assistant's tool_calls (content null) and the tool's message is
    accepted, and the second request prefills only what the first did not hold."""
    first = client.chat.completions.create(model="any", messages=ASK, tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "22 degrees"}]
    second = client.chat.completions.create(model="any", messages=history, tools=TOOLS)
    assert second.choices[0].finish_reason == "stop" and not second.choices[0].message.tool_calls
    assert second.choices[0].message.content == "It is 22 degrees in Paris."
    # The first prompt came from the cache, but for its last token: this fixture's generation prompt names the
    # turn ("assistant[tools]"), where the history renders the reply's turn as "assistant".
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1


def test_tool_choice_none_required_and_named(client):
    """"none" offers no tools; "required" and a named function are accepted and offer them all (the model chooses:
    nothing constrains decoding to a call, as the README says)."""
    out = client.chat.completions.create(model="any", messages=ASK, tools=TOOLS, tool_choice="none")
    assert out.choices[0].finish_reason == "stop" and out.choices[0].message.tool_calls is None
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        out = client.chat.completions.create(model="any", messages=ASK, tools=TOOLS, tool_choice=choice)
        assert out.choices[0].finish_reason == "tool_calls", choice
        assert out.choices[0].message.tool_calls[0].function.name == "get_weather"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="any", messages=ASK, tools=TOOLS, tool_choice="sometimes")
    assert e.value.body["param"] == "tool_choice"


# -- OpenAI: reasoning and logprobs ------------------------------------------------------------------


def test_reasoning_goes_to_its_own_field(client):
    out = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}])
    message = out.choices[0].message
    assert message.content == "\n\nHello! I am a scripted model." and "<think>" not in message.content
    assert message.model_extra["reasoning_content"] == "\nThe user greets me; I greet back.\n"
    chunks = list(client.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}],
                                                 stream=True))
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (reasoning, content) == (message.model_extra["reasoning_content"], message.content)
    off = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}],
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content == "Hello without thinking."
    assert "reasoning_content" not in off.choices[0].message.model_extra


def _plain_logprobs(target, ids, n):
    """mlx-lm's plain greedy decoding of the target: each token with its log-probabilities (all of them)."""
    out = []
    for token, logprobs in generate_step(mx.array(ids), target.model, max_tokens=n):
        out.append((int(token), np.array(logprobs)))
    return out


def test_logprobs_are_plain_decodings(client, pair):
    """Taken from the verify that emitted each token: the figures plain decoding of the target gives."""
    target, _, tokenizer = pair
    out = client.chat.completions.create(model="any", messages=ASK, tools=TOOLS, logprobs=True, top_logprobs=3)
    entries = out.choices[0].logprobs.content
    ids = render(tokenizer, ASK, tools=TOOLS)
    plain = _plain_logprobs(target, ids, len(entries))
    for entry, (token, logprobs) in zip(entries, plain):
        assert entry.token == tokenizer.decode([token]) and abs(entry.logprob - logprobs[token]) < 1e-4
        best = np.argsort(-logprobs)[:3]
        assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([int(i)]) for i in best]
        assert np.allclose([t.logprob for t in entry.top_logprobs], logprobs[best], atol=1e-4)
    text = client.completions.create(model="any", prompt=ids, max_tokens=3, temperature=0, logprobs=2)
    lp = text.choices[0].logprobs
    plain = _plain_logprobs(target, ids, 3)
    assert lp.tokens == [tokenizer.decode([t]) for t, _ in plain]
    assert np.allclose(lp.token_logprobs, [p[t] for t, p in plain], atol=1e-4) and len(lp.top_logprobs[0]) == 2
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    chunks = list(client.chat.completions.create(model="any", messages=ASK, tools=TOOLS, logprobs=True, stream=True))
    streamed = [e.logprob for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert np.allclose(streamed, [e.logprob for e in entries], atol=1e-4)


def test_a_malformed_tool_call_comes_back_as_text(tmp_path):
    """The model's own markup that does not parse is content, never a 500 (and a call that parses is a call)."""
    config = fixtures.target_config("qwen3")
    bad = ["<tool_call>", '\n{"name": "get_weather", "arguments": {"city": ', "</tool_call>", "<|im_end|>"]
    scripts = {"assistant[tools]\n": bad, "assistant\n": ["<think>", "</think>", "<|im_end|>"]}  # a thinking model
    fixtures.write_scripted_target(tmp_path / "target", scripts, fixtures.TOOLS_TEMPLATE, config)
    fixtures.write_drafter(tmp_path / "draft", fixtures.drafter_config(config, 1, target_layer_ids=[1]))
    _, _, tokenizer = load(str(tmp_path / "draft"), str(tmp_path / "target"))
    reply = Reply(tokenizer, [], TOOLS)
    events = [e for piece in ("".join(bad[:2]), bad[2]) for e in reply.feed(piece)] + reply.finish()
    assert events == [("content", "".join(bad[:3]))]
    good = Reply(tokenizer, [], TOOLS)
    events = good.feed('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call> then')
    assert events == [("tool_call", ToolCall("f", {"a": 1})), ("content", " then")]
    proc, url = _start(tmp_path / "draft", tmp_path / "target")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        out = client.chat.completions.create(model="any", messages=ASK, tools=TOOLS)
        assert out.choices[0].finish_reason == "stop" and out.choices[0].message.tool_calls is None
        assert out.choices[0].message.content == "".join(bad[:3])
        client.chat.completions.create(model="any", messages=ASK, max_tokens=1)
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="any", messages=ASK, temperature="hot")
    finally:
        log = _stop(proc)
    # one line per request (--log-level info, the default): what it asked, what it cost, why it was refused
    assert "POST /v1/chat/completions 200 prompt" in log and "tok/s" in log
    assert "-> 1 tok, tau" in log and "0.0 tok/s" not in log  # no speed from one token
    assert "POST /v1/chat/completions 400: temperature must be a number" in log


# -- Anthropic's Messages API ------------------------------------------------------------------------


def test_messages_with_tools_whole_and_streamed(claude):
    message = claude.messages.create(model="any", max_tokens=64, messages=ASK, tools=ANTHROPIC_TOOLS)
    assert message.stop_reason == "tool_use" and message.stop_sequence is None
    [block] = message.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.input == {"city": "Paris"}
    assert block.id.startswith("toolu_") and message.usage.output_tokens == 3
    with claude.messages.stream(model="any", max_tokens=64, messages=ASK, tools=ANTHROPIC_TOOLS) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_start" in kinds
    assert final.stop_reason == "tool_use" and final.content[0].input == {"city": "Paris"}
    result = [{"type": "tool_result", "tool_use_id": block.id, "content": [{"type": "text", "text": "22 degrees"}]}]
    answer = claude.messages.create(model="any", max_tokens=64, tools=ANTHROPIC_TOOLS, messages=ASK + [
        {"role": "assistant", "content": message.content}, {"role": "user", "content": result}])
    assert answer.stop_reason == "end_turn" and answer.content[0].text == "It is 22 degrees in Paris."
    first_prompt = message.usage.input_tokens + message.usage.cache_read_input_tokens
    assert answer.usage.cache_read_input_tokens >= first_prompt - 1  # all but the turn-naming last token (above)


def test_messages_thinking_stop_sequences_and_max_tokens(claude):
    hi = [{"role": "user", "content": "hi"}]
    message = claude.messages.create(model="any", max_tokens=64, messages=hi, system="Be brief.")
    thinking, text = message.content
    assert thinking.type == "thinking" and thinking.thinking == "\nThe user greets me; I greet back.\n"
    assert thinking.signature and text.text == "\n\nHello! I am a scripted model." and message.stop_reason == "end_turn"
    with claude.messages.stream(model="any", max_tokens=64, messages=hi) as stream:
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in message.content]
    off = claude.messages.create(model="any", max_tokens=64, messages=hi, thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"] and off.content[0].text == "Hello without thinking."
    stopped = claude.messages.create(model="any", max_tokens=64, messages=hi, stop_sequences=["scripted"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "scripted"
    assert stopped.content[-1].text == "\n\nHello! I am a "
    short = claude.messages.create(model="any", max_tokens=2, messages=hi)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2
    counted = claude.messages.count_tokens(model="any", messages=hi, system="Be brief.").input_tokens
    assert counted == message.usage.input_tokens + message.usage.cache_read_input_tokens


def test_messages_auth_and_errors_in_anthropics_shape(server):
    url = server["url"]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model="any", max_tokens=8, messages=ASK)
    r = httpx.post(f"{url}/v1/messages", json={"model": "any", "messages": ASK}, headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error" and "max_tokens" in r.json()["error"]["message"]
    image = [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                       "data": ""}}]}]
    r = httpx.post(f"{url}/v1/messages", json={"model": "any", "max_tokens": 8, "messages": image},
                   headers={"x-api-key": KEY})
    assert r.status_code == 400 and "this model reads text only" in r.json()["error"]["message"]
    for messages in ([{"role": "user"}], [{"role": "user", "content": [{"type": "text", "text": {"a": 1}}]}]):
        r = httpx.post(f"{url}/v1/messages", json={"model": "any", "max_tokens": 8, "messages": messages},
                       headers={"x-api-key": KEY})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", messages


# -- what else a client expects ------------------------------------------------------------------------


def test_metrics_cors_and_a_log_line_per_request(server, client):
    client.chat.completions.create(model="any", messages=ASK, tools=TOOLS)
    assert httpx.get(f"{server['url']}/metrics").status_code == 401  # the server has a key: the figures need it
    assert httpx.get(f"{server['url']}/health").json() == {"status": "ok"}  # liveness only, without the key
    assert "prompt_cache" in httpx.get(f"{server['url']}/health", headers={"x-api-key": KEY}).json()
    metrics = httpx.get(f"{server['url']}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for name in ("dflash_requests_total", "dflash_prompt_tokens_total", "dflash_cached_prompt_tokens_total",
                 "dflash_generated_tokens_total", "dflash_drafted_tokens_total", "dflash_accepted_tokens_total",
                 "dflash_time_to_first_token_seconds_bucket", "dflash_decode_tokens_per_second_bucket"):
        assert name in metrics, name
    counted = [line for line in metrics.splitlines() if line.startswith('dflash_requests_total{endpoint="/v1/chat')]
    assert counted and float(counted[0].split()[-1]) >= 1
    preflight = {"Origin": "https://editor.example", "Access-Control-Request-Method": "POST"}
    allowed = httpx.options(f"{server['url']}/v1/chat/completions", headers=preflight)
    assert allowed.headers.get("access-control-allow-origin") == "https://editor.example"
    other = httpx.options(f"{server['url']}/v1/chat/completions",
                          headers=dict(preflight, Origin="https://evil.example"))
    assert other.headers.get("access-control-allow-origin") is None


# -- Anthropic's API as Claude Code sends it ------------------------------------------------------------------------

BASH = {"name": "Bash", "description": "Run a shell command", "input_schema": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}
ENVIRONMENT = "# Environment\nYou have been invoked in the following environment:\n - Platform: linux"


def _claude_code_body(**changes):
    """A request in the shape Claude Code 2.1 sends (agent-api.md): a system message after the user's turn, cache
    controls, a deferred tool, adaptive thinking with its display omitted, fields this server has no use for."""
    body = {
        "model": "claude-opus-5-5", "max_tokens": 128000, "stream": False,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.328;"},
                   {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                     {"role": "system", "content": [{"type": "text", "text": ENVIRONMENT,
                                                     "cache_control": {"type": "ephemeral"}}]}],
        "tools": [BASH, {"name": "DeferredToolPlaceholder", "description": "", "defer_loading": True,
                         "input_schema": {"type": "object", "properties": {}}}],
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "medium"}, "metadata": {"user_id": "{\"device_id\": \"x\"}"},
    }
    return body | changes


CLAUDE_HEADERS = {"x-api-key": KEY, "anthropic-version": "2023-06-01", "x-app": "cli", "anthropic-beta":
                  "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27"}


def test_claude_codes_first_request_is_answered(server, pair):
    """Refused with 400 before (messages[1] had role system; max_tokens 128000 past the 40,960 positions)."""
    _, _, tokenizer = pair
    r = httpx.post(f"{server['url']}/v1/messages?beta=true", json=_claude_code_body(), headers=CLAUDE_HEADERS,
                   timeout=120)
    assert r.status_code == 200, r.text
    message = r.json()
    thinking, text = message["content"]
    assert thinking == {"type": "thinking", "thinking": "", "signature": "dflash-mlx"}  # display: omitted
    assert text == {"type": "text", "text": "\n\nHello! I am a scripted model."}
    assert message["stop_reason"] == "end_turn"
    # The later system turn is rendered where it stands (Qwen3's template takes it); the deferred tool is not shown.
    turns = [{"role": "system", "content": "x-anthropic-billing-header: cc_version=2.1.328;You are an agent."},
             {"role": "user", "content": "hi"}, {"role": "system", "content": ENVIRONMENT}]
    tools = [{"type": "function", "function": {"name": "Bash", "description": "Run a shell command",
                                               "parameters": BASH["input_schema"]}}]
    usage = message["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == len(render(tokenizer, turns, tools=tools,
                                                                                 thinking=True))


def test_claude_code_streams_with_pings_and_consistent_usage(server):
    """Streamed as Claude Code asks: message_start's usage counts the prompt as message_delta's does (input excludes
    what was read from the cache), thinking blocks carry no text when display is omitted, pings keep it alive."""
    body = _claude_code_body(stream=True)
    for _ in range(2):  # the second time, most of the prompt comes from the cache
        with httpx.stream("POST", f"{server['url']}/v1/messages?beta=true", json=body, headers=CLAUDE_HEADERS,
                          timeout=120) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line]
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    names = [line[7:] for line in lines if line.startswith("event: ")]
    assert names[0] in ("ping", "message_start") and names[-1] == "message_stop" and "ping" in names
    start = next(e for e in events if e["type"] == "message_start")["message"]["usage"]
    end = next(e for e in events if e["type"] == "message_delta")["usage"]
    assert start["cache_read_input_tokens"] > 0
    assert (start["input_tokens"], start["cache_read_input_tokens"]) == (end["input_tokens"],
                                                                         end["cache_read_input_tokens"])
    assert not [e for e in events if e.get("delta", {}).get("type") == "thinking_delta"]
    assert [e["delta"]["signature"] for e in events if e.get("delta", {}).get("type") == "signature_delta"]


def test_tool_choice_any_and_a_named_tool_are_accepted(claude):
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        message = claude.messages.create(model="claude-haiku-4-5", max_tokens=64, messages=ASK,
                                         tools=ANTHROPIC_TOOLS, tool_choice=choice)
        assert message.stop_reason == "tool_use" and message.content[0].name == "get_weather"
    none = claude.messages.create(model="any", max_tokens=64, messages=ASK, tools=ANTHROPIC_TOOLS,
                                  tool_choice={"type": "none"})
    assert none.stop_reason == "end_turn" and none.content[-1].type == "text"


def test_a_system_turn_is_folded_where_the_template_refuses_it(agent_dir):
    """Qwen3.5's template raises on a system message after the first turn: the server folds it into the user turn
    next to it instead of answering 400 (and keeps it where it stands when the template takes it)."""
    strict = ("{%- for m in messages %}{%- if m.role == 'system' and not loop.first %}"
              "{{- raise_exception('System message must be at the beginning.') }}{%- endif %}"
              "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
              "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    _, _, tokenizer = load(str(agent_dir / "draft"), str(agent_dir / "target"), chat_template=strict)
    turns = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}, {"role": "system", "content": "E"},
             {"role": "assistant", "content": "ok"}, {"role": "system", "content": "F"},
             {"role": "user", "content": "go"}]
    folded = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi\n\nE"},
              {"role": "assistant", "content": "ok"}, {"role": "user", "content": "F\n\ngo"}]
    assert fold_system(turns) == folded
    assert chat_ids(tokenizer, turns, [], None, {}, "messages") == render(tokenizer, folded)
    assert fold_system([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                        {"role": "system", "content": "c"}]) == [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    bad = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"},
           {"role": "user", "content": "z"}]  # this strict template takes it: nothing is folded
    assert chat_ids(tokenizer, bad, [], None, {}, "messages") == render(tokenizer, bad)
    with pytest.raises(APIError):  # a template that refuses for another reason still says so
        raising = load(str(agent_dir / "draft"), str(agent_dir / "target"),
                       chat_template="{{ raise_exception('no') }}")[2]
        chat_ids(raising, turns, [], None, {}, "messages")


# -- what a client gets when the context is too small ---------------------------------------------------------------


def _long_text(tokenizer, tokens: int) -> str:
    """Text of at least ``tokens`` tokens (random words: nothing a cache holds)."""
    rng = random.Random(tokens)
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo"]
    text = ""
    while len(tokenizer.encode(text)) < tokens:
        text += " ".join(rng.choice(words) + str(rng.randrange(1000)) for _ in range(tokens // 2)) + "\n"
    return text


def test_a_prompt_that_does_not_fit_gets_what_each_client_acts_on(server, client, claude, pair):
    _, _, tokenizer = pair
    huge = [{"role": "user", "content": _long_text(tokenizer, 41000)}]
    with pytest.raises(anthropic.BadRequestError) as e:  # Claude Code compacts its conversation on this text
        claude.messages.create(model="any", max_tokens=128000, messages=huge)
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert re.match(r"prompt is too long: \d+ tokens > 40959 maximum", e.value.body["error"]["message"])
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="any", messages=huge)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="any", input=huge[0]["content"])
    assert e.value.body["code"] == "context_length_exceeded"
    events = list(client.responses.create(model="any", input=huge[0]["content"], stream=True))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.failed"]
    assert events[-1].response.error.code == "context_length_exceeded"  # Codex compacts on this code
    assert "prompt is too long" in events[-1].response.error.message


@pytest.fixture(scope="module")
def small(agent_dir, pair, tmp_path_factory):
    """The agent target with room for "hi" and two tokens of reply: a reply cut where the context ends."""
    _, _, tokenizer = pair
    root = tmp_path_factory.mktemp("small")
    target = root / "target"
    target.mkdir()
    for f in (agent_dir / "target").iterdir():
        (target / f.name).symlink_to(f)
    (target / "config.json").unlink()
    config = json.loads((agent_dir / "target" / "config.json").read_text())
    hi = [{"role": "user", "content": "hi"}]
    config["max_position_embeddings"] = len(render(tokenizer, hi)) + 2
    (target / "config.json").write_text(json.dumps(config))
    proc, url = _start(agent_dir / "draft", target)
    yield url
    _stop(proc)


def test_max_tokens_past_the_context_is_clamped_not_refused(small):
    hi = [{"role": "user", "content": "hi"}]
    small_claude = anthropic.Anthropic(base_url=small, api_key="x", max_retries=0, timeout=120)
    message = small_claude.messages.create(
        model="claude-opus-5-5", max_tokens=128000, messages=hi)
    assert message.stop_reason == "model_context_window_exceeded" and message.usage.output_tokens == 2
    short = small_claude.messages.create(
        model="any", max_tokens=1, messages=hi)
    assert short.stop_reason == "max_tokens"
    openai_client = openai.OpenAI(base_url=f"{small}/v1", api_key="x", max_retries=0)
    chat = openai_client.chat.completions.create(model="any", messages=hi, max_tokens=32000)
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 2
    response = openai_client.responses.create(model="any", input="hi", max_output_tokens=10**6)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"


# -- the Responses API (Codex CLI) ------------------------------------------------------------------------------------

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": TOOLS[0]["function"]["parameters"], "strict": False}


def test_responses_whole_and_streamed(client, pair):
    _, _, tokenizer = pair
    out = client.responses.create(model="local", input="hi", instructions="Be brief.")
    assert out.status == "completed" and out.output_text == "\n\nHello! I am a scripted model."
    reasoning, message = out.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "\nThe user greets me; I greet back.\n"
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    prompt = render(tokenizer, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert out.usage.input_tokens == len(prompt) and out.usage.output_tokens == 4
    assert out.usage.input_tokens_details.cached_tokens <= len(prompt) - 1

    events = list(client.responses.create(model="local", input="hi", instructions="Be brief.", stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "response.reasoning_text.delta" in types and "response.output_text.delta" in types
    assert types.count("response.output_item.added") == types.count("response.output_item.done") == 2
    completed = events[-1].response
    assert completed.output_text == out.output_text and completed.usage.input_tokens_details.cached_tokens > 0
    with client.responses.stream(model="local", input="hi", instructions="Be brief.") as stream:  # the client's helper
        final = stream.get_final_response()
    assert final.output_text == out.output_text and final.id == stream.get_final_response().id

    off = client.responses.create(model="local", input="hi", reasoning={"effort": "none"})
    assert off.output_text == "Hello without thinking." and [o.type for o in off.output] == ["message"]


def test_responses_tool_loop_as_codex_sends_it(client):
    """Input items with developer messages, a namespace of tools (flattened; the call names its namespace again),
    a hosted tool (left out), then the call and its output sent back, stateless."""
    tools = [{"type": "namespace", "name": "weather", "description": "Weather tools", "tools": [WEATHER]},
             {"type": "web_search", "external_web_access": False}]
    ask = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are Codex."}]},
           {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK[0]["content"]}]}]
    extra = {"store": False, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "k",
             "client_metadata": {"session_id": "s"}}
    first = client.responses.create(model="local", input=ask, tools=tools, tool_choice="auto",
                                    parallel_tool_calls=True, reasoning={"summary": "auto"}, extra_body=extra)
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.namespace == "weather"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
    streamed = list(client.responses.create(model="local", input=ask, tools=tools, stream=True, extra_body=extra))
    deltas = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    assert json.loads(deltas) == {"city": "Paris"}
    history = ask + [{"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": None},
                     call.model_dump(exclude_none=True),
                     {"type": "function_call_output", "call_id": call.call_id, "output": "22 degrees"}]
    second = client.responses.create(model="local", input=history, tools=tools, extra_body=extra)
    assert second.output_text == "It is 22 degrees in Paris."
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1


def test_responses_refuses_what_it_does_not_do(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="local", input="hi", previous_response_id="resp_123")
    assert e.value.body["param"] == "previous_response_id" and "stores no responses" in e.value.body["message"]
    image = [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="local", input=image)
    assert "this model reads text only" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="local", input=[{"type": "function_call", "call_id": "c", "name": "f",
                                                       "arguments": "[1]"}])


# -- editors' habits on chat completions ------------------------------------------------------------------------------


def test_editors_habits(client, pair):
    _, _, tokenizer = pair
    hi = [{"role": "user", "content": "hi"}]
    mid = hi + [{"role": "assistant", "content": "Hello."}, {"role": "system", "content": "Answer in French."},
                {"role": "user", "content": "hi again"}]
    out = client.chat.completions.create(model="any", messages=mid, max_tokens=10**6)  # clamped to the context
    assert out.choices[0].finish_reason == "stop" and out.usage.prompt_tokens == len(render(tokenizer, mid))
    for effort, expected in (("none", "Hello without thinking."), ("high", "\n\nHello! I am a scripted model.")):
        out = client.chat.completions.create(model="any", messages=hi, reasoning_effort=effort)
        assert out.choices[0].message.content == expected, effort
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}  # it wins over reasoning_effort
    out = client.chat.completions.create(model="any", messages=hi, reasoning_effort="high", extra_body=kwargs)
    assert out.choices[0].message.content == "Hello without thinking."
    image = [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                          {"type": "image_url", "image_url": {"url": "data:,"}}]}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="any", messages=image)
    assert e.value.body["message"].count("\n") == 0 and "this model reads text only" in e.value.body["message"]


# -- a long prefill or a wait in the queue never looks dead ---------------------------------------------------------


@pytest.fixture
def one_at_a_time(agent_dir):
    """A server that runs one request at a time (as when a batch is full): a stream waits in the queue, silent."""
    proc, url = _start(agent_dir / "draft", agent_dir / "target", "--api-key", KEY, "--keepalive", "0.5",
                       "--max-batch", "1")
    yield {"url": url}
    _stop(proc)


def test_streams_carry_keepalives_and_count_tokens_answers_at_once(one_at_a_time, pair):
    """While a long prefill runs (the next request waits behind it), every stream carries a keep-alive at least every
    --keepalive seconds (0.5 here, 15 by default), in its dialect's form; count_tokens and /v1/models answer at once."""
    server = one_at_a_time
    client = openai.OpenAI(base_url=f"{server['url']}/v1", api_key=KEY, max_retries=0, timeout=120)
    claude = anthropic.Anthropic(base_url=server["url"], api_key=KEY, max_retries=0, timeout=120)
    _, _, tokenizer = pair
    long = [{"role": "user", "content": _long_text(tokenizer, 12000)}]
    done = threading.Event()

    def prefill() -> None:
        try:
            client.chat.completions.create(model="any", messages=long, max_tokens=4)
        finally:
            done.set()

    worker = threading.Thread(target=prefill)
    worker.start()
    time.sleep(0.3)
    started = time.perf_counter()
    counted = claude.messages.count_tokens(model="any", messages=long).input_tokens
    listed = client.models.list().data[0].id
    quick = time.perf_counter() - started
    assert counted == len(render(tokenizer, long)) and listed and not done.is_set() and quick < 3
    cases = [("/v1/messages", {"model": "any", "max_tokens": 8, "stream": True, "messages": ASK}, "event: ping"),
             ("/v1/chat/completions", {"model": "any", "stream": True, "messages": ASK}, ": keepalive"),
             ("/v1/responses", {"model": "any", "stream": True, "input": "hi"}, ": keepalive")]
    seen: dict[str, list] = {}

    def listen(path: str, body: dict) -> None:  # each stream waits in the queue behind the long prefill
        with httpx.stream("POST", f"{server['url']}{path}", json=body, headers={"x-api-key": KEY}, timeout=120) as r:
            seen[path] = [(time.perf_counter(), line) for line in r.iter_lines() if line]

    listeners = [threading.Thread(target=listen, args=(path, body)) for path, body, _ in cases]
    for t in listeners:
        t.start()
    for t in listeners:
        t.join()
    for path, _, keepalive in cases:
        stamps, lines = zip(*seen[path])
        assert lines[0] == keepalive and lines.count(keepalive) >= 2, (path, lines[:5])
        assert max(b - a for a, b in zip(stamps, stamps[1:])) < 2.5, path
    worker.join()
