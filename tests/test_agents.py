"""`serve` for agents and editors, end to end: a real server on a loopback port, driven by the official `openai` and
`anthropic` clients, over a scripted target (``fixtures.AGENT_SCRIPTS``): it answers a chat with a think block then
an answer, a tool call when tools are offered, and an answer after the tool's result, as Qwen3 writes them."""

from __future__ import annotations

import json

import httpx2 as httpx
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from dflash_mlx import fixtures, load
from dflash_mlx.chat_template import render
from dflash_mlx.replies import Reply, ToolCall
from helpers import finish, start_server

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
                       "https://editor.example")
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
        out = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0).chat.completions.create(
            model="any", messages=ASK, tools=TOOLS)
        assert out.choices[0].finish_reason == "stop" and out.choices[0].message.tool_calls is None
        assert out.choices[0].message.content == "".join(bad[:3])
    finally:
        log = _stop(proc)
    # one line per request (--log-level info, the default): what it asked, what it cost
    assert "POST /v1/chat/completions 200 prompt" in log and "tok/s" in log


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


# -- what else a client expects ------------------------------------------------------------------------


def test_metrics_cors_and_a_log_line_per_request(server, client):
    client.chat.completions.create(model="any", messages=ASK, tools=TOOLS)
    metrics = httpx.get(f"{server['url']}/metrics").text
    for name in ("dflash_requests_total", "dflash_prompt_tokens_total", "dflash_cached_prompt_tokens_total",
                 "dflash_generated_tokens_total", "dflash_drafted_tokens_total", "dflash_accepted_tokens_total",
                 "dflash_time_to_first_token_seconds_bucket", "dflash_decode_tokens_per_second_bucket"):
        assert name in metrics, name
    counted = [line for line in metrics.splitlines() if line.startswith('dflash_requests_total{endpoint="/v1/chat')]
    assert counted and float(counted[0].split()[-1]) >= 1
    preflight = {"Origin": "https://editor.example", "Access-Control-Request-Method": "POST"}
    allowed = httpx.options(f"{server['url']}/v1/chat/completions", headers=preflight)
    assert allowed.headers.get("access-control-allow-origin") == "https://editor.example"
    other = httpx.options(f"{server['url']}/v1/chat/completions", headers=dict(preflight, Origin="https://evil.example"))
    assert other.headers.get("access-control-allow-origin") is None
