"""OpenAI's chat and text completions: request checks, and the answers' shapes (whole, or as stream chunks).

Tool calls and reasoning follow what OpenAI's clients read: ``message.tool_calls`` (a
call's arguments as a JSON string), ``finish_reason: "tool_calls"``, streamed as
``delta.tool_calls`` chunks (index, id, type and name, then the arguments); the think
block goes to ``reasoning_content``, as vLLM, SGLang and DeepSeek's API name it.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Optional

from ..chat_template import encode_prompt
from .replies import Reply, ToolCall
from .request import (
    TOP_LOGPROBS,
    APIError,
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
    thinking_from_effort,
    tool_choice,
)

# Parameters that would change the answer and that this server does not implement: refused, never ignored.
UNSUPPORTED = {
    "response_format": lambda v: v not in (None, {"type": "text"}),
    "best_of": lambda v: v not in (None, 1), "echo": lambda v: bool(v), "suffix": lambda v: v not in (None, ""),
    "n": lambda v: v not in (None, 1), "functions": lambda v: bool(v), "function_call": lambda v: v not in (None, "none"),
    # mlx-lm's server reads these too
    "xtc_probability": lambda v: v not in (None, 0, 0.0), "adapters": lambda v: bool(v), "role_mapping": lambda v: bool(v),
}
ROLES = ("system", "developer", "user", "assistant", "tool")


def _refuse_unsupported(body: dict) -> None:
    for name, refused in UNSUPPORTED.items():
        if name in body and refused(body[name]):
            raise APIError(400, f"{name} is not supported by this server", name, "unsupported_parameter")


def _text(content: Any, where: str) -> str:
    """A message's content: a string, null (an assistant turn that only calls tools), or a list of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        for j, p in enumerate(content):
            if p.get("type") != "text":
                text_only(p, f"{where}[{j}]")
            if not isinstance(p.get("text"), str):
                raise APIError(400, f"{where}[{j}].text must be a string", "messages")
        return "".join(p["text"] for p in content)
    raise APIError(400, f"{where} must be a string, null or a list of text parts", "messages")


def _message(m: Any, i: int) -> dict[str, Any]:
    """One message, as the chat template reads it (a call's arguments as an object, as Qwen's templates want)."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise APIError(400, f"{where} needs a role of system, developer, user, assistant or tool", "messages")
    if m.get("content") is None and not (m["role"] == "assistant" and (m.get("tool_calls") or "content" in m)):
        raise APIError(400, f"{where} needs a content", "messages")
    role = "system" if m["role"] == "developer" else m["role"]
    out: dict[str, Any] = {"role": role, "content": _text(m.get("content"), f"{where}.content")}
    if role == "tool":
        out["tool_call_id"] = str(m.get("tool_call_id", ""))
    if role == "assistant" and isinstance(m.get("reasoning_content"), str):
        out["reasoning_content"] = m["reasoning_content"]
    if role == "assistant" and m.get("tool_calls"):
        calls = m["tool_calls"]
        if not isinstance(calls, list):
            raise APIError(400, f"{where}.tool_calls must be a list", "messages")
        out["tool_calls"] = [_history_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    return out


def _history_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError(400, f"{where} needs a function with a name", "messages")
    arguments = function.get("arguments") or "{}"
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise APIError(400, f"{where}.function.arguments is not valid JSON", "messages") from None
    if not isinstance(arguments, dict):
        raise APIError(400, f"{where}.function.arguments must be a JSON object", "messages")
    return {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def _tools(body: dict) -> list[dict[str, Any]]:
    """The tools offered: all of them unless tool_choice is "none" ("required" or a named one is not enforced)."""
    tools, choice = body.get("tools") or [], body.get("tool_choice") or "auto"
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools):
        raise APIError(400, "tools must be a list of {\"type\": \"function\", \"function\": {\"name\": ...}}", "tools")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = "named"
    return tool_choice(choice, tools)


def _thinking(body: dict, kwargs: dict[str, Any]) -> Optional[bool]:
    """The thinking switch: chat_template_kwargs.enable_thinking, else reasoning_effort ("none": off)."""
    if "enable_thinking" in kwargs:
        return None  # the template gets it as it was sent
    return thinking_from_effort(body.get("reasoning_effort"), "reasoning_effort")


def _logprobs(body: dict, chat: bool) -> Optional[int]:
    if chat:
        wanted = body.get("logprobs")
        if wanted is not None and not isinstance(wanted, bool):
            raise APIError(400, "logprobs must be true or false", "logprobs")
        top = number(body, "top_logprobs", None, int, 0, TOP_LOGPROBS)
        if top is not None and not wanted:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (top or 0) if wanted else None
    return number(body, "logprobs", None, int, 0, TOP_LOGPROBS)  # text completions: the count of alternatives


def _stream_options(body: dict) -> tuple[bool, bool]:
    stream = flag(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError(400, "stream_options must be an object", "stream_options")
    return stream, bool(options.get("include_usage"))


def parse(body: Any, chat: bool, model: Model) -> Completion:
    """Check a chat or text completion request the way OpenAI's API does; tokenize its prompt."""
    tokenizer, target = model.tokenizer, model.target
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    _refuse_unsupported(body)
    tools: list[dict[str, Any]] = []
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "messages must be a non-empty list", "messages")
        turns = [_message(m, i) for i, m in enumerate(messages)]
        tools = _tools(body)
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise APIError(400, "chat_template_kwargs must be an object", "chat_template_kwargs")
        ids = chat_ids(tokenizer, turns, tools, _thinking(body, kwargs), {**model.defaults.template_args, **kwargs},
                       "messages")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if not all(0 <= t < target.vocab_size for t in prompt):  # the embedding's rows: added tokens included
                raise APIError(400, f"prompt token ids must be from 0 to {target.vocab_size - 1}", "prompt")
        elif not isinstance(prompt, str) or not prompt:
            raise APIError(400, "prompt must be a non-empty string or a list of token ids", "prompt")
        ids = encode_prompt(tokenizer, prompt)
    max_tokens = budget(target, ids, body.get("max_completion_tokens", body.get("max_tokens")), model.defaults,
                        "max_tokens")
    stream, include_usage = _stream_options(body)
    return Completion(ids, max_tokens, sampling(body, model.defaults), stops(body.get("stop"), "stop", most=4),
                      stream, include_usage, chat, tools, _logprobs(body, chat), target.max_positions,
                      processing=processing(body, target.vocab_size))


def usage(done: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's usage object, with the cached prompt tokens and DFlash's own figures."""
    return {"prompt_tokens": done["prompt_tokens"], "completion_tokens": done["completion_tokens"],
            "total_tokens": done["prompt_tokens"] + done["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": done["cached_tokens"]}, "dflash": done["dflash"]}


def _token(tokenizer: Any, token: int, logprob: float) -> dict[str, Any]:
    text = tokenizer.decode([token])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer: Any, piece: dict[str, Any]) -> list[dict[str, Any]]:
    """``logprobs.content`` entries for a piece's tokens: each token, its log-probability and the alternatives."""
    return [_token(tokenizer, t, lp) | {"top_logprobs": [_token(tokenizer, a, alp) for a, alp in top]}
            for t, lp, top in zip(piece["tokens"], piece["logprobs"], piece["top"])]


def _head(prefix: str, model: Model) -> dict[str, Any]:
    return {"id": f"{prefix}-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": model.name}


class _Stream:
    """What chat and text answers share: chunks as data-only events, OpenAI's error and usage chunks."""

    kind = ""

    def __init__(self, completion: Completion, model: Model, prefix: str):
        self.head, self.completion, self.tokenizer = _head(prefix, model), completion, model.tokenizer

    def _usage(self, done: dict[str, Any]) -> list[Event]:
        if not self.completion.include_usage:
            return []
        return [(None, {**self.head, "object": self.kind, "choices": [], "usage": usage(done)})]

    def _chunk(self, choice: dict[str, Any]) -> Event:
        chunk = {**self.head, "object": self.kind, "choices": [choice]}
        if self.completion.include_usage:
            chunk["usage"] = None
        return None, chunk

    def failed(self, error: APIError) -> list[Event]:
        return [(None, error.body())]


class ChatAnswer(_Stream):
    """One chat completion's answer, built from the engine's pieces as they come: whole, or as chunks."""

    kind = "chat.completion.chunk"

    def __init__(self, completion: Completion, model: Model):
        super().__init__(completion, model, "chatcmpl")
        self.reply = Reply(self.tokenizer, completion.ids, completion.tools)
        self.content, self.reasoning, self.calls, self.logprobs = "", "", [], []

    def _call(self, call: ToolCall, index: int) -> dict[str, Any]:
        return {"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}

    def _deltas(self, events: list) -> list[dict[str, Any]]:
        deltas = []
        for kind, value in events:
            if kind == "tool_call":
                self.calls.append(self._call(value, len(self.calls)))
                deltas.append({"tool_calls": [self.calls[-1]]})
            elif kind == "reasoning":
                self.reasoning += value
                deltas.append({"reasoning_content": value})
            else:
                self.content += value
                deltas.append({"content": value})
        return deltas

    def _delta(self, delta: dict[str, Any], reason: Optional[str] = None, logprobs: Any = None) -> Event:
        return self._chunk({"index": 0, "delta": delta, "finish_reason": reason,
                            "logprobs": None if logprobs is None else {"content": logprobs}})

    def start(self, prompt_tokens: int, cached: int) -> list[Event]:
        return [self._delta({"role": "assistant", "content": ""})]

    def add(self, piece: dict[str, Any]) -> list[Event]:
        """Chunks for one piece of generation (its tokens' logprobs ride on the first)."""
        deltas = self._deltas(self.reply.feed(piece["text"]))
        logprobs = chat_logprobs(self.tokenizer, piece) if self.completion.logprobs is not None else None
        if logprobs:
            self.logprobs += logprobs
            deltas = deltas or [{}]
        return [self._delta(d, logprobs=logprobs if i == 0 else None) for i, d in enumerate(deltas)]

    def finish_reason(self, done: dict[str, Any]) -> str:
        return "tool_calls" if self.calls and done["finish_reason"] == "stop" else done["finish_reason"]

    def last(self, done: dict[str, Any]) -> list[Event]:
        """The chunks that end the stream: what was held back, the finish reason, the usage if asked."""
        chunks = [self._delta(d) for d in self._deltas(self.reply.finish())]
        return chunks + [self._delta({}, self.finish_reason(done))] + self._usage(done)

    def whole(self, done: dict[str, Any]) -> dict[str, Any]:
        """The non-streamed response, once every piece was added."""
        self._deltas(self.reply.finish())
        message: dict[str, Any] = {"role": "assistant", "content": self.content or (None if self.calls else "")}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.calls:
            message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in self.calls]
        logprobs = {"content": self.logprobs} if self.completion.logprobs is not None else None
        choice = {"index": 0, "message": message, "finish_reason": self.finish_reason(done), "logprobs": logprobs}
        return {**self.head, "object": "chat.completion", "choices": [choice], "usage": usage(done)}


class TextAnswer(_Stream):
    """One text completion's answer: the raw text (nothing split), and logprobs in the completions shape."""

    kind = "text_completion"

    def __init__(self, completion: Completion, model: Model):
        super().__init__(completion, model, "cmpl")
        self.text, self.offset = "", 0
        self.logprobs: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def _logprobs(self, piece: dict[str, Any]) -> Optional[dict[str, list]]:
        if self.completion.logprobs is None:
            return None
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, lp, top in zip(piece["tokens"], piece["logprobs"], piece["top"]):
            text = self.tokenizer.decode([t])
            out["tokens"].append(text)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append({self.tokenizer.decode([a]): alp for a, alp in top})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        for key, values in out.items():
            self.logprobs[key] += values
        return out

    def _text(self, text: str, reason: Optional[str] = None, logprobs: Any = None) -> Event:
        return self._chunk({"index": 0, "text": text, "finish_reason": reason, "logprobs": logprobs})

    def start(self, prompt_tokens: int, cached: int) -> list[Event]:
        return []

    def add(self, piece: dict[str, Any]) -> list[Event]:
        self.text += piece["text"]
        logprobs = self._logprobs(piece)
        return [self._text(piece["text"], logprobs=logprobs)] if piece["text"] or logprobs else []

    def last(self, done: dict[str, Any]) -> list[Event]:
        return [self._text("", done["finish_reason"])] + self._usage(done)

    def whole(self, done: dict[str, Any]) -> dict[str, Any]:
        choice = {"index": 0, "text": self.text, "finish_reason": done["finish_reason"],
                  "logprobs": self.logprobs if self.completion.logprobs is not None else None}
        return {**self.head, "object": "text_completion", "choices": [choice], "usage": usage(done)}


CHAT = Dialect(("/v1/chat/completions", "/chat/completions"), lambda body, model: parse(body, True, model),
               ChatAnswer, done="[DONE]")
TEXT = Dialect(("/v1/completions",), lambda body, model: parse(body, False, model), TextAnswer, done="[DONE]")
