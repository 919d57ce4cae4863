"""Turning messages into the prompt a model was trained on: its chat template, in one place.

Every command renders prompts here (generate, chat, serve, bench, selftest, train), so the
thinking switch, tools and template errors behave the same everywhere. Rendering goes
through mlx-lm's tokenizer wrapper, which knows each family's name for the thinking switch
and templates that are Python functions rather than Jinja.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence, Union

import mlx.core as mx

from .errors import DFlashError

Messages = Sequence[dict[str, Any]]
Prompt = Union[str, Sequence[int], mx.array]  # text, token ids, or ids as an array


def encode_prompt(tokenizer: Any, prompt: Prompt) -> list[int]:
    """The ids of a prompt as given: text gets the BOS token unless it already starts with it (a rendered template
    does)."""
    if isinstance(prompt, str):
        bos = getattr(tokenizer, "bos_token", None)
        ids = tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
    elif isinstance(prompt, mx.array):
        ids = prompt.tolist()
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise DFlashError("the prompt is empty")
    return ids


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "has_chat_template", False))


def render(
    tokenizer: Any,
    messages: Messages,
    *,
    tools: Optional[Sequence[dict[str, Any]]] = None,
    thinking: Optional[bool] = None,
    add_generation_prompt: bool = True,
    tokenize: bool = True,
    template_kwargs: Optional[dict[str, Any]] = None,
) -> Any:
    """The conversation through the model's chat template: token ids, or the text with ``tokenize=False``.

    ``thinking`` sets the template's thinking switch (None: the template's default);
    ``template_kwargs`` are passed to the template as they are (a server's
    ``chat_template_kwargs``). A template that rejects the conversation (Qwen's
    raise_exception for a misplaced system message, say) is a one-line DFlashError.
    """
    if not has_chat_template(tokenizer):
        raise DFlashError("this model has no chat template: give one with --chat-template FILE, or send raw "
                          "text (generate --no-chat-template, /v1/completions)")
    kwargs = dict(template_kwargs or {})
    if thinking is not None:
        kwargs["enable_thinking"] = thinking
    if tools:
        kwargs["tools"] = list(tools)
    try:
        out = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                            tokenize=tokenize, **kwargs)
    except DFlashError:
        raise
    except Exception as e:  # noqa: BLE001 jinja2's TemplateError, or a Python template's own exception
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DFlashError(f"the chat template rejected this conversation: {reason}") from None
    return list(out) if tokenize else out


def fold_system(messages: Messages) -> list[dict[str, Any]]:
    """The conversation with every system message after the first turn joined to a neighbouring user turn.

    For templates that take a system turn only at the start (Qwen3.5's raises on a later
    one): the text goes to the end of the user turn before it, else the start of the user
    turn after it, else it becomes a user turn of its own. The first message, system or
    not, is left as it is.
    """
    out: list[dict[str, Any]] = [dict(m) for m in messages[:1]]
    carried: list[str] = []  # system text waiting for the next user turn
    for m in messages[1:]:
        if m.get("role") == "system":
            if out and out[-1].get("role") == "user" and not carried:
                out[-1]["content"] = f"{out[-1]['content']}\n\n{m['content']}"
            else:
                carried.append(str(m["content"]))
            continue
        m = dict(m)
        if carried and m.get("role") == "user":
            m["content"] = "\n\n".join([*carried, str(m["content"])])
            carried = []
        elif carried:
            out.append({"role": "user", "content": "\n\n".join(carried)})
            carried = []
        out.append(m)
    if carried:
        out.append({"role": "user", "content": "\n\n".join(carried)})
    return out


def prompt_ids(tokenizer: Any, messages: Messages, *, thinking: Optional[bool] = None) -> list[int]:
    """Ids to ask the model with: through its chat template, or the messages' text, one per line, when it has none."""
    if has_chat_template(tokenizer):
        return render(tokenizer, messages, thinking=thinking)
    return encode_prompt(tokenizer, "\n".join(str(m["content"]) for m in messages))


def user(text: str) -> list[dict[str, str]]:
    """A conversation of one user message."""
    return [{"role": "user", "content": text}]


def read_template(value: str) -> str:
    """``--chat-template``'s value: a file's text when it names a file, else the template itself.

    A value that looks like a path (no Jinja in it) but names no file is refused, so a
    typo never becomes a template that prints the path.
    """
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise DFlashError(f"--chat-template {value}: no such file (give a template file, or the template's text)")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DFlashError(f"cannot read chat template {path}: {getattr(e, 'strerror', None) or e}") from None
    if "{{" not in text and "{%" not in text:
        raise DFlashError(f"{path} is not a chat template (no Jinja tags in it)")
    return text
