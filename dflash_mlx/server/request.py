"""What a request asks for, whichever API it came through, and what every API's answer is built from.

Each dialect module (``openai_api``, ``anthropic_api``, ``responses_api``) checks its
request bodies and turns them into a ``Completion``; the engine runs it and does not care
where it came from. The dialect's ``Answer`` shapes the engine's pieces for its clients,
whole or as server-sent events; ``Dialect`` names its routes, so a new API is one module.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

from mlx_lm.sample_utils import make_logits_processors

from ..chat_template import fold_system, has_chat_template, render
from ..decode.generate import check_context
from ..decode.settings import RequestSettings
from ..decode.stops import stop_list
from ..errors import DFlashError
from ..sampling import Sampling
from .replies import Reply, ToolCall

TOP_LOGPROBS = 20  # the most alternatives per token a request may ask for (OpenAI's limit)
MAX_NESTING = 64  # levels of arrays and objects a body may nest (tool schemas take a handful)
TEXT_ONLY = "this model reads text only"  # how every dialect refuses an image, audio or file part

# A server-sent event: its ``event:`` name (None: a data line only, as OpenAI's chat chunks) and its data.
Event = tuple[Optional[str], dict[str, Any]]


class APIError(Exception):
    """A refused request: HTTP status, message, the field at fault, a code and the error's type."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        """OpenAI's error shape."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Completion:
    """A checked request, tokenized: what the engine runs and how the answer is to be shaped."""

    ids: list[int]
    max_tokens: int
    sampling: dict[str, Any]
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    chat: bool = False  # a conversation: its reply is split into content, reasoning and tool calls
    tools: list[dict[str, Any]] = field(default_factory=list)  # offered, in OpenAI's shape: parse calls to them
    logprobs: Optional[int] = None  # alternatives per token to report (0: the token's own only); None: none
    context: Optional[int] = None  # the model's positions: a reply that reaches them ran out of context
    shape: dict[str, Any] = field(default_factory=dict)  # the dialect's own settings for its answer
    processing: dict[str, Any] = field(default_factory=dict)  # mlx-lm's logits processors' settings (``processing``)

    # What travels to the other ranks of a sharded target: what decides the tokens.
    SHARED = ("ids", "max_tokens", "sampling", "stop", "logprobs", "processing")

    def settings(self) -> RequestSettings:
        """What a generation takes of this request: its budget, sampling, stops, logprobs, and mlx-lm's logits
        processors made from its settings (a logit bias's token ids are strings once they have travelled as JSON)."""
        processors: list[Any] = []
        if self.processing:
            spec = dict(self.processing)
            if "logit_bias" in spec:
                spec["logit_bias"] = {int(k): v for k, v in spec["logit_bias"].items()}
            processors = make_logits_processors(**spec)
        return RequestSettings(self.max_tokens, Sampling(**self.sampling), stop_list(self.stop), self.logprobs,
                               tuple(processors))

    def shared(self) -> bytes:
        return json.dumps({k: getattr(self, k) for k in self.SHARED}).encode()

    @classmethod
    def from_shared(cls, data: bytes) -> "Completion":
        return cls(**json.loads(data))

    def context_full(self, done: dict[str, Any]) -> bool:
        """Whether a reply cut by its budget stopped because the model's positions ran out."""
        return (done["finish_reason"] == "length" and self.context is not None
                and done["prompt_tokens"] + done["completion_tokens"] >= self.context)


@dataclass(frozen=True)
class Defaults:
    """What a request that leaves a setting out gets (``serve --temp``, ``--max-tokens``, ...), as mlx-lm's server."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 4096
    template_args: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs that requests add to or override


class Model(Protocol):
    """What a dialect reads of the loaded model (the engine is one)."""

    tokenizer: Any
    target: Any
    defaults: Defaults
    name: str


class Answer(Protocol):
    """One request's answer, built from the engine's pieces as they come: whole, or as events to stream."""

    def start(self, prompt_tokens: int, cached: int) -> list[Event]: ...  # once the engine takes the request
    def add(self, piece: dict[str, Any]) -> list[Event]: ...
    def last(self, done: dict[str, Any]) -> list[Event]: ...
    def whole(self, done: dict[str, Any]) -> dict[str, Any]: ...
    def failed(self, error: APIError) -> list[Event]: ...


@dataclass(frozen=True)
class Dialect:
    """One API: its routes, how a body becomes a ``Completion``, and how its answers and errors look.

    ``keepalive`` is what a stream carries while the request waits or prefills (clients
    drop a stream silent for minutes); ``done`` ends a stream (OpenAI's ``[DONE]``).
    ``refuse_in_stream`` answers a refused streamed request as a stream whose events say
    why (the Responses API's ``response.failed``, which Codex acts on) instead of an
    HTTP error.
    """

    paths: tuple[str, ...]
    parse: Callable[[Any, Model], Completion]
    answer: Callable[[Completion, Model], Answer]
    error_body: Callable[[APIError], dict[str, Any]] = APIError.body
    keepalive: str = ": keepalive\n\n"
    done: Optional[str] = None
    refuse_in_stream: Optional[Callable[[APIError, Model], list[Event]]] = None


def sse(event: Event) -> str:
    name, data = event
    return (f"event: {name}\n" if name else "") + f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def read_body(raw: bytes) -> Any:
    """A request body as JSON; NaN, Infinity and numbers beyond a float's range are refused (400, not a 500)."""
    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not a JSON number")

    nested = APIError(400, f"the request body nests deeper than {MAX_NESTING} levels")
    try:
        body = json.loads(raw, parse_constant=refuse)
    except RecursionError:
        raise nested from None
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})") from None
    stack = [(body, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_NESTING:  # what the templates and tool parsers walk recursively must stay shallow
            raise nested
        if isinstance(value, float) and not math.isfinite(value):
            raise APIError(400, "the request body has a number beyond a float's range")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
    return body


def number(body: dict, name: str, default: Any, kind: type, low: float, high: float) -> Any:
    """``body[name]`` as ``kind`` within [low, high]; ``default`` when absent or null."""
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise APIError(400, f"{name} must be {'an integer' if kind is int else 'a number'}", name)
    if not low <= value <= high:
        raise APIError(400, f"{name} must be between {low} and {high}, got {value}", name)
    return kind(value)


def checked(make: Callable[[], Any], param: Optional[str], code: Optional[str] = None) -> Any:
    """``make()``, with the library's one-line DFlashError as an HTTP 400 naming ``param``."""
    try:
        return make()
    except DFlashError as e:
        raise APIError(400, str(e), param, code) from None


def flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise APIError(400, f"{name} must be true or false", name)
    return value


def sampling(body: dict, defaults: Defaults, top_p_name: str = "top_p") -> dict[str, Any]:
    """Temperature, top-p/k, min-p and seed, each from the request or the server's default."""
    settings = {
        "temperature": number(body, "temperature", defaults.temperature, float, 0.0, 2.0),
        "top_p": number(body, top_p_name, defaults.top_p, float, 0.0, 1.0),
        "top_k": number(body, "top_k", defaults.top_k, int, 0, 2**31),
        "min_p": number(body, "min_p", defaults.min_p, float, 0.0, 1.0),
        "seed": body.get("seed"),
    }
    if settings["top_p"] == 0.0:
        raise APIError(400, f"{top_p_name} must be above 0", top_p_name)
    checked(lambda: Sampling(**settings), "seed")  # the one check that number() does not make
    return settings


# mlx-lm's server's fields for its logits processors (make_logits_processors' arguments): (kind, low, high).
PROCESSING = {
    "repetition_penalty": (float, 0.0, 1e6), "repetition_context_size": (int, 0, 2**31),
    "presence_penalty": (float, -1e6, 1e6), "presence_context_size": (int, 0, 2**31),
    "frequency_penalty": (float, -1e6, 1e6), "frequency_context_size": (int, 0, 2**31),
}


def processing(body: dict, vocab_size: int) -> dict[str, Any]:
    """Penalties and logit bias as mlx-lm's server reads them, checked: each applied at every verified position."""
    settings = {name: number(body, name, None, *spec) for name, spec in PROCESSING.items() if body.get(name) is not None}
    bias = body.get("logit_bias")
    if bias:
        if not isinstance(bias, dict):
            raise APIError(400, "logit_bias must map token ids to numbers", "logit_bias")
        try:
            settings["logit_bias"] = {int(k): float(v) for k, v in bias.items()}
        except (TypeError, ValueError):
            raise APIError(400, "logit_bias must map token ids to numbers", "logit_bias") from None
        for token, value in settings["logit_bias"].items():
            if not 0 <= token < vocab_size:
                raise APIError(400, f"logit_bias: token {token} is outside the vocabulary (0-{vocab_size - 1})",
                               "logit_bias")
            if not -100 <= value <= 100:
                raise APIError(400, f"logit_bias: {value} for token {token} is outside -100 to 100", "logit_bias")
    return settings


def stops(value: Any, param: str, most: Optional[int] = None) -> list[str]:
    found = checked(lambda: list(stop_list(value)), param)
    if most is not None and len(found) > most:
        raise APIError(400, f"{param} takes up to {most} strings", param)
    return found


def tool_choice(choice: Any, tools: list[dict[str, Any]], param: str = "tool_choice") -> list[dict[str, Any]]:
    """The tools offered under a tool choice, in any dialect's spelling (already reduced to a kind).

    "none" offers none; every other choice ("auto", "required"/"any", a named tool) offers
    them all and leaves the choice to the model: nothing constrains decoding to a call.
    """
    if choice not in ("auto", "none", "required", "named"):
        raise APIError(400, f"{param} must be auto, none, required or a named tool", param)
    return [] if choice == "none" else tools


def chat_ids(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]], thinking: Optional[bool],
             template_kwargs: dict[str, Any], param: str) -> list[int]:
    """The conversation through the model's chat template (tools and thinking switch included).

    A system message after the first turn (Claude Code's environment block, an editor's
    mid-conversation instruction) is rendered as the template renders it; a template that
    refuses one (Qwen3.5's allows a system turn only first) gets it folded into the
    neighbouring user turn instead.
    """
    if not has_chat_template(tokenizer):
        raise APIError(400, "this model has no chat template: use /v1/completions, or start the server with "
                            "--chat-template FILE", param)

    def ids(turns: list[dict[str, Any]]) -> list[int]:
        return render(tokenizer, turns, tools=tools or None, thinking=thinking, template_kwargs=template_kwargs)

    try:
        return ids(messages)
    except DFlashError as e:
        folded = fold_system(messages)
        if folded == messages:
            raise APIError(400, str(e), param) from None
        return checked(lambda: ids(folded), param)


def too_long(prompt_tokens: int, limit: int) -> APIError:
    """A prompt that leaves no position to answer in, in the words clients act on.

    Claude Code compacts its conversation on "prompt is too long: N tokens > M maximum";
    OpenAI's clients read the code ``context_length_exceeded``.
    """
    return APIError(400, f"prompt is too long: {prompt_tokens} tokens > {limit - 1} maximum (this model takes "
                         f"{limit} positions, the reply at least one)", "messages", "context_length_exceeded")


MAX_REPLY = 2**31 - 1  # the most tokens a request may ask for: more than any context holds


def budget(target: Any, ids: list[int], requested: Any, defaults: Defaults, param: str) -> int:
    """The token budget: the request's, or the server's default, clamped to the positions the prompt leaves.

    Agents ask for more than a local model holds (Claude Code 128,000, Qwen Code 32,000):
    the reply stops where the context ends instead of being refused up front. A number no
    context holds (beyond 2^31 - 1 tokens) is refused.
    """
    if target.max_positions is not None and len(ids) >= target.max_positions:
        raise too_long(len(ids), target.max_positions)
    wanted = number({param: requested}, param, defaults.max_tokens, int, 1, MAX_REPLY)
    return check_context(target.max_positions, len(ids), wanted)  # the library's one rule: stop where the context ends


def text_only(part: Any, where: str) -> None:
    """Refuse a content part that is not text (an image, audio, a file) in one line."""
    kind = part.get("type") if isinstance(part, dict) else None
    raise APIError(400, f"{where}: {TEXT_ONLY}; {kind!r} parts are not supported", where.split("[")[0].split(".")[0])


def thinking_from_effort(effort: Any, param: str) -> Optional[bool]:
    """OpenAI's reasoning effort as a template's thinking switch: "none" and "minimal" switch it off."""
    if effort is None:
        return None
    if effort not in ("none", "minimal", "low", "medium", "high", "xhigh"):
        raise APIError(400, f"{param} must be none, minimal, low, medium, high or xhigh", param)
    return effort not in ("none", "minimal")


class Blocks:
    """A reply as a sequence of blocks (reasoning, text, tool calls), a new one wherever the kind changes.

    Anthropic's content blocks and the Responses API's output items are both this; a
    subclass says what opening, extending and closing a block, and a call, look like.
    """

    def __init__(self, tokenizer: Any, completion: Completion):
        self.reply = Reply(tokenizer, completion.ids, completion.tools)
        self.open: Optional[str] = None  # "reasoning" or "content": the block being written
        self.count = 0  # blocks started so far (the index of the next)

    def feed(self, events: Sequence[tuple[str, Any]]) -> list[Event]:
        out: list[Event] = []
        for kind, value in events:
            if kind == "tool_call":
                out += self.close() + self.call(value)
                self.count += 1
                continue
            if self.open != kind:
                out += self.close() + self.begin(kind)
                self.open = kind
            out += self.extend(kind, value)
        return out

    def close(self) -> list[Event]:
        if self.open is None:
            return []
        kind, self.open = self.open, None
        events = self.end(kind)
        self.count += 1
        return events

    def add(self, piece: dict[str, Any]) -> list[Event]:
        return self.feed(self.reply.feed(piece["text"]))

    def finish(self) -> list[Event]:
        """What the reply held back, and the last block closed."""
        return self.feed(self.reply.finish()) + self.close()

    def begin(self, kind: str) -> list[Event]:
        raise NotImplementedError

    def extend(self, kind: str, text: str) -> list[Event]:
        raise NotImplementedError

    def end(self, kind: str) -> list[Event]:
        raise NotImplementedError

    def call(self, call: ToolCall) -> list[Event]:
        raise NotImplementedError
