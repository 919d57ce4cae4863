"""Anthropic's Messages API: request checks (turned into a chat completion), and the answer's shapes.

A conversation of content blocks becomes the messages a chat template reads: ``tool_use``
blocks become the assistant's ``tool_calls``, ``tool_result`` blocks ``tool`` messages,
``thinking`` blocks the turn's ``reasoning_content``, a ``system`` message anywhere stays
a system turn (or is folded into a user turn where the template allows none there). The
answer's blocks come from the same reply splitter as OpenAI's: thinking, text, then
``tool_use``; streamed as Anthropic's events, each with its ``event:`` line.

Claude Code's requests are taken as sent: ``?beta=true`` and ``anthropic-beta`` headers,
fields this server has no use for (``context_management``, ``output_config``,
``metadata``, ``cache_control``), any model name (the loaded model answers), deferred
tools (left out until loaded), and a ``max_tokens`` beyond the model's context (clamped).
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any, Optional

from .replies import ToolCall
from .request import (
    APIError,
    Blocks,
    Completion,
    Dialect,
    Event,
    Model,
    budget,
    chat_ids,
    flag,
    number,
    processing,
    sampling,
    stops,
    text_only,
    tool_choice,
)

SIGNATURE = "dflash-mlx"  # a thinking block's signature: clients require one; this server never checks it
STOP_SEQUENCES = 64  # the most a request may give
KINDS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 405: "not_found_error",
         413: "request_too_large", 503: "overloaded_error"}
PING = 'event: ping\ndata: {"type": "ping"}\n\n'
log = logging.getLogger("dflash_mlx.serve")


def error_body(e: APIError) -> dict[str, Any]:
    """Anthropic's error shape."""
    return {"type": "error", "error": {"type": KINDS.get(e.status, "api_error"), "message": e.message}}


def _text_blocks(content: Any, where: str) -> str:
    """Text from a string or a list of text blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise APIError(400, f"{where} must be text or a list of text blocks", where.split("[")[0].split(".")[0])
    for j, block in enumerate(content):
        if block.get("type") != "text":
            text_only(block, f"{where}[{j}]")
        if not isinstance(block.get("text"), str):
            raise APIError(400, f"{where}[{j}].text must be a string", where.split("[")[0].split(".")[0])
    return "".join(b["text"] for b in content)


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise APIError(400, f"{where}.content must be a string or a list of content blocks", "messages")
    return content


def _turns(message: Any, i: int) -> list[dict[str, Any]]:
    """One Messages API message as chat-template messages (a user turn of tool results becomes tool messages)."""
    where = f"messages[{i}]"
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant", "system"):
        raise APIError(400, f"{where} needs a role of user, assistant or system", "messages")
    if "content" not in message:
        raise APIError(400, f"{where} needs a content", "messages")
    role = message["role"]
    if role == "system":
        return [{"role": "system", "content": _text_blocks(message["content"], f"{where}.content")}]
    text, calls, reasoning, results = [], [], [], []
    for j, block in enumerate(_blocks(message["content"], where)):
        kind = block.get("type")
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise APIError(400, f"{where}.content[{j}].text must be a string", "messages")
            text.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                raise APIError(400, f"{where}.content[{j}]: tool_use needs a name and an input object", "messages")
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block["name"], "arguments": block.get("input", {})}})
        elif kind == "tool_result" and role == "user":
            content = block.get("content", "")
            results.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                            "content": _text_blocks(content, f"{where}.content[{j}].content") if content else ""})
        elif kind == "thinking" and role == "assistant":
            reasoning.append(str(block.get("thinking", "")))
        elif kind == "redacted_thinking":
            continue
        elif kind in ("image", "document"):
            text_only(block, f"{where}.content[{j}]")
        else:
            raise APIError(400, f"{where}.content[{j}]: {kind!r} blocks are not supported by this server "
                                f"(text, tool_use, tool_result and thinking are)", "messages")
    if role == "user":
        return results + ([{"role": "user", "content": "".join(text)}] if text or not results else [])
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        turn["tool_calls"] = calls
    if reasoning:
        turn["reasoning_content"] = "".join(reasoning)
    return [turn]


def _tools(body: dict) -> list[dict[str, Any]]:
    """The tools, in the OpenAI shape chat templates read; deferred and server-side tools are left out."""
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise APIError(400, "tools must be a list", "tools")
    converted = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise APIError(400, f"tools[{i}] needs a name", "tools")
        if tool.get("type", "custom") != "custom":  # Anthropic's own server tools (web search, code execution)
            log.info("tools[%d] %r: a server tool of type %r, which this server does not run: left out", i,
                     tool["name"], tool["type"])
            continue
        if tool.get("defer_loading"):  # loaded by a tool search later, never shown up front
            continue
        converted.append({"type": "function", "function": {
            "name": tool["name"], "description": tool.get("description", ""),
            "parameters": tool.get("input_schema") or {"type": "object", "properties": {}}}})
    choice = body.get("tool_choice") or {"type": "auto"}
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind is not None and not isinstance(kind, str):
        raise APIError(400, "tool_choice.type must be auto, any, tool or none", "tool_choice")
    return tool_choice({"any": "required", "tool": "named"}.get(kind, kind), converted)


def _thinking(body: dict) -> tuple[Optional[bool], bool]:
    """The template's thinking switch, and whether thinking text is shown (``display: "omitted"`` hides it)."""
    thinking = body.get("thinking")
    if thinking is None:
        return None, True
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "adaptive", "disabled"):
        raise APIError(400, "thinking must be {\"type\": \"enabled\" | \"adaptive\" | \"disabled\"}", "thinking")
    display = thinking.get("display", "summarized")
    if display not in ("summarized", "omitted"):
        raise APIError(400, "thinking.display must be \"summarized\" or \"omitted\"", "thinking")
    return kind != "disabled", display != "omitted"


def prompt(body: Any, model: Model) -> tuple[list[int], list[dict[str, Any]]]:
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
    return chat_ids(model.tokenizer, turns, tools, _thinking(body)[0], model.defaults.template_args, "messages"), tools


def parse(body: Any, model: Model) -> Completion:
    """Check a Messages request the way Anthropic's API does; render and tokenize its conversation."""
    ids, tools = prompt(body, model)
    if body.get("max_tokens") is None:
        raise APIError(400, "max_tokens: field required", "max_tokens")
    max_tokens = budget(model.target, ids, body["max_tokens"], model.defaults, "max_tokens")
    settings = sampling(body, model.defaults)
    number(body, "temperature", 0.0, float, 0.0, 1.0)  # Anthropic's range
    return Completion(ids, max_tokens, settings, stops(body.get("stop_sequences"), "stop_sequences", STOP_SEQUENCES),
                      flag(body, "stream"), chat=True, tools=tools, context=model.target.max_positions,
                      shape={"show_thinking": _thinking(body)[1]},
                      processing=processing(body, model.target.vocab_size))


def _usage(done: dict[str, Any], output: bool = True) -> dict[str, Any]:
    """Anthropic counts the prompt tokens read from a cache apart from the rest (input excludes them)."""
    figures = {"input_tokens": done["prompt_tokens"] - done["cached_tokens"],
               "cache_read_input_tokens": done["cached_tokens"], "cache_creation_input_tokens": 0}
    return figures | ({"output_tokens": done["completion_tokens"]} if output else {})


class MessageAnswer(Blocks):
    """One Messages API answer, built from the engine's pieces: whole, or as events to stream."""

    def __init__(self, completion: Completion, model: Model):
        super().__init__(model.tokenizer, completion)
        self.id, self.model, self.completion = f"msg_{uuid.uuid4().hex[:24]}", model.name, completion
        self.show_thinking = completion.shape.get("show_thinking", True)
        self.blocks: list[dict[str, Any]] = []

    def start(self, prompt_tokens: int, cached: int) -> list[Event]:
        usage = _usage({"prompt_tokens": prompt_tokens, "cached_tokens": cached}, output=False) | {"output_tokens": 0}
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": usage}
        return [("message_start", {"type": "message_start", "message": message}), ("ping", {"type": "ping"})]

    def _event(self, kind: str, **data: Any) -> Event:
        return kind, {"type": kind, "index": self.count, **data}

    def begin(self, kind: str) -> list[Event]:
        block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "reasoning" else {"type": "text",
                                                                                                  "text": ""}
        self.blocks.append(dict(block, signature=SIGNATURE) if kind == "reasoning" else dict(block))
        return [self._event("content_block_start", content_block=block)]

    def extend(self, kind: str, text: str) -> list[Event]:
        if kind == "reasoning":
            if not self.show_thinking:
                return []
            self.blocks[-1]["thinking"] += text
            return [self._event("content_block_delta", delta={"type": "thinking_delta", "thinking": text})]
        self.blocks[-1]["text"] += text
        return [self._event("content_block_delta", delta={"type": "text_delta", "text": text})]

    def end(self, kind: str) -> list[Event]:
        events = []
        if kind == "reasoning":
            events.append(self._event("content_block_delta", delta={"type": "signature_delta", "signature": SIGNATURE}))
        return events + [self._event("content_block_stop")]

    def call(self, call: ToolCall) -> list[Event]:
        block = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": call.name, "input": call.arguments}
        self.blocks.append(block)
        partial = json.dumps(call.arguments, ensure_ascii=False)
        return [self._event("content_block_start", content_block=dict(block, input={})),
                self._event("content_block_delta", delta={"type": "input_json_delta", "partial_json": partial}),
                self._event("content_block_stop")]

    def _stop(self, done: dict[str, Any]) -> tuple[str, Optional[str]]:
        if done["stop_sequence"] is not None:
            return "stop_sequence", done["stop_sequence"]
        if self.reply.tool_calls and done["finish_reason"] == "stop":
            return "tool_use", None
        if self.completion.context_full(done):
            return "model_context_window_exceeded", None
        return ("max_tokens" if done["finish_reason"] == "length" else "end_turn"), None

    def last(self, done: dict[str, Any]) -> list[Event]:
        events = self.finish()
        reason, sequence = self._stop(done)
        return events + [("message_delta", {"type": "message_delta",
                                            "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                            "usage": _usage(done)}),
                         ("message_stop", {"type": "message_stop"})]

    def whole(self, done: dict[str, Any]) -> dict[str, Any]:
        self.finish()
        reason, sequence = self._stop(done)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": self.blocks,
                "stop_reason": reason, "stop_sequence": sequence, "usage": _usage(done)}

    def failed(self, error: APIError) -> list[Event]:
        return [("error", error_body(error))]


MESSAGES = Dialect(("/v1/messages",), parse, MessageAnswer, error_body, keepalive=PING)
