"""What a request to the server asks for, whichever API it came through (OpenAI's or Anthropic's).

``openai_api`` and ``anthropic_api`` check their request bodies and turn them into a
``Completion``; the server's engine runs it and does not care where it came from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .chat_template import has_chat_template, render
from .errors import DFlashError
from .generate import check_context
from .sampling import Sampling
from .stops import stop_list

TOP_LOGPROBS = 20  # the most alternatives per token a request may ask for (OpenAI's limit)


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

    # What travels to the other ranks of a sharded target: what decides the tokens.
    SHARED = ("ids", "max_tokens", "sampling", "stop", "logprobs")

    def shared(self) -> bytes:
        return json.dumps({k: getattr(self, k) for k in self.SHARED}).encode()

    @classmethod
    def from_shared(cls, data: bytes) -> "Completion":
        return cls(**json.loads(data))


@dataclass(frozen=True)
class Defaults:
    """What a request that leaves a setting out gets (``serve --temp``, ``--max-tokens``, ...), as mlx-lm's server."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 4096


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


def stops(value: Any, param: str, most: Optional[int] = None) -> list[str]:
    found = checked(lambda: list(stop_list(value)), param)
    if most is not None and len(found) > most:
        raise APIError(400, f"{param} takes up to {most} strings", param)
    return found


def chat_ids(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]], thinking: Optional[bool],
             template_kwargs: dict[str, Any], param: str) -> list[int]:
    """The conversation through the model's chat template (tools and thinking switch included)."""
    if not has_chat_template(tokenizer):
        raise APIError(400, "this model has no chat template: use /v1/completions, or start the server with "
                            "--chat-template FILE", param)
    return checked(lambda: render(tokenizer, messages, tools=tools or None, thinking=thinking,
                                  template_kwargs=template_kwargs), param)


def budget(target: Any, ids: list[int], requested: Any, defaults: Defaults, param: str, where: str) -> int:
    """The token budget: the request's, or the server's default; never past the model's positions."""
    limit = target.max_positions or 2**31
    checked(lambda: check_context(limit, len(ids), 1), where, "context_length_exceeded")
    return number({param: requested}, param, min(defaults.max_tokens, limit - len(ids)), int, 1, limit - len(ids))
