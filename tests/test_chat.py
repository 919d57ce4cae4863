"""`dflash-mlx chat` end to end: the installed console script, driven through a real pseudo-terminal.

CliRunner cannot test what makes a chat a chat: a tty prompt, Ctrl-C delivered as
SIGINT by the terminal, Ctrl-D, and the difference between a terminal and a pipe.
So these tests run the real ``dflash-mlx`` executable under pexpect (and, for the
piped case, under subprocess) on the tiny Qwen3 pair from ``conftest.models_dir``.
Only the flag checks, which never reach the prompt, go through CliRunner.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

import mlx.core as mx
import pexpect
import pytest
from helpers import default_sigint
from mlx_lm.utils import load_tokenizer
from typer.testing import CliRunner

from dflash_mlx.cli.main import app
from dflash_mlx.decode.chat import HELP as CHAT_HELP
from dflash_mlx.decode.chat import ChatSession, stats_line
from dflash_mlx.decode.settings import RequestSettings
from dflash_mlx.errors import DFlashError

CLI = Path(sys.executable).parent / "dflash-mlx"  # the console script of this venv (there is no __main__)
# A dumb, colourless terminal: output without escape codes. (Rich takes a dumb terminal to be 80
# columns wide whatever COLUMNS says, so the chats run in a temporary folder and name files relatively:
# the messages that quote them stay on one line.)
ENV = {**os.environ, "TERM": "dumb", "COLUMNS": "200", "NO_COLOR": "1", "PYTHONIOENCODING": "utf-8"}
TIMEOUT = 60  # seconds; loading the models takes a few on a 2-core machine
# input("> ") always follows a finished line (the pty turns "\n" into "\r\n"). Replies are random text
# that may hold "> " too, so after a message the tests wait for its stats line before the prompt.
PROMPT = "\r\n> "
STATS = re.compile(
    r"[\d.]+ tok/s \| tau [\d.]+ \| accepted \d+% \| context (?P<context>\d+) tok \| prefilled (?P<prefilled>\d+) tok"
)
LONG_MESSAGE = (
    "Please read this rather long opening message carefully, because it describes in some detail the small "
    "python program that I would like you to write for me later today"
)
SHORT_MESSAGE = "thanks a lot"
INTERRUPTED_STATS = re.compile(r"interrupted after (?P<tokens>\d+) tok \| " + STATS.pattern)
TOTALS = re.compile(r"(?P<replies>\d+) repl(y|ies), (?P<tokens>\d+) tok @ [\d.]+ tok/s \| tau [\d.]+ \| accepted \d+% \| "
                    r"context (?P<context>\d+) tok \| prefilled (?P<prefilled>\d+) tok in all")
UP = "\x1b[A"  # what the Up arrow key sends

pytestmark = pytest.mark.skipif(not CLI.exists(), reason=f"console script {CLI} not installed")


def chat_args(models_dir: Path, max_tokens: int = 40) -> list[str]:
    return ["chat", str(models_dir / "qwen3-dflash"), "--target", str(models_dir / "qwen3"), "--max-tokens", str(max_tokens)]


class Chat:
    """One ``dflash-mlx chat`` process on a pseudo-terminal, typed at the way a person would.

    HOME is ``home`` (by default the chat's folder): the input history lands there, never in
    the real home folder. ``log`` holds everything the chat printed.
    """

    def __init__(self, models_dir: Path, cwd: Path, max_tokens: int = 40, home: Optional[Path] = None):
        self.child = pexpect.spawn(
            str(CLI), chat_args(models_dir, max_tokens), cwd=str(cwd), env={**ENV, "HOME": str(home or cwd)},
            timeout=TIMEOUT, encoding="utf-8", codec_errors="replace", dimensions=(50, 200), preexec_fn=default_sigint,
        )
        self.log = io.StringIO()
        self.child.logfile_read = self.log
        self.child.expect_exact(PROMPT)  # the banner, then the first prompt
        self.banner = self.child.before

    def type(self, line: str) -> None:
        """Send a line and wait for the terminal's echo, so later matches see only the program's output."""
        self.child.sendline(line)
        self.child.expect_exact(line + "\r\n")

    def command(self, line: str) -> str:
        """Run a slash command; return what it printed before the next prompt."""
        self.type(line)
        self.child.expect_exact(PROMPT)
        return self.child.before.replace("\r\n", "\n").strip()

    def say(self, message: str) -> dict[str, int]:
        """Send a message; wait for the reply's stats line and the next prompt. Returns context and prefilled."""
        self.type(message)
        self.child.expect(STATS)
        stats = {k: int(v) for k, v in self.child.match.groupdict().items()}
        self.child.expect_exact(PROMPT)
        return stats

    def interrupt_prompt(self, then: object) -> None:
        """Ctrl-C at the prompt, repeated until ``then`` (a pattern, or pexpect.EOF) shows that it was seen.

        With readline, CPython's input() notices SIGINT only while it waits in select(): a
        Ctrl-C sent the moment the prompt appears (a loaded machine may not have reached
        select yet) stays pending until the next one. Pending SIGINTs raise a single
        KeyboardInterrupt, so repeating is safe.
        """
        for _ in range(10):
            self.child.sendintr()
            if self.child.expect([then, pexpect.TIMEOUT], timeout=2) == 0:
                return
        raise AssertionError(f"Ctrl-C at the prompt was never seen: {self.log.getvalue()[-300:]!r}")

    def wait_exit(self) -> Optional[int]:
        """The exit status once the program has ended by itself (None if a signal killed it)."""
        self.child.expect(pexpect.EOF)
        self.child.close()
        return self.child.exitstatus

    def kill(self) -> None:
        if self.child.isalive():
            self.child.terminate(force=True)


@pytest.fixture
def spawn(models_dir, tmp_path):
    """Start chats (in tmp_path) for a test and make sure none outlives it, whatever the test's outcome."""
    chats: list[Chat] = []

    def start(max_tokens: int = 40, home: Optional[Path] = None) -> Chat:
        chats.append(Chat(models_dir, tmp_path, max_tokens, home))
        return chats[-1]

    yield start
    for chat in chats:
        chat.kill()


@pytest.fixture(scope="module")
def tokenizer(models_dir):
    """The target's own tokenizer: the ChatML template the chat renders every turn with."""
    return load_tokenizer(models_dir / "qwen3")


def prompt_length(tokenizer, messages: list[dict], generation_prompt: bool = True) -> int:
    """Tokens of the conversation as ChatSession renders it (no system prompt, template's thinking default)."""
    return len(tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt))


# --- 1. turns reuse the caches -------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_turns(models_dir, tmp_path_factory):
    """A long first message and a short second one; both stats lines and the saved conversation.

    Module-scoped: the two cache tests below read the same conversation.
    """
    folder = tmp_path_factory.mktemp("two_turns")
    chat = Chat(models_dir, folder)
    try:
        first = chat.say(LONG_MESSAGE)
        second = chat.say(SHORT_MESSAGE)
        assert chat.command("/save chat.json") == "saved to chat.json (4 messages, caches beside it)"
        chat.type("/quit")
        assert chat.wait_exit() == 0
    finally:
        chat.kill()
    return first, second, json.loads((folder / "chat.json").read_text())["messages"]


def test_each_turn_prints_stats_for_its_prompt(two_turns, tokenizer):
    """Turn 1 prefills its whole prompt (the caches start empty) and the context grows turn by turn."""
    first, second, messages = two_turns
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert [messages[0]["content"], messages[2]["content"]] == [LONG_MESSAGE, SHORT_MESSAGE]
    assert first["prefilled"] == prompt_length(tokenizer, messages[:1])
    assert first["prefilled"] < first["context"] < second["context"]
    assert 0 < second["prefilled"] < second["context"]


def test_second_turn_prefills_only_the_new_message(two_turns, tokenizer):
    """The point of the chat command: turn 2 costs its own message, not the whole conversation."""
    first, second, messages = two_turns
    new_turn = prompt_length(tokenizer, messages[:3]) - prompt_length(tokenizer, messages[:2], generation_prompt=False)
    # Besides the new turn, only the reply's last token (emitted, never fed to the target) and the
    # "<|im_end|>\n" closing the reply are missing from the caches.
    assert second["prefilled"] <= new_turn + 3, (second, new_turn)
    assert second["prefilled"] < first["context"]


# --- 2. /save, /reset, /load ---------------------------------------------------------------------


def test_save_reset_load(spawn, tmp_path, tokenizer):
    """A saved conversation comes back whole with its caches: the next message prefills only itself. Without the
    caches (deleted, or not this pair's), its history is prefilled."""
    path = tmp_path / "conversation.json"
    chat = spawn()
    chat.say("hello there")
    chat.say("how are you")
    assert chat.command(f"/save {path.name}") == f"saved to {path.name} (4 messages, caches beside it)"
    saved = json.loads(path.read_text())
    assert saved["system"] is None
    assert [m["role"] for m in saved["messages"]] == ["user", "assistant"] * 2
    assert [m["content"] for m in saved["messages"][::2]] == ["hello there", "how are you"]

    assert chat.command("/reset") == "conversation reset"
    assert chat.command("/stats") == "no reply yet"
    assert chat.command(f"/load {path.name}") == f"loaded {path.name} (4 messages, caches restored)"
    assert chat.command("/stats") == "no reply yet"  # loading starts a fresh conversation
    new = tokenizer.encode("<|im_end|>\n<|im_start|>user\ntell me more<|im_end|>\n<|im_start|>assistant\n")
    assert chat.say("tell me more")["prefilled"] <= len(new) + 1  # the new message (and the last reply's token)

    (tmp_path / f"{path.name}.cache.safetensors").unlink()
    assert chat.command(f"/load {path.name}") == f"loaded {path.name} (4 messages)"
    stats = chat.say("tell me more")
    full = saved["messages"] + [{"role": "user", "content": "tell me more"}]
    assert stats["prefilled"] == prompt_length(tokenizer, full)
    totals = TOTALS.fullmatch(chat.command("/stats"))  # the conversation since it was loaded: one reply
    assert totals and totals["replies"] == "1" and int(totals["prefilled"]) == stats["prefilled"]
    chat.command(f"/save {path.name}")
    assert [m["role"] for m in json.loads(path.read_text())["messages"]] == ["user", "assistant"] * 3
    chat.type("/quit")
    assert chat.wait_exit() == 0


# --- 3. Ctrl-C ----------------------------------------------------------------------------------


def test_ctrl_c_stops_a_reply_and_the_chat_goes_on(spawn, tmp_path, tokenizer):
    """Ctrl-C mid-reply stops it (keeping the words) with its stats marked interrupted, the next
    message is answered, two Ctrl-C leave.

    1000 tokens take several seconds here, so the interrupt, sent as soon as the reply
    streams, lands mid-reply; the second reply must finish, which keeps this test short.
    """
    chat = spawn(max_tokens=1000)
    chat.type("Tell me a long story")
    chat.child.expect(r"[\s\S]")  # the reply has started streaming
    chat.child.sendintr()
    chat.child.expect(INTERRUPTED_STATS)
    assert int(chat.child.match["tokens"]) > 0 and int(chat.child.match["prefilled"]) > 0
    tokens = int(chat.child.match["tokens"])
    chat.child.expect_exact(PROMPT)
    totals = TOTALS.fullmatch(chat.command("/stats"))
    assert totals and totals["replies"] == "1" and int(totals["tokens"]) == tokens

    stats = chat.say("and then")
    assert stats["prefilled"] > 0
    totals = TOTALS.fullmatch(chat.command("/stats"))  # both replies, the interrupted one included
    assert totals["replies"] == "2" and int(totals["tokens"]) > tokens
    chat.command("/save after-ctrl-c.json")
    messages = json.loads((tmp_path / "after-ctrl-c.json").read_text())["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] * 2
    assert messages[1]["content"]  # the interrupted reply's words stay in the history
    # The interrupted turn left valid caches: the next turn prefilled its own message, not the history.
    new_turn = prompt_length(tokenizer, messages[:3]) - prompt_length(tokenizer, messages[:2], generation_prompt=False)
    assert stats["prefilled"] <= new_turn + 3, (stats, new_turn)

    chat.interrupt_prompt("Ctrl-C again or /quit to leave")
    chat.child.expect_exact(PROMPT)
    chat.interrupt_prompt(pexpect.EOF)
    assert chat.wait_exit() == 0


@pytest.mark.parametrize("how", ["Ctrl-D", "/quit", "/exit", "Ctrl-C twice"])
def test_leaving_ends_the_line(spawn, how):
    """Every way out exits 0 and leaves the cursor on a fresh line, where the shell's prompt belongs."""
    chat = spawn()
    if how == "Ctrl-D":
        chat.child.sendeof()
    elif how == "Ctrl-C twice":
        chat.interrupt_prompt("Ctrl-C again or /quit to leave")
        chat.child.expect_exact(PROMPT)
        chat.interrupt_prompt(pexpect.EOF)
    else:
        chat.type(how)
    assert chat.wait_exit() == 0
    after_last_prompt = chat.log.getvalue().rpartition("> ")[2]
    assert after_last_prompt.endswith("\r\n"), repr(after_last_prompt)


# --- 4. line editing and history ------------------------------------------------------------------


def _saved_messages(chat: Chat, folder: Path) -> list[str]:
    chat.command("/save history-check.json")
    return [m["content"] for m in json.loads((folder / "history-check.json").read_text())["messages"]]


def test_up_arrow_recalls_lines_in_this_chat_and_the_next(spawn, tmp_path):
    """Up + Enter sends the previous line again (no raw ^[[A), and a new chat recalls it from the history file."""
    chat = spawn()
    chat.say("hello there")
    chat.child.send(UP + "\r")
    chat.child.expect(STATS)  # a second reply
    chat.child.expect_exact(PROMPT)
    assert _saved_messages(chat, tmp_path)[::2] == ["hello there", "hello there"]
    chat.type("/quit")
    assert chat.wait_exit() == 0
    assert "^[[A" not in chat.log.getvalue() and UP not in chat.log.getvalue()
    history = tmp_path / ".cache" / "dflash-mlx" / "chat_history"
    assert "hello there" in history.read_text()

    again = spawn()
    again.child.send(UP * 3 + "\r")  # back past "/quit" and "/save ..." (a line sent twice is kept once)
    again.child.expect(STATS)
    again.child.expect_exact(PROMPT)
    assert _saved_messages(again, tmp_path)[::2] == ["hello there"]


def test_unwritable_history_is_ignored(spawn, tmp_path):
    """A history that cannot be read or written (here ~/.cache is a file) costs nothing but the history."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".cache").write_text("not a folder")
    chat = spawn(home=home)
    chat.say("hello")
    chat.type("/quit")
    assert chat.wait_exit() == 0
    assert "Traceback" not in chat.log.getvalue() and (home / ".cache").read_text() == "not a folder"


# --- 5. commands --------------------------------------------------------------------------------


def test_commands(spawn):
    """/help lists every command; mistakes get a message and the chat goes on; /quit exits 0."""
    chat = spawn()
    assert "/help for commands" in chat.banner
    help_text = chat.command("/help")
    assert help_text == CHAT_HELP
    for command in ("/reset", "/system", "/stats", "/save", "/load", "/quit", "/help"):
        assert re.search(rf"^\s*{command}\b", help_text, re.M), command

    assert chat.command("/foo") == "unknown command /foo; /help lists them"
    assert chat.command("/save") == "usage: /save FILE"
    assert chat.command("/load missing.json").startswith("error: cannot load conversation missing.json")
    assert chat.command("/system You are terse.") == "system prompt set; conversation reset"
    assert chat.say("hello")["prefilled"] > 0  # still answering after all that
    chat.type("/quit")
    assert chat.wait_exit() == 0


def test_load_says_what_is_wrong_with_a_file(spawn, tmp_path):
    """Each kind of bad file gets one line naming the problem; the conversation is kept and the chat goes on."""
    (tmp_path / "folder").mkdir()
    (tmp_path / "text.json").write_text("hello")
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00\x81")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "shape.json").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "x"}]}))
    (tmp_path / "system.json").write_text(json.dumps({"system": 3, "messages": []}))
    problems = {
        "missing.json": "no such file",
        "folder": "it is a folder; give the file /save wrote",
        "text.json": "not valid JSON (Expecting value at line 1, column 1)",
        "binary.json": "not a text file; give the JSON file /save wrote",
        "list.json": 'JSON, but not a conversation: expected an object with a "messages" list, as /save writes',
        "shape.json": 'message 2 is not {"role": TEXT, "content": TEXT}',
        "system.json": '"system" must be text or null',
    }
    chat = spawn()
    chat.say("hello")
    for name, problem in problems.items():
        assert chat.command(f"/load {name}") == f"error: cannot load conversation {name}: {problem}"
    assert chat.command("/save kept.json") == "saved to kept.json (2 messages, caches beside it)"
    assert chat.say("and again")["prefilled"] > 0


def test_brackets_in_commands_are_printed_verbatim(models_dir, tmp_path):
    """What the user typed is text, not markup: it is echoed as typed and never ends the chat."""
    (tmp_path / "a[/x]").mkdir(parents=True)  # the folder x inside a[
    run = subprocess.run([str(CLI), *chat_args(models_dir)], input="/foo[/x]\nhello\n/save a[/x]/c.json\n", cwd=tmp_path,
                         capture_output=True, text=True, encoding="utf-8", env=ENV, timeout=TIMEOUT)
    assert "Traceback" not in run.stderr and run.returncode == 0, run.stderr
    assert "unknown command /foo[/x]; /help lists them" in run.stdout
    assert "saved to a[/x]/c.json (2 messages, caches beside it)" in run.stdout


# --- 6. piped stdin -----------------------------------------------------------------------------


def test_piped_stdin(models_dir, pairs):
    """Lines from a pipe are messages: no banner, no prompts, the replies on stdout, exit 0 at EOF."""
    run = subprocess.run([str(CLI), *chat_args(models_dir)], input="hello\nhow are you\n", capture_output=True,
                         text=True, encoding="utf-8", env=ENV, timeout=TIMEOUT)
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr
    stats = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(stats) == 2 and all(STATS.fullmatch(line) for line in stats), run.stderr

    # The same conversation in-process: stdout must be exactly the two replies, a newline after each.
    target, drafter, tokenizer = pairs["qwen3"]
    session = ChatSession(target, drafter, tokenizer, asked=RequestSettings(max_tokens=40))
    replies = [session.reply(message).text for message in ("hello", "how are you")]
    assert run.stdout == "".join(reply + "\n" for reply in replies)


# --- 7. bad flags -------------------------------------------------------------------------------


def _fails(args: list[str]) -> str:
    """Run chat through CliRunner; it must exit 2 with one 'error:' line and no traceback. Returns the line."""
    result = CliRunner().invoke(app, ["chat", *args])
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output and result.stdout == ""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_window_smaller_than_block(models_dir):
    line = _fails([str(models_dir / "qwen3-dflash"), "-t", str(models_dir / "qwen3"), "--window", "2", "-b", "4"])
    assert line.startswith("error: window (2) must be at least the block size (4)")


def test_window_smaller_than_drafter_block(models_dir):
    """Without -b the drafter's own block size (16) is checked, once it is loaded."""
    line = _fails([str(models_dir / "qwen3-dflash"), "-t", str(models_dir / "qwen3"), "--window", "8"])
    assert line.startswith("error: window (8) must be at least the block size (16)")


def test_missing_model_paths(models_dir, tmp_path):
    assert "no such folder" in _fails([str(tmp_path / "nope"), "-t", str(models_dir / "qwen3")])
    assert "no such folder" in _fails([str(models_dir / "qwen3-dflash"), "-t", str(tmp_path / "nope")])


@pytest.mark.parametrize("name", ["nope[/x]", "nope[bold]"])
def test_error_names_the_path_as_typed(models_dir, tmp_path, name):
    path = str(tmp_path / name)
    assert path in _fails([path, "-t", str(models_dir / "qwen3")])


def test_unknown_name_or_repo():
    line = _fails(["Unknown-Model-XYZ"])
    assert "no such folder or registry name" in line
    line = _fails(["someone/Unknown-Model-XYZ"])
    assert "cannot download model someone/Unknown-Model-XYZ" in line and "--target" not in line
    assert "--target TARGET" in _fails(["someone/Unknown-Model-DFlash"])


def test_target_without_chat_template_is_refused_in_one_line(models_dir, tmp_path):
    """A base model's tokenizer has no chat template: chat says so instead of a traceback."""
    import shutil

    from typer.testing import CliRunner

    target = tmp_path / "base"
    shutil.copytree(models_dir / "qwen3", target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(app, ["chat", str(models_dir / "qwen3-dflash"), "-t", str(target)], input="hello\n")
    assert result.exit_code == 2
    assert result.stderr.strip() == ("error: the target's tokenizer has no chat template, so it cannot chat: give "
                                     "one with --chat-template FILE, or use `dflash-mlx generate --no-chat-template` "
                                     "for raw text")


@pytest.mark.parametrize("reply", ["end", ">", "\n"])
def test_the_next_prompt_keeps_the_end_of_turn_whatever_the_reply(tmp_path, reply):
    """A reply whose text also occurs in the template's end-of-turn text ("<|im_end|>\\n") must not splice it
    out of the next prompt: turn 2's ids are exactly what the template renders for the conversation."""
    from dflash_mlx import load
    from dflash_mlx.chat_template import render
    from dflash_mlx.models import fixtures

    config = fixtures.target_config("qwen3")
    fixtures.write_scripted_target(tmp_path / "target", {"assistant\n": [reply, "<|im_end|>"]}, config=config)
    fixtures.write_drafter(tmp_path / "draft", fixtures.drafter_config(config, 1, target_layer_ids=[1]))
    target, drafter, tokenizer = load(str(tmp_path / "draft"), str(tmp_path / "target"))
    session = ChatSession(target, drafter, tokenizer, asked=RequestSettings(max_tokens=8))
    assert session.reply("hello").text == reply
    held = len(session.cache.tokens)  # the first prompt and the reply
    session.reply("and again")
    expected = render(tokenizer, session.messages[:3])
    assert session.ids[: len(expected)] == expected
    assert session.last.prompt_cached == held  # and the caches carried over


def test_a_full_conversation_points_to_reset(pairs):
    """The reply that fills the model's positions says so, and the next message is refused with the way out
    (issue 49, a new user's item 5); after /reset the chat answers again."""
    target, drafter, tokenizer = pairs["qwen3"]
    limit = target.max_positions
    session = ChatSession(target, drafter, tokenizer, asked=RequestSettings(max_tokens=limit))
    per_word = len(tokenizer.encode(" word" * 100, add_special_tokens=False)) / 100
    session.reply("word" + " word" * int((limit - 80) / per_word))  # leaves a few dozen positions to reply in
    assert session.last.finish_reason == "length" and len(session.ids) == limit
    assert stats_line(session).endswith(f"the conversation fills the model's {limit} positions: /reset to start over")
    with pytest.raises(DFlashError, match="/reset starts a new one"):
        session.reply("and then?")
    assert session.messages[-1]["role"] == "assistant"  # the refused message is not kept
    session.reset()
    assert session.reply("hello").finish_reason is not None


def test_forged_caches_beside_a_saved_conversation_are_not_used(pairs, tmp_path):
    """Caches re-signed with a layer of the wrong shape: /load said "caches restored" and the next message ended in a
    traceback. Checked against this model's shapes, they are not used (said in one line, a prefill the cost), and
    the next reply is the one a cold conversation gives."""
    from dflash_mlx.decode.cache_files import cache_file, read_state, write_state

    target, drafter, tokenizer = pairs["qwen3"]
    session = ChatSession(target, drafter, tokenizer, asked=RequestSettings(max_tokens=12))
    session.reply("hello")
    session.save(str(tmp_path / "talk.json"))
    caches = cache_file(tmp_path / "talk.json")
    state, extra = read_state(caches, session._fingerprint())
    kind, arrays, meta = state.target[0]
    state.target[0] = (kind, [mx.concatenate([a, a], axis=-1) for a in arrays], meta)
    write_state(caches, state, session._fingerprint(), extra)
    loaded = ChatSession(target, drafter, tokenizer, asked=RequestSettings(max_tokens=12))
    said = loaded.load(str(tmp_path / "talk.json"))
    assert "its caches not used" in said and "target layer 0" in said and "\n" not in said
    cold = ChatSession(target, drafter, tokenizer, asked=RequestSettings(max_tokens=12))
    cold.messages = list(loaded.messages)
    assert loaded.reply("and then?").tokens == cold.reply("and then?").tokens
