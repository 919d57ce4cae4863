"""Multi-turn chat over one set of caches: each turn prefills only its new tokens.

``ChatSession`` is the conversation; ``run_command`` carries out the chat's slash
commands on it (the CLI only reads lines and prints).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from rich.console import Console
from rich.markup import escape

from .. import distributed
from ..chat_template import has_chat_template, render
from ..errors import DFlashError
from ..files import write_atomic
from .cache_files import cache_file, fingerprint, read_state, write_state
from .generate import INTERRUPTED, run, setup
from .responses import GenerationResponse, GenerationResult
from .settings import DecodeSettings, RequestSettings
from .transaction import DFlashCache

HISTORY = Path("~/.cache/dflash-mlx/chat_history")  # typed lines, recalled with Up in later chats
HISTORY_LENGTH = 1000
REPLY_MARKER = "\u27e6dflash-mlx reply\u27e7"  # stands in for the last reply when rendering what follows it


@dataclass
class ChatSession:
    """A conversation with a loaded pair; the target, drafter and feature caches carry over turns."""

    target: Any
    drafter: Any
    tokenizer: Any
    system: Optional[str] = None
    think: Optional[bool] = None  # the chat template's thinking switch; None: the template's default
    decoding: DecodeSettings = DecodeSettings()
    asked: RequestSettings = RequestSettings()  # every reply's budget, sampling, stops, ...
    template_args: dict[str, Any] = field(default_factory=dict)  # keyword arguments for the chat template
    messages: list[dict[str, str]] = field(default_factory=list)
    last: Optional[GenerationResult] = None
    replies: list[GenerationResult] = field(default_factory=list)  # this conversation's, for its totals

    def __post_init__(self) -> None:
        if not has_chat_template(self.tokenizer):
            raise DFlashError("the target's tokenizer has no chat template, so it cannot chat: give one with "
                              "--chat-template FILE, or use `dflash-mlx generate --no-chat-template` for raw text")
        self.reset_caches()

    @property
    def window(self) -> Optional[int]:
        return self.decoding.layout.window

    def _render(self, messages: list[dict[str, str]]) -> str:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return render(self.tokenizer, system + messages, thinking=self.think, tokenize=False,
                      template_kwargs=self.template_args)

    def _prompt(self) -> list[int]:
        """Token ids for the next reply: the previous turns' own ids plus only the new part.

        Re-rendering the history as text would not give back the generated ids (text
        does not re-tokenize to the same ids, templates drop thinking from old turns),
        and the caches could then not be reused. So the new turn is appended to the ids
        the model already holds: what the template writes after the last reply (its
        end-of-turn text, the new message, the generation prompt), found by rendering
        the history with a marker in place of that reply. Searching for the reply's
        own text instead finds it inside the template's text when it is short ("\n").
        """
        def encode(text: str) -> list[int]:
            return self.tokenizer.encode(text, add_special_tokens=False)

        if self.ids is not None and len(self.messages) > 1:
            marked = self.messages[:-2] + [dict(self.messages[-2], content=REPLY_MARKER), self.messages[-1]]
            text = self._render(marked)
            if text.count(REPLY_MARKER) == 1:
                return self.ids + encode(text.split(REPLY_MARKER)[1])
        return encode(self._render(self.messages))

    def reply(self, text: str, on_response: Optional[Callable[[GenerationResponse], None]] = None) -> GenerationResult:
        """Answer one user message.

        However the reply ends early, the caches stay valid (the generator abandons
        its cycle in flight). Ctrl-C keeps the partial reply in the history, so the
        next turn goes on from it and reuses the caches, and its figures in ``last``
        (finish_reason "interrupted"; None when no token came yet); any other error
        drops the message and re-raises.
        """
        self.messages.append({"role": "user", "content": text})
        responses: list[GenerationResponse] = []

        def collect(response: GenerationResponse) -> None:
            responses.append(response)
            if on_response is not None:
                on_response(response)

        prompt = self._prompt()
        limit = self.target.max_positions
        if limit is not None and len(prompt) >= limit and len(self.messages) > 1:  # alone, generate says it is too long
            self.messages.pop()
            raise DFlashError(f"the conversation, with this message, holds {len(prompt)} tokens and the model "
                              f"{limit} positions: /reset starts a new one (/save keeps this one first)")
        try:
            request = setup(self.target, self.drafter, self.tokenizer, prompt, self.decoding, self.asked,
                            cache=self.cache)
            for response in run(request, self.target):
                collect(response)
            self.last = GenerationResult.from_responses(responses)
        except KeyboardInterrupt:
            self.last = _cut_short(responses)
            if self.last is not None:
                self.replies.append(self.last)
            received = [t for r in responses for t in r.tokens]
            self.ids = self._interrupted_history(prompt, received)
            reply = self.tokenizer.decode(self.ids[len(prompt) :]) if self.ids != prompt + received else None
            self.messages.append({"role": "assistant", "content": reply or "".join(r.text for r in responses)})
            raise
        except BaseException:
            self.messages.pop()
            raise
        self.messages.append({"role": "assistant", "content": self.last.text})
        self.ids = prompt + self.last.tokens
        self.replies.append(self.last)
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
        self.replies.clear()
        self.last = None
        self.reset_caches()

    def _conversation(self) -> str:
        return json.dumps({"system": self.system, "messages": self.messages}, indent=1)

    def _fingerprint(self) -> str:
        return fingerprint(self.target, self.drafter, self.cache.layout)

    def save(self, path: str) -> str:
        """The conversation as JSON (system prompt and messages), and beside it its caches; what was saved.

        Both are written atomically. With the caches, ``load`` resumes the conversation
        prefilling only the next message; a conversation saved without them (no reply
        yet, a sharded target) reloads with its history prefilled.
        """
        conversation = self._conversation()
        write_atomic(path, conversation)
        caches = cache_file(Path(path).expanduser())
        if self.ids is None or self.target.group is not None or not self.cache.tokens:
            caches.unlink(missing_ok=True)  # never leave an older conversation's caches beside this one
            return f"{len(self.messages)} messages"
        extra = {"ids": self.ids, "conversation": hashlib.sha256(conversation.encode()).hexdigest()}
        try:
            write_state(caches, self.cache.snapshot(), self._fingerprint(), extra)
        except (OSError, DFlashError) as e:
            caches.unlink(missing_ok=True)
            return f"{len(self.messages)} messages; caches not saved: {getattr(e, 'strerror', None) or e}"
        return f"{len(self.messages)} messages, caches beside it"

    def load(self, path: str) -> str:
        """Replace the conversation with one written by /save (and its caches if they are there); what was loaded.

        A bad conversation file says why and changes nothing; caches that cannot be used
        (another model, a damaged file, an edited conversation) only cost a prefill.
        """
        source = Path(path).expanduser()

        def bad(why: str) -> DFlashError:
            return DFlashError(f"cannot load conversation {source}: {why}")

        try:
            data = json.loads(source.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise bad("no such file") from None
        except IsADirectoryError:
            raise bad("it is a folder; give the file /save wrote") from None
        except OSError as e:
            raise bad(e.strerror or str(e)) from None
        except UnicodeDecodeError:
            raise bad("not a text file; give the JSON file /save wrote") from None
        except json.JSONDecodeError as e:
            raise bad(f"not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
        messages = data.get("messages") if isinstance(data, dict) else None
        if not isinstance(messages, list):
            raise bad('JSON, but not a conversation: expected an object with a "messages" list, as /save writes')
        for n, m in enumerate(messages, 1):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise bad(f'message {n} is not {{"role": TEXT, "content": TEXT}}')
        if not isinstance(data.get("system"), (str, type(None))):
            raise bad('"system" must be text or null')
        self.reset()
        self.system = data.get("system")
        self.messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        return f"{len(self.messages)} messages{self._restore(source)}"

    def _restore(self, source: Path) -> str:
        """The saved conversation's caches, if they were saved with it, by this pair, and it is unchanged since."""
        caches = cache_file(source)
        if not caches.is_file() or self.target.group is not None:
            return ""
        try:
            state, extra = read_state(caches, self._fingerprint())
            if extra.get("conversation") != hashlib.sha256(self._conversation().encode()).hexdigest():
                raise ValueError("the conversation was edited since")
            self.cache.restore(state)
        except (OSError, ValueError, DFlashError) as e:
            self.reset_caches()
            return f"; its caches not used: {e}"
        self.ids = list(extra["ids"])
        return ", caches restored"

    def reset_caches(self) -> None:
        self.ids: Optional[list[int]] = None  # the conversation as the model saw and wrote it
        self.cache = DFlashCache.empty(self.target, self.drafter, self.decoding.layout)


def _cut_short(responses: list[GenerationResponse]) -> Optional[GenerationResult]:
    """The figures of a reply Ctrl-C stopped, as generate() gives them for a whole one (None: no token yet)."""
    return GenerationResult.from_responses(responses, INTERRUPTED) if responses else None


@contextlib.contextmanager
def line_editing() -> Iterator[None]:
    """Arrow keys, line editing and history (this chat's lines and earlier chats') for input().

    Importing readline is what gives input() all this; some platforms lack the module,
    and the chat then reads plain lines. The history file is a convenience: failing to
    read or write it (no home folder, a read-only disk) never disturbs the chat.
    """
    try:
        import readline
    except ImportError:
        yield
        return
    readline.set_history_length(HISTORY_LENGTH)
    with contextlib.suppress(OSError, RuntimeError):  # RuntimeError: no home folder to expand ~ to
        readline.read_history_file(HISTORY.expanduser())
    try:
        yield
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            HISTORY.expanduser().parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(HISTORY.expanduser())


HELP = """commands:
  /reset          forget the conversation
  /system TEXT    set the system prompt (and reset)
  /stats          totals of this conversation
  /save FILE      save the conversation as JSON
  /load FILE      load a conversation saved with /save
  /quit, /exit    leave (also Ctrl-D; Ctrl-C twice at an empty prompt)
  /help           this list"""


def stats_line(session: ChatSession) -> str:
    """The last reply's figures on one line (plain text); a reply Ctrl-C stopped says so and how far it got."""
    r = session.last
    assert r is not None
    context = f"{session.context_tokens}" + (f" (window {session.window})" if session.window else "")
    stopped = f"interrupted after {len(r.tokens)} tok | " if r.finish_reason == INTERRUPTED else ""
    limit = session.target.max_positions
    full = (f" | the conversation fills the model's {limit} positions: /reset to start over"
            if r.finish_reason == "length" and limit is not None and len(session.ids or ()) >= limit else "")
    return (f"{stopped}{r.generation_tps:.1f} tok/s | tau {r.tau:.2f} | accepted {100 * r.acceptance_rate:.0f}% | "
            f"context {context} tok | prefilled {r.prompt_tokens - r.prompt_cached} tok{full}")


def totals_line(session: ChatSession) -> str:
    """The conversation's figures on one line: every reply's tokens, cycles and time together."""
    replies = session.replies
    tokens = sum(r.generation_tokens for r in replies)
    seconds = sum((r.generation_tokens - 1) / r.generation_tps for r in replies if r.generation_tps > 0)
    steps = sum(r.generation_tokens - 1 for r in replies if r.generation_tps > 0)
    cycles = sum(r.cycles for r in replies)
    tau = sum(a + 1 for r in replies for a in r.acceptance) / cycles if cycles else 0.0
    drafted = sum(sum(r.drafted) for r in replies)
    accepted = 100 * sum(sum(r.acceptance) for r in replies) / drafted if drafted else 0.0
    prefilled = sum(r.prompt_tokens - r.prompt_cached for r in replies)
    context = f"{session.context_tokens}" + (f" (window {session.window})" if session.window else "")
    return (f"{len(replies)} {'reply' if len(replies) == 1 else 'replies'}, {tokens} tok @ "
            f"{steps / seconds if seconds else 0.0:.1f} tok/s | tau {tau:.2f} | accepted {accepted:.0f}% | "
            f"context {context} tok | prefilled {prefilled} tok in all")


def run_command(session: ChatSession, line: str, out: Console) -> bool:
    """Carry out one slash command, printing its outcome; False when it asks to leave."""
    command, _, arg = line.partition(" ")
    arg = arg.strip()
    if command in ("/quit", "/exit"):
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
        out.print(escape(totals_line(session)) if session.replies else "[dim]no reply yet[/]", soft_wrap=True)
    elif command in ("/save", "/load"):
        if not arg:
            out.print(f"[red]usage: {command} FILE[/]")
            return True
        if command == "/save" and not distributed.is_main():  # one file, from rank 0
            return True
        try:
            what = session.save(arg) if command == "/save" else session.load(arg)
            out.print(f"[dim]{'saved to' if command == '/save' else 'loaded'} {escape(arg)} ({escape(what)})[/]",
                      soft_wrap=True)
        except DFlashError as e:
            out.print(f"[red]error:[/] {escape(str(e))}", soft_wrap=True)  # one line, however long
    else:
        out.print(f"[red]unknown command {escape(command)}[/]; /help lists them")
    return True
