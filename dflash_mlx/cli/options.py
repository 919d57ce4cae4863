"""The options commands share, declared once.

Each group is a dataclass whose fields default to their Typer options; ``shared`` gives
a command a group's options as flags and the group as one argument, so that generate,
chat, bench and serve spell a flag, its help and its checks in one place.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import typer

from ..models.caches import KVQuantization
from .checks import check_options, kv_quantization, logits_processors, processing, template_args

if TYPE_CHECKING:
    from ..decode.settings import CacheLayout, DecodeSettings, RequestSettings
    from ..sampling import Sampling

TARGET = typer.Option(None, "--target", "-t", help="Target: repo id or folder (original, converted or quantized).")
MAX_TOKENS = typer.Option(256, "--max-tokens", "-m", help="Most tokens to generate (per reply).")
BLOCK_SIZE = typer.Option(None, "--block-size", "-b", help="Draft a full block of N every cycle \\[default: adaptive, up to the drafter's block; copies up to 16].")
WINDOW = typer.Option(None, "--window", "-w", help="Attend to the last N positions only (bounded memory).")
SINKS = typer.Option(0, "--sinks", help="With --window: first positions that are never evicted.")
DRAFT_WINDOW = typer.Option(None, "--draft-window", help="The drafter attends to the last N context positions, the "
                            "target to all; 0: all \\[default: the bundle's, else all].")
TEMP = typer.Option(0.0, "--temp", help="Sampling temperature; 0 decodes greedily.")
TOP_P = typer.Option(1.0, "--top-p", help="Nucleus sampling: keep the smallest set with this much mass.")
TOP_K = typer.Option(0, "--top-k", help="Sample from the k most likely tokens only (0: all).")
MIN_P = typer.Option(0.0, "--min-p", help="Drop tokens below min_p x the top token's probability.")
SEED = typer.Option(None, "--seed", help="Seed for reproducible sampling.")
VERIFY = typer.Option("auto", "--verify", help="Sampled verification: rejection (accepts more), match, or auto: "
                                                "rejection, match with --seed (which keeps the adaptive depth).")


PREFILL_STEP = typer.Option(
    None, "--prefill-step", help="Prefill this many tokens at a time \\[default: 2048, window/16 with --window]."
)
TEMPLATE = typer.Option(
    None, "--chat-template", help="A chat template, as a Jinja file or its text, for a model without one (or instead of its own)."
)
TEMPLATE_ARGS = typer.Option(
    None, "--chat-template-args", help="Keyword arguments for the chat template, as JSON: '{\"enable_thinking\": false}'."
)
KV_BITS = typer.Option(None, "--kv-bits", help="Quantize the target's KV cache to this many bits (2-6 or 8, as mlx-lm) "
                                                 "once it holds --quantized-kv-start tokens \\[default: off].")
KV_GROUP = typer.Option(KVQuantization.group_size, "--kv-group-size", help="Group size of --kv-bits.")
KV_START = typer.Option(KVQuantization.start, "--quantized-kv-start", help="With --kv-bits: tokens the cache holds before it turns "
                                                             "quantized.")
ADAPTER = typer.Option(None, "--adapter-path", help="An mlx-lm LoRA adapter folder (mlx_lm.lora's output) for the target.")
STOP = typer.Option(None, "--stop", help="End the reply before this text (repeatable); it is never printed.")
REPETITION = typer.Option(None, "--repetition-penalty", help="Divide the logits of tokens seen in the last "
                                                               "--repetition-context-size tokens by this (as mlx-lm).")
REPETITION_CONTEXT = typer.Option(20, "--repetition-context-size", help="Tokens --repetition-penalty looks back on.")
PRESENCE = typer.Option(None, "--presence-penalty", help="Subtract this from the logits of tokens seen in the last 20.")
FREQUENCY = typer.Option(None, "--frequency-penalty", help="Subtract this times each token's count in the last 20.")
LOGIT_BIAS = typer.Option(None, "--logit-bias", help="Add to tokens' logits: a JSON object of token ids to numbers.")
SOURCE = typer.Option("auto", "--draft-source", help="Where drafts come from: auto (each cycle, the drafter or a copy "
                                                      "of text the context already holds), drafter, or copy only.")


@dataclass
class CacheFlags:
    """How the caches are laid out and where drafts come from (generate, chat, bench, serve)."""

    window: Optional[int] = WINDOW
    sinks: int = SINKS
    draft_window: Optional[int] = DRAFT_WINDOW
    block_size: Optional[int] = BLOCK_SIZE
    draft_source: str = SOURCE
    kv_bits: Optional[int] = KV_BITS
    kv_group_size: int = KV_GROUP
    quantized_kv_start: int = KV_START

    def check(self, max_tokens: int, prefill_step_size: Optional[int] = None, **sampling: Any) -> None:
        """Fail on bad values before loading the weights (``checks.check_options``)."""
        check_options(self.block_size, max_tokens, self.window, self.sinks, prefill_step_size, self.draft_source,
                      self.draft_window, **sampling)

    def decoding(self, prefill_step_size: Optional[int] = None) -> DecodeSettings:
        from ..decode.settings import CacheLayout, DecodeSettings

        kv = kv_quantization(self.kv_bits, self.kv_group_size, self.quantized_kv_start)
        layout = CacheLayout(self.window, self.sinks, self.block_size, kv, self.draft_window)
        return DecodeSettings(layout, prefill_step_size, self.draft_source)

    def layout(self) -> CacheLayout:
        return self.decoding().layout


@dataclass
class SamplingFlags:
    """How each token is chosen and when a reply ends (generate, chat)."""

    temperature: float = TEMP
    top_p: float = TOP_P
    top_k: int = TOP_K
    min_p: float = MIN_P
    seed: Optional[int] = SEED
    verify: str = VERIFY
    stop: Optional[list[str]] = STOP
    repetition_penalty: Optional[float] = REPETITION
    repetition_context_size: int = REPETITION_CONTEXT
    presence_penalty: Optional[float] = PRESENCE
    frequency_penalty: Optional[float] = FREQUENCY
    logit_bias: Optional[str] = LOGIT_BIAS

    def __post_init__(self) -> None:
        """Checked when the command starts, before any weights load."""
        from ..sampling import Sampling

        self.sampling: Sampling = Sampling(self.temperature, self.top_p, self.top_k, self.min_p, self.seed, self.verify)
        self._processing = processing(self.repetition_penalty, self.repetition_context_size, self.presence_penalty,
                                      self.frequency_penalty, self.logit_bias)

    def request(self, max_tokens: int, vocab_size: int) -> RequestSettings:
        """What each reply asks, once the target's vocabulary is known (the logit bias checked against it)."""
        from ..decode.settings import RequestSettings
        from ..decode.stops import stop_list

        processors = logits_processors(self._processing, vocab_size) or ()
        return RequestSettings(max_tokens, self.sampling, stop_list(self.stop), None, tuple(processors))


@dataclass
class ModelFlags:
    """The target beside the drafter, its adapter and its chat template (generate, chat)."""

    target: Optional[str] = TARGET
    chat_template: Optional[str] = TEMPLATE
    chat_template_args: Optional[str] = TEMPLATE_ARGS
    adapter_path: Optional[str] = ADAPTER

    def __post_init__(self) -> None:
        self.template_kwargs: dict[str, Any] = template_args(self.chat_template_args)


def shared(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A command whose parameters annotated with a flag group (``CacheFlags``, ...) take that group's options, in
    that place in --help, and receive them as one object of the group."""
    hints = typing.get_type_hints(fn)
    groups = {name: hint for name, hint in hints.items() if hint in (CacheFlags, SamplingFlags, ModelFlags)}
    parameters: list[inspect.Parameter] = []
    for name, parameter in inspect.signature(fn).parameters.items():
        if name not in groups:  # every parameter by keyword (as Typer passes them), so that the order is free
            parameters.append(parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=hints[name]))
            continue
        group_hints = typing.get_type_hints(groups[name])
        parameters += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                                         annotation=group_hints[f.name])
                       for f in dataclasses.fields(groups[name]) if f.init]
    names = {group: [f.name for f in dataclasses.fields(cls) if f.init] for group, cls in groups.items()}

    @functools.wraps(fn)
    def command(**flags: Any) -> Any:
        for group, cls in groups.items():
            flags[group] = cls(**{name: flags.pop(name) for name in names[group]})
        return fn(**flags)

    command.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in parameters}
    return command
