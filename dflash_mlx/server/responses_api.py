"""OpenAI's Responses API (``POST /v1/responses``), stateless: what Codex CLI speaks, and Zed without chat completions.

A request's ``instructions`` and ``input`` items become the messages a chat template
reads: message items (``input_text``/``output_text`` parts; roles user, assistant, system
and developer), ``function_call`` items the assistant's tool calls, ``function_call_output``
items tool messages, ``reasoning`` items the next assistant turn's reasoning. Function
tools are offered as they are, the tools inside a ``namespace`` group flattened (a call to
one names its namespace again); hosted tools (``web_search``, ...) are left out with a log
line. Nothing is stored: ``previous_response_id`` is refused, the client sends the whole
conversation (Codex does, with ``store: false``).

The reply comes back as output items, ``reasoning``, ``message`` and ``function_call``,
whole or as the event sequence the official client and Codex parse (``response.created``
... ``response.completed``). A refused streamed request is a ``response.failed`` event
(Codex compacts its conversation on the code ``context_length_exceeded``).
"""

from __future__ import annotations

import json
import logging
import time
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
    processing,
    sampling,
    text_only,
    thinking_from_effort,
    tool_choice,
)

log = logging.getLogger("dflash_mlx.serve")
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
# Fields that would change the answer and that this server does not implement: refused, never ignored.
UNSUPPORTED = {
    "previous_response_id": lambda v: v is not None, "conversation": lambda v: v is not None,
    "prompt": lambda v: v is not None, "background": lambda v: bool(v),
    "text": lambda v: isinstance(v, dict) and v.get("format") not in (None, {"type": "text"}),
    "top_logprobs": lambda v: v not in (None, 0),
}
REFUSALS = {"previous_response_id": "this server stores no responses: send the whole conversation in input "
                                    "(as Codex does with store: false)"}


def _new(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _text(content: Any, where: str) -> str:
    """A message item's content: a string or a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not all(isinstance(p, dict) for p in content):
        raise APIError(400, f"{where} must be a string or a list of content parts", "input")
    for j, part in enumerate(content):
        if part.get("type") not in TEXT_PARTS:
            text_only(part, f"{where}[{j}]")
        if not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}[{j}].text must be a string", "input")
    return "".join(p["text"] for p in content)


def _output(output: Any, where: str) -> str:
    """A function call's output: a string, or a list of text parts (an image in it is refused)."""
    return output if isinstance(output, str) else _text(output, where)


class _Conversation:
    """Input items gathered into chat-template messages: calls join the assistant turn they follow."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.reasoning: list[str] = []  # from reasoning items, for the next assistant turn

    def _assistant(self) -> dict[str, Any]:
        """The assistant turn a call or text joins: the last message if it is one without tool results after it."""
        if not self.messages or self.messages[-1]["role"] != "assistant":
            self.messages.append({"role": "assistant", "content": ""})
        turn = self.messages[-1]
        if self.reasoning:
            turn["reasoning_content"] = turn.get("reasoning_content", "") + "".join(self.reasoning)
            self.reasoning = []
        return turn

    def add(self, item: Any, i: int) -> None:
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            role = ROLES.get(role) if isinstance(role, str) else None
            if role is None:
                raise APIError(400, f"{where} needs a role of user, assistant, system or developer", "input")
            text = _text(item.get("content"), f"{where}.content")
            if role == "assistant":
                turn = self._assistant()
                turn["content"] += text
            else:
                self.messages.append({"role": role, "content": text})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str):
                raise APIError(400, f"{where}: a function_call needs a name", "input")
            try:
                arguments = json.loads(item.get("arguments") or "{}")
            except (TypeError, json.JSONDecodeError):
                raise APIError(400, f"{where}.arguments is not a JSON string", "input") from None
            if not isinstance(arguments, dict):
                raise APIError(400, f"{where}.arguments must be a JSON object", "input")
            self._assistant().setdefault("tool_calls", []).append(
                {"id": item.get("call_id"), "type": "function", "function": {"name": item["name"],
                                                                             "arguments": arguments}})
        elif kind == "function_call_output":
            self.messages.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                                  "content": _output(item.get("output", ""), f"{where}.output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            self.reasoning.append(_text(parts, f"{where}.content") if parts else "")
        elif kind in ("input_image", "input_file", "input_audio"):
            text_only(item, where)
        elif kind == "item_reference":
            raise APIError(400, f"{where}: this server stores no items to refer to: send them whole", "input")
        else:  # a hosted tool's call from an earlier turn (web_search_call, ...): nothing a template can show
            log.info("%s: a %r item, which this server has no use for: left out", where, kind)


def _tools(body: dict) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Function tools in the chat shape (a namespace's flattened), and the namespace of each flattened name."""
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise APIError(400, "tools must be a list", "tools")
    offered: list[dict[str, Any]] = []
    namespaces: dict[str, str] = {}

    def function(tool: Any, where: str, namespace: Optional[str] = None) -> None:
        if not isinstance(tool, dict):
            raise APIError(400, f"{where} must be an object", "tools")
        if tool.get("type") != "function":
            log.info("%s: a %r tool, which this server does not run: left out", where, tool.get("type"))
            return
        if not isinstance(tool.get("name"), str):
            raise APIError(400, f"{where}: a function tool needs a name", "tools")
        offered.append({"type": "function", "function": {
            "name": tool["name"], "description": tool.get("description") or "",
            "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}})
        if namespace is not None:
            namespaces[tool["name"]] = namespace

    for i, tool in enumerate(tools):
        if isinstance(tool, dict) and tool.get("type") == "namespace":
            inner_tools = tool.get("tools") or []
            if not isinstance(inner_tools, list):
                raise APIError(400, f"tools[{i}].tools must be a list", "tools")
            for j, inner in enumerate(inner_tools):
                function(inner, f"tools[{i}].tools[{j}]", str(tool.get("name", "")))
        else:
            function(tool, f"tools[{i}]")
    choice = body.get("tool_choice") or "auto"
    if isinstance(choice, dict):
        choice = "named"
    return tool_choice(choice, offered), namespaces


def _refuse_unsupported(body: dict) -> None:
    for name, refused in UNSUPPORTED.items():
        if name in body and refused(body[name]):
            reason = REFUSALS.get(name, "not supported by this server")
            raise APIError(400, f"{name}: {reason}", name, "unsupported_parameter")


def parse(body: Any, model: Model) -> Completion:
    """Check a Responses request; render and tokenize its conversation."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    _refuse_unsupported(body)
    conversation = _Conversation()
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise APIError(400, "instructions must be a string", "instructions")
    items = body.get("input")
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise APIError(400, "input must be a string or a non-empty list of items", "input")
    for i, item in enumerate(items):
        conversation.add(item, i)
    messages = conversation.messages
    if instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    tools, namespaces = _tools(body)
    reasoning = body.get("reasoning") or {}
    if not isinstance(reasoning, dict):
        raise APIError(400, "reasoning must be an object", "reasoning")
    thinking = thinking_from_effort(reasoning.get("effort"), "reasoning.effort")
    ids = chat_ids(model.tokenizer, messages, tools, thinking, model.defaults.template_args, "input")
    max_tokens = budget(model.target, ids, body.get("max_output_tokens"), model.defaults, "max_output_tokens")
    echo = {"instructions": instructions, "tool_choice": body.get("tool_choice") or "auto",
            "tools": body.get("tools") or [], "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "metadata": body.get("metadata") or {}, "reasoning": {"effort": reasoning.get("effort"),
                                                                  "summary": reasoning.get("summary")}}
    return Completion(ids, max_tokens, sampling(body, model.defaults), [], flag(body, "stream"), chat=True,
                      tools=tools, context=model.target.max_positions,
                      shape={"namespaces": namespaces, "echo": echo, "temperature": body.get("temperature"),
                             "top_p": body.get("top_p"), "max_output_tokens": body.get("max_output_tokens")},
                      processing=processing(body, model.target.vocab_size))


def _usage(done: dict[str, Any]) -> dict[str, Any]:
    return {"input_tokens": done["prompt_tokens"], "input_tokens_details": {"cached_tokens": done["cached_tokens"]},
            "output_tokens": done["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": done["prompt_tokens"] + done["completion_tokens"]}


class ResponseAnswer(Blocks):
    """One response: output items built from the engine's pieces, whole or as the Responses API's events."""

    def __init__(self, completion: Completion, model: Model):
        super().__init__(model.tokenizer, completion)
        self.completion, self.model = completion, model.name
        self.id, self.created = _new("resp"), int(time.time())
        self.output: list[dict[str, Any]] = []
        self.sequence = 0

    def response(self, status: str, **extra: Any) -> dict[str, Any]:
        shape = self.completion.shape
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
                "output": self.output, "error": None, "incomplete_details": None, "usage": None, "store": False,
                "temperature": shape.get("temperature"), "top_p": shape.get("top_p"),
                "max_output_tokens": shape.get("max_output_tokens"), "text": {"format": {"type": "text"}},
                "truncation": "disabled", **shape.get("echo", {}), **extra}

    def _event(self, kind: str, **data: Any) -> Event:
        self.sequence += 1
        return kind, {"type": kind, "sequence_number": self.sequence - 1, **data}

    def start(self, prompt_tokens: int, cached: int) -> list[Event]:
        return [self._event("response.created", response=self.response("in_progress")),
                self._event("response.in_progress", response=self.response("in_progress"))]

    def _item(self) -> dict[str, Any]:
        return {"item_id": self.output[-1]["id"], "output_index": self.count}

    def begin(self, kind: str) -> list[Event]:
        if kind == "reasoning":
            item = {"type": "reasoning", "id": _new("rs"), "summary": [], "content": [], "encrypted_content": None,
                    "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"type": "message", "id": _new("msg"), "role": "assistant", "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.output.append(item)
        added = self._event("response.output_item.added", output_index=self.count, item=json.loads(json.dumps(item)))
        item["content"].append(part)
        return [added, self._event("response.content_part.added", **self._item(), content_index=0,
                                   part=dict(part))]

    def extend(self, kind: str, text: str) -> list[Event]:
        self.output[-1]["content"][0]["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        return [self._event(name, **self._item(), content_index=0, delta=text)]

    def end(self, kind: str) -> list[Event]:
        item = self.output[-1]
        item["status"] = "completed"
        part = item["content"][0]
        name = "response.reasoning_text.done" if kind == "reasoning" else "response.output_text.done"
        return [self._event(name, **self._item(), content_index=0, text=part["text"]),
                self._event("response.content_part.done", **self._item(), content_index=0, part=part),
                self._event("response.output_item.done", output_index=self.count, item=item)]

    def call(self, call: ToolCall) -> list[Event]:
        arguments = json.dumps(call.arguments, ensure_ascii=False)
        item = {"type": "function_call", "id": _new("fc"), "call_id": _new("call"), "name": call.name,
                "arguments": "", "status": "in_progress"}
        if call.name in self.completion.shape.get("namespaces", {}):
            item["namespace"] = self.completion.shape["namespaces"][call.name]
        self.output.append(item)
        events = [self._event("response.output_item.added", output_index=self.count, item=dict(item)),
                  self._event("response.function_call_arguments.delta", **self._item(), delta=arguments)]
        item.update(arguments=arguments, status="completed")
        return events + [self._event("response.function_call_arguments.done", **self._item(), arguments=arguments),
                         self._event("response.output_item.done", output_index=self.count, item=item)]

    def _final(self, done: dict[str, Any]) -> dict[str, Any]:
        if done["finish_reason"] == "length":
            return self.response("incomplete", usage=_usage(done),
                                 incomplete_details={"reason": "max_output_tokens"})
        return self.response("completed", usage=_usage(done))

    def last(self, done: dict[str, Any]) -> list[Event]:
        events = self.finish()
        final = self._final(done)
        return events + [self._event(f"response.{final['status']}", response=final)]

    def whole(self, done: dict[str, Any]) -> dict[str, Any]:
        self.finish()
        return self._final(done)

    def failed(self, error: APIError) -> list[Event]:
        failure = {"code": error.code or ("server_error" if error.status >= 500 else "invalid_request"),
                   "message": error.message}
        return [self._event("response.failed", response=self.response("failed", error=failure))]


def refuse_in_stream(error: APIError, model: Model) -> list[Event]:
    """A refused streamed request as Codex reads it: the response created, then failed with the error's code."""
    answer = ResponseAnswer(Completion([], 1, {}, chat=True), model)
    return answer.start(0, 0) + answer.failed(error)


RESPONSES = Dialect(("/v1/responses", "/responses"), parse, ResponseAnswer, refuse_in_stream=refuse_in_stream)
