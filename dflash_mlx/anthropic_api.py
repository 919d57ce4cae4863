"""Anthropic's Messages API: request checks (turned into a chat completion), and the answer's shapes.

A conversation of content blocks becomes the messages a chat template reads: ``tool_use``
blocks become the assistant's ``tool_calls``, ``tool_result`` blocks ``tool`` messages,
``thinking`` blocks the turn's ``reasoning_content``. The answer's blocks come from the
same reply splitter as OpenAI's: thinking, text, then ``tool_use``; streamed as Anthropic's
events, each with its ``event:`` line (the official client reads those).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Optional

from .api import APIError, Completion, Defaults, budget, chat_ids, number, sampling, stops
from .replies import Reply

SIGNATURE = "dflash-mlx"  # a thinking block's signature: clients require one; this server never checks it
STOP_SEQUENCES = 64  # the most a request may give
KINDS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 413: "request_too_large",
         503: "overloaded_error"}


def error_body(e: APIError) -> dict[str, Any]:
    """Anthropic's error shape."""
    return {"type": "error", "error": {"type": KINDS.get(e.status, "api_error"), "message": e.message}}


def _text_blocks(content: Any, where: str) -> str:
    """Text from a string or a list of text blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in content):
        return "".join(str(b.get("text", "")) for b in content)
    raise APIError(400, f"{where} must be text or a list of text blocks", where.split("[")[0].split(".")[0])


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise APIError(400, f"{where}.content must be a string or a list of content blocks", "messages")
    return content


def _turns(message: Any, i: int) -> list[dict[str, Any]]:
    """One Messages API message as chat-template messages (a user turn of tool results becomes tool messages)."""
    where = f"messages[{i}]"
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise APIError(400, f"{where} needs a role of user or assistant", "messages")
    text, calls, reasoning, results = [], [], [], []
    for j, block in enumerate(_blocks(message.get("content"), where)):
        kind = block.get("type")
        if kind == "text":
            text.append(str(block.get("text", "")))
        elif kind == "tool_use" and message["role"] == "assistant":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                raise APIError(400, f"{where}.content[{j}]: tool_use needs a name and an input object", "messages")
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block["name"], "arguments": block.get("input", {})}})
        elif kind == "tool_result" and message["role"] == "user":
            content = block.get("content", "")
            results.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                            "content": _text_blocks(content, f"{where}.content[{j}].content") if content else ""})
        elif kind == "thinking" and message["role"] == "assistant":
            reasoning.append(str(block.get("thinking", "")))
        elif kind == "redacted_thinking":
            continue
        else:
            raise APIError(400, f"{where}.content[{j}]: {kind!r} blocks are not supported by this server "
                                f"(text, tool_use, tool_result and thinking are)", "messages")
    if message["role"] == "user":
        return results + ([{"role": "user", "content": "".join(text)}] if text or not results else [])
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        turn["tool_calls"] = calls
    if reasoning:
        turn["reasoning_content"] = "".join(reasoning)
    return [turn]


def _tools(body: dict) -> list[dict[str, Any]]:
    """The tools, in the OpenAI shape chat templates read, if the model may call them (tool_choice auto)."""
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise APIError(400, "tools must be a list", "tools")
    converted = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom" or not isinstance(tool.get("name"), str):
            raise APIError(400, f"tools[{i}]: only custom tools with a name and an input_schema are supported", "tools")
        converted.append({"type": "function", "function": {
            "name": tool["name"], "description": tool.get("description", ""),
            "parameters": tool.get("input_schema") or {"type": "object", "properties": {}}}})
    choice = body.get("tool_choice") or {"type": "auto"}
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "auto":
        return converted
    if kind == "none":
        return []
    raise APIError(400, "tool_choice \"any\" or a named tool is not enforced by this server (the model may not "
                        "follow it): use \"auto\" or \"none\"", "tool_choice")


def _thinking(body: dict) -> Optional[bool]:
    thinking = body.get("thinking")
    if thinking is None:
        return None
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "adaptive", "disabled"):
        raise APIError(400, "thinking must be {\"type\": \"enabled\" | \"adaptive\" | \"disabled\"}", "thinking")
    return kind != "disabled"


def prompt(body: Any, tokenizer: Any) -> tuple[list[int], list[dict[str, Any]]]:
    """The token ids of a Messages (or count_tokens) request, and the tools it offers."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", "messages")
    turns = [turn for i, m in enumerate(messages) for turn in _turns(m, i)]
    if body.get("system"):
        turns.insert(0, {"role": "system", "content": _text_blocks(body["system"], "system")})
    tools = _tools(body)
    return chat_ids(tokenizer, turns, tools, _thinking(body), {}, "messages"), tools


def parse(body: Any, tokenizer: Any, target: Any, defaults: Defaults) -> Completion:
    """Check a Messages request the way Anthropic's API does; render and tokenize its conversation."""
    ids, tools = prompt(body, tokenizer)
    if body.get("max_tokens") is None:
        raise APIError(400, "max_tokens: field required", "max_tokens")
    max_tokens = budget(target, ids, body["max_tokens"], defaults, "max_tokens", "messages")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, "stream must be true or false", "stream")
    settings = sampling(body, defaults)
    number(body, "temperature", 0.0, float, 0.0, 1.0)  # Anthropic's range
    return Completion(ids, max_tokens, settings, stops(body.get("stop_sequences"), "stop_sequences", STOP_SEQUENCES),
                      stream, chat=True, tools=tools)


def _usage(done: dict[str, Any], output: bool = True) -> dict[str, Any]:
    """Anthropic counts the prompt tokens read from a cache apart from the rest."""
    figures = {"input_tokens": done["prompt_tokens"] - done["cached_tokens"],
               "cache_read_input_tokens": done["cached_tokens"], "cache_creation_input_tokens": 0}
    return figures | ({"output_tokens": done["completion_tokens"]} if output else {})


class MessageAnswer:
    """One Messages API answer, built from the engine's pieces: whole, or as (event, data) pairs to stream."""

    def __init__(self, message_id: str, model: str, completion: Completion, tokenizer: Any):
        self.id, self.model, self.completion = message_id, model, completion
        self.reply = Reply(tokenizer, completion.ids, completion.tools)
        self.blocks: list[dict[str, Any]] = []
        self.open: Optional[str] = None  # the kind of the block being streamed

    def start(self, prompt_tokens: int, cached: int) -> list[tuple[str, dict[str, Any]]]:
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": _usage({"prompt_tokens": prompt_tokens, "cached_tokens": cached}, output=False)
                   | {"output_tokens": 0}}
        return [("message_start", {"type": "message_start", "message": message}), ("ping", {"type": "ping"})]

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        if self.open is None:
            return []
        index, events = len(self.blocks) - 1, []
        if self.open == "thinking":
            events.append(("content_block_delta", {"type": "content_block_delta", "index": index,
                                                   "delta": {"type": "signature_delta", "signature": SIGNATURE}}))
        self.open = None
        return events + [("content_block_stop", {"type": "content_block_stop", "index": index})]

    def _events(self, events: list) -> list[tuple[str, dict[str, Any]]]:
        out = []
        for kind, value in events:
            if kind == "tool_call":
                out += self._close()
                block = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": value.name,
                         "input": value.arguments}
                self.blocks.append(block)
                index = len(self.blocks) - 1
                out += [("content_block_start", {"type": "content_block_start", "index": index,
                                                 "content_block": dict(block, input={})}),
                        ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
                            "type": "input_json_delta", "partial_json": json.dumps(value.arguments, ensure_ascii=False)}}),
                        ("content_block_stop", {"type": "content_block_stop", "index": index})]
                continue
            block_kind, field = ("thinking", "thinking") if kind == "reasoning" else ("text", "text")
            if self.open != block_kind:
                out += self._close()
                self.blocks.append({"type": block_kind, field: ""} | ({"signature": SIGNATURE}
                                                                       if block_kind == "thinking" else {}))
                self.open = block_kind
                start = {"type": block_kind, field: ""} | ({"signature": ""} if block_kind == "thinking" else {})
                out.append(("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                                    "content_block": start}))
            self.blocks[-1][field] += value
            out.append(("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                                "delta": {"type": f"{field}_delta", field: value}}))
        return out

    def add(self, piece: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        return self._events(self.reply.feed(piece["text"]))

    def _stop(self, done: dict[str, Any]) -> tuple[str, Optional[str]]:
        if done["stop_sequence"] is not None:
            return "stop_sequence", done["stop_sequence"]
        if self.reply.tool_calls and done["finish_reason"] == "stop":
            return "tool_use", None
        return ("max_tokens" if done["finish_reason"] == "length" else "end_turn"), None

    def last(self, done: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        events = self._events(self.reply.finish()) + self._close()
        reason, sequence = self._stop(done)
        return events + [("message_delta", {"type": "message_delta",
                                            "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                            "usage": _usage(done)}),
                         ("message_stop", {"type": "message_stop"})]

    def whole(self, done: dict[str, Any]) -> dict[str, Any]:
        self._events(self.reply.finish())
        self._close()
        reason, sequence = self._stop(done)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": self.blocks,
                "stop_reason": reason, "stop_sequence": sequence, "usage": _usage(done)}
