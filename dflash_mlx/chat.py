"""Multi-turn chat over one set of caches: each turn prefills only its new tokens."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from .errors import DFlashError
from .generate import GenerationResponse, GenerationResult, generate, make_cache


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
        """Answer one user message. Ctrl-C keeps the partial reply in the history and re-raises."""
        self.messages.append({"role": "user", "content": text})
        partial: list[str] = []

        def collect(response: GenerationResponse) -> None:
            partial.append(response.text)
            if on_response is not None:
                on_response(response)

        prompt = self._prompt()
        try:
            self.last = generate(
                self.target, self.drafter, self.tokenizer, prompt, on_response=collect,
                block_size=self.block_size, window=self.window, sinks=self.sinks, cache=self.cache, **self.options,
            )
        except KeyboardInterrupt:
            # The caches may hold an unverified block: start them afresh, keep the words.
            self.messages.append({"role": "assistant", "content": "".join(partial)})
            self.cache = make_cache(self.target, self.drafter, self.window, self.sinks, self.block_size)
            self.ids = None
            raise
        except BaseException:
            self.messages.pop()
            raise
        self.messages.append({"role": "assistant", "content": self.last.text})
        self.ids = prompt + self.last.tokens
        return self.last

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
        target = Path(path).expanduser()
        tmp = target.with_name(f".{target.name}.tmp")
        try:
            tmp.write_text(json.dumps({"system": self.system, "messages": self.messages}, indent=1))
            tmp.replace(target)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise DFlashError(f"cannot save to {target}: {e.strerror or e}") from None

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
