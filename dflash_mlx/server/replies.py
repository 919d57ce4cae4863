"""A chat reply as a client sees it: content, reasoning and tool calls, split from the text as it streams.

The markers are the model's own (``<think>``, ``<tool_call>``, gpt-oss's channels, ...):
mlx-lm knows each family's, in its tokenizer wrapper and its ``TextStateMachine``, which
matches them on text (a marker split across tokens is still found) and holds back text
that could begin one. Tool calls are parsed by the parser mlx-lm picks from the chat
template (``tokenizer.tool_parser``). Nothing here writes a parser of its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from mlx_lm.generate import TextStateMachine, make_text_state_machine


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


# What the splitter yields: ("content", text), ("reasoning", text) or ("tool_call", ToolCall).
Event = tuple[str, Union[str, ToolCall]]


class Reply:
    """Feed it the text of a reply piece by piece; it returns what each piece adds, in order.

    ``tools`` are the tools the request offered: only then is tool-call markup parsed
    (without them, or where the model writes a call that does not parse, the markup
    stays in the content, as written). Reasoning is split whenever the tokenizer has
    think markers; a prompt that opened a think block (Qwen3.5's template does) starts
    the reply in reasoning.
    """

    def __init__(self, tokenizer: Any, prompt: Sequence[int], tools: Optional[Sequence[dict]] = None):
        self.tokenizer, self.tools = tokenizer, list(tools or [])
        initial = "normal"
        if tokenizer.has_thinking and tokenizer.rfind_think_start(list(prompt)) > tokenizer.rfind_think_end(list(prompt)):
            initial = "reasoning"
        self._state = make_text_state_machine(tokenizer).make_state(tokenizer.response_initial_state or initial)
        self._tool = ""  # the call being written
        self.tool_calls = 0  # parsed so far

    @property
    def _parse_tools(self) -> bool:
        return bool(self.tools) and self.tokenizer.tool_parser is not None

    def feed(self, text: str) -> list[Event]:
        self._state, segments = TextStateMachine.split(self._state, text)
        return self._events(segments, final=False)

    def finish(self) -> list[Event]:
        """The end of the reply: text held back (a marker that never completed) and an unterminated call."""
        self._state, held, state = TextStateMachine.flush(self._state)
        return self._events([(state, held)], final=True)

    def _events(self, segments: list[tuple[Optional[str], str]], final: bool) -> list[Event]:
        events: list[Event] = []
        for i, (state, text) in enumerate(segments):
            if state == "tool":
                self._tool += text
                if i < len(segments) - 1 or final:  # the call ended here (or the reply did)
                    events += self._call(closed=not final)
            elif text:
                kind = "reasoning" if state == "reasoning" else "content"
                if events and events[-1][0] == kind:
                    events[-1] = (kind, events[-1][1] + text)
                else:
                    events.append((kind, text))
        return events

    def _call(self, closed: bool) -> list[Event]:
        """The tool call just written, parsed; as text when it does not parse (or no tool was offered)."""
        text, self._tool = self._tool, ""
        calls = _parse(self.tokenizer, text, self.tools) if self._parse_tools else None
        if calls is None:
            end = self.tokenizer.tool_call_end if closed else ""
            return [("content", f"{self.tokenizer.tool_call_start}{text}{end or ''}")]
        self.tool_calls += len(calls)
        return [("tool_call", call) for call in calls]


def _parse(tokenizer: Any, text: str, tools: list[dict]) -> Optional[list[ToolCall]]:
    """The calls in ``text`` by the model's own tool parser; None when it does not parse into named calls."""
    try:
        parsed = tokenizer.tool_parser(text, tools)
    except Exception:  # noqa: BLE001 (each parser fails its own way on malformed text: a reply, never a 500)
        return None
    calls = []
    for call in parsed if isinstance(parsed, list) else [parsed]:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                return None
        if not isinstance(arguments, dict):
            return None
        calls.append(ToolCall(call["name"], arguments))
    return calls or None
