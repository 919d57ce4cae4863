"""Malformed request bodies on every route are refused with a 400 naming what is wrong, never a 500.

Valid bodies of each API (tools, tool choices, content parts, system prompts, sampling) are mutated at
random: a value anywhere in the tree replaced by one of another type, a key dropped, an unknown one
added. Each mutant goes through the route's own parsing (the dialect's ``parse``, ``count_tokens``'
``prompt``) on a loaded engine: the only exception allowed out is ``APIError`` with a 4xx status.
"""

from __future__ import annotations

import copy
import json
import random
from typing import Any, Callable

import pytest

from dflash_mlx import load
from dflash_mlx.server import anthropic_api, openai_api, responses_api
from dflash_mlx.server.engine import Engine
from dflash_mlx.server.request import APIError, read_body

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
ANTHROPIC_TOOL = {"name": "get_weather", "description": "Weather of a city",
                  "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city",
                  "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}

BODIES: dict[str, dict[str, Any]] = {
    "chat": {"model": "m", "max_tokens": 4, "temperature": 0.5, "top_p": 0.9, "seed": 1, "stop": ["\n\n"],
             "logprobs": True, "top_logprobs": 2, "tools": [TOOL], "tool_choice": "auto",
             "stream_options": {"include_usage": True}, "chat_template_kwargs": {"enable_thinking": False},
             "messages": [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
                          {"role": "assistant", "content": None, "tool_calls": [
                              {"id": "c1", "type": "function",
                               "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                          {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]},
    "text": {"model": "m", "prompt": "def f(x):", "max_tokens": 4, "stop": "\n", "logprobs": 2,
             "repetition_penalty": 1.1, "logit_bias": {"5": -1.0}},
    "messages": {"model": "m", "max_tokens": 4, "system": [{"type": "text", "text": "Be brief."}],
                 "tools": [ANTHROPIC_TOOL], "tool_choice": {"type": "auto"}, "stop_sequences": ["\n\n"],
                 "thinking": {"type": "disabled"}, "top_k": 5,
                 "messages": [{"role": "user", "content": "Weather in Paris?"},
                              {"role": "assistant", "content": [
                                  {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}]},
                              {"role": "user", "content": [
                                  {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}]},
    "responses": {"model": "m", "max_output_tokens": 4, "instructions": "Be brief.",
                  "tools": [RESPONSES_TOOL, {"type": "namespace", "name": "weather", "tools": [RESPONSES_TOOL]}],
                  "tool_choice": "auto", "reasoning": {"effort": "low"}, "text": {"format": {"type": "text"}},
                  "input": [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
                            {"type": "function_call", "call_id": "c1", "name": "get_weather",
                             "arguments": "{\"city\": \"Paris\"}"},
                            {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]},
}
BODIES["count_tokens"] = {k: v for k, v in BODIES["messages"].items() if k != "max_tokens"}

REPLACEMENTS: list[Any] = [None, True, 0, -1, 5, 2.5, 1e308, "", "x", [], {}, [5], ["x"], [{}], {"type": []},
                           {"type": "namespace", "tools": 5}, [[[]]], {"role": {}}, {"x": {"y": [None]}}]


def paths(value: Any, at: tuple = ()) -> list[tuple]:
    """Every place in a JSON tree (the root included)."""
    found = [at]
    if isinstance(value, dict):
        for k, v in value.items():
            found += paths(v, at + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found += paths(v, at + (i,))
    return found


def mutate(body: dict, rng: random.Random) -> Any:
    """One, two or three random changes to a copy of ``body``."""
    out: Any = copy.deepcopy(body)
    for _ in range(rng.randint(1, 3)):
        at = rng.choice(paths(out))
        if not at:
            return rng.choice(REPLACEMENTS)
        parent = out
        for key in at[:-1]:
            parent = parent[key]
        move = rng.random()
        if move < 0.15 and isinstance(parent, dict):
            del parent[at[-1]]
        elif move < 0.25 and isinstance(parent, dict):
            parent["unexpected_" + str(rng.randint(0, 9))] = rng.choice(REPLACEMENTS)
        else:
            parent[at[-1]] = copy.deepcopy(rng.choice(REPLACEMENTS))
    return out


@pytest.fixture(scope="module")
def engine(models_dir):
    target, drafter, tokenizer = load(str(models_dir / "qwen3-dflash"), str(models_dir / "qwen3"))
    return Engine(target, drafter, tokenizer, "m")


def routes(engine: Engine) -> dict[str, Callable[[Any], Any]]:
    return {"chat": lambda b: openai_api.CHAT.parse(b, engine), "text": lambda b: openai_api.TEXT.parse(b, engine),
            "messages": lambda b: anthropic_api.MESSAGES.parse(b, engine),
            "count_tokens": lambda b: anthropic_api.prompt(b, engine),
            "responses": lambda b: responses_api.RESPONSES.parse(b, engine)}


def test_the_valid_bodies_parse(engine):
    """The seeds of the mutations are accepted as they are: the fuzzing starts from bodies that get through."""
    for name, parse in routes(engine).items():
        parse(copy.deepcopy(BODIES[name]))


@pytest.mark.parametrize("name", list(BODIES))
def test_mutated_bodies_are_refused_with_a_400(engine, name):
    rng, parse, failures = random.Random(name), routes(engine)[name], []
    for _ in range(600):
        body = mutate(BODIES[name], rng)
        try:
            parse(body)
        except APIError as e:
            assert 400 <= e.status < 500 and e.message, (e.status, e.message)
        except Exception as e:  # noqa: BLE001 (what the test is looking for)
            failures.append(f"{type(e).__name__}: {e} <- {json.dumps(body)[:300]}")
    assert not failures, f"{len(failures)} mutants raised other than APIError:\n" + "\n".join(failures[:10])


@pytest.mark.parametrize("depth", [200, 100_000])
def test_deeply_nested_bodies_are_refused_with_a_400(depth):
    """200 kB of nested arrays: json's recursion limit was a 500; any nesting past what a request needs is a 400."""
    with pytest.raises(APIError) as refused:
        read_body(("[" * depth + "]" * depth).encode())
    assert refused.value.status == 400 and "nest" in refused.value.message


@pytest.mark.parametrize("route,body", [
    ("responses", {"model": "m", "input": "hi", "tools": [{"type": "namespace", "tools": 5}]}),
    ("responses", {"model": "m", "input": [{"role": {"a": 1}, "content": "hi"}]}),
    ("messages", {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}],
                  "tool_choice": {"type": []}}),
    ("count_tokens", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": []}}),
])
def test_the_bodies_the_review_found_are_refused_naming_the_field(engine, route, body):
    with pytest.raises(APIError) as refused:
        routes(engine)[route](body)
    assert refused.value.status == 400 and refused.value.param in ("tools", "input", "tool_choice")
