"""Multi-turn chat over one set of caches: each turn prefills only its new tokens.

``ChatSession`` is the conversation; ``run_command`` carries out the chat's slash
commands on it (the CLI only reads lines and prints).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from rich.console import Console
from rich.markup import escape

from .caches import make_cache
from .errors import DFlashError
from .files import write_atomic
from .generate import GenerationResponse, GenerationResult, generate


@dataclass
class ChatSession:
    """A conversation with a loaded pair; the target, drafter and feature caches carry over turns."""

    target: Any
    drafter: Any
    tokenizer: Any
    system: Optional[str] = None
    think: Optional[bool] = None  # the chat template's thinking switch; None: the template's default
    window: Optional[int] = None
    sinks: int = 0
    block_size: Optional[int] = None
    options: dict[str, Any] = field(default_factory=dict)  # max_tokens, temperature, ... for generate()
    messages: list[dict[str, str]] = field(default_factory=list)
    last: Optional[GenerationResult] = None

    def __post_init__(self) -> None:
        if not getattr(self.tokenizer, "has_chat_template", False):
            raise DFlashError("the target's tokenizer has no chat template, so it cannot chat; "
                              "use `dflash-mlx generate --no-chat-template` for raw text")
        self.cache = make_cache(self.target, self.drafter, self.window, self.sinks, self.block_size)
        self.ids: Optional[list[int]] = None  # the conversation as the model saw and wrote it

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        system = [{"role": "system", "content": self.system}] if self.system else []
        kwargs = {} if self.think is None else {"enable_thinking": self.think}
        return self.tokenizer.apply_chat_template(
            system + messages, add_generation_prompt=generation_prompt, tokenize=False, **kwargs
        )

    def _prompt(self) -> list[int]:
        """Token ids for the next reply: the previous turns' own ids plus only the new part.

        Re-rendering the history as text would not give back the generated ids (text
        does not re-tokenize to the same ids, templates drop thinking from old turns),
        and the caches could then not be reused. So the new turn is appended to the ids
        the model already holds: the template's end-of-turn text after the last reply,
        then the new message and the generation prompt, as the template renders them.
        """
        def encode(text: str) -> list[int]:
            return self.tokenizer.encode(text, add_special_tokens=False)

        full = self._render(self.messages, generation_prompt=True)
        history, reply = self.messages[:-1], self.messages[-2]["content"] if len(self.messages) > 1 else ""
        if self.ids is not None and reply:
            before = self._render(history, generation_prompt=False)
            end = before.rfind(reply)
            if end >= 0 and full.startswith(before):
                return self.ids + encode(before[end + len(reply) :] + full[len(before) :])
        return encode(full)

    def reply(self, text: str, on_response: Optional[Callable[[GenerationResponse], None]] = None) -> GenerationResult:
        """Answer one user message.

        However the reply ends early, the caches stay valid (the generator abandons
        its cycle in flight). Ctrl-C keeps the partial reply in the history, so the
        next turn goes on from it and reuses the caches; any other error drops the
        message and re-raises.
        """
        self.messages.append({"role": "user", "content": text})
        partial_text: list[str] = []
        partial_tokens: list[int] = []

        def collect(response: GenerationResponse) -> None:
            partial_text.append(response.text)
            partial_tokens.extend(response.tokens)
            if on_response is not None:
                on_response(response)

        prompt = self._prompt()
        try:
            self.last = generate(
                self.target, self.drafter, self.tokenizer, prompt, on_response=collect,
                block_size=self.block_size, window=self.window, sinks=self.sinks, cache=self.cache, **self.options,
            )
        except KeyboardInterrupt:
            self.ids = self._interrupted_history(prompt, partial_tokens)
            reply = self.tokenizer.decode(self.ids[len(prompt) :]) if self.ids != prompt + partial_tokens else None
            self.messages.append({"role": "assistant", "content": reply or "".join(partial_text)})
            raise
        except BaseException:
            self.messages.pop()
            raise
        self.messages.append({"role": "assistant", "content": self.last.text})
        self.ids = prompt + self.last.tokens
        return self.last

    def _interrupted_history(self, prompt: list[int], received: list[int]) -> list[int]:
        """The conversation's ids after Ctrl-C: what was shown, or what the caches committed if that is more.

        A Ctrl-C that lands between a cycle's commit and its delivery leaves up to a
        block of committed tokens that were never shown. They are the model's own
        reply, so the conversation keeps them and the caches stay reusable.
        """
        shown, committed = prompt + received, self.cache.tokens
        if len(committed) > len(shown) and committed[: len(shown)] == shown:
            return list(committed)
        return shown

    @property
    def context_tokens(self) -> int:
        return len(self.cache.tokens)

    def reset(self) -> None:
        self.messages.clear()
        self.last = None
        self.ids = None
        self.cache = make_cache(self.target, self.drafter, self.window, self.sinks, self.block_size)

    def save(self, path: str) -> None:
        """The conversation as JSON (system prompt and messages), written atomically."""
        write_atomic(path, json.dumps({"system": self.system, "messages": self.messages}, indent=1))

    def load(self, path: str) -> None:
        source = Path(path).expanduser()
        try:
            data = json.loads(source.read_text())
            messages = data["messages"]
            if not all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in messages):
                raise ValueError("every message needs a role and a content")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DFlashError(f"cannot load conversation {source}: {e}") from None
        self.reset()
        self.system = data.get("system")
        self.messages = list(messages)


HELP = """commands:
  /reset          forget the conversation
  /system TEXT    set the system prompt (and reset)
  /stats          statistics of the last reply
  /save FILE      save the conversation as JSON
  /load FILE      load a conversation saved with /save
  /quit           leave (also Ctrl-D; Ctrl-C twice at an empty prompt)
  /help           this list"""


def stats_line(session: ChatSession) -> str:
    r = session.last
    assert r is not None
    context = f"{session.context_tokens}" + (f" (window {session.window})" if session.window else "")
    return (f"{r.generation_tps:.1f} tok/s | tau {r.tau:.2f} | accepted {100 * r.acceptance_rate:.0f}% | "
            f"context {context} tok | prefilled {r.prompt_tokens - r.prompt_cached} tok")


def run_command(session: ChatSession, line: str, out: Console) -> bool:
    """Carry out one slash command, printing its outcome; False when it asks to leave."""
    command, _, arg = line.partition(" ")
    arg = arg.strip()
    if command == "/quit":
        return False
    if command == "/help":
        out.print(HELP)
    elif command == "/reset":
        session.reset()
        out.print("[dim]conversation reset[/]")
    elif command == "/system":
        session.system = arg or None
        session.reset()
        out.print("[dim]system prompt set; conversation reset[/]")
    elif command == "/stats":
        out.print(stats_line(session) if session.last else "[dim]no reply yet[/]")
    elif command in ("/save", "/load"):
        if not arg:
            out.print(f"[red]usage: {command} FILE[/]")
            return True
        try:
            session.save(arg) if command == "/save" else session.load(arg)
            out.print(f"[dim]{'saved to' if command == '/save' else 'loaded'} {escape(arg)} "
                      f"({len(session.messages)} messages)[/]")
        except DFlashError as e:
            out.print(f"[red]error:[/] {escape(str(e))}")
    else:
        out.print(f"[red]unknown command {escape(command)}[/]; /help lists them")
    return True
