"""The ``dflash-mlx`` command line: a thin layer over the library API.

Each command checks its flags (cli_checks), loads MODEL (cli_models), runs the library and
prints what it did (cli_output, cli_progress; the chat loop in cli_chat, bench's steps in cli_bench).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sys
from typing import TYPE_CHECKING, Any, Callable, Iterator, NoReturn, Optional

import typer
from rich.console import Console
from rich.markup import escape

from .. import __version__, distributed
from ..errors import DFlashError
from .checks import (
    check_bench,
    check_http_stack,
    check_loaded,
    check_options,
    check_serving,
    duration,
    integers,
    kv_settings,
    logits_processors,
    origins,
    processing,
    prompt_caches,
    template_args,
)
from .output import (
    generation_json,
    generation_stats,
    looping_note,
    print_machine,
    print_models,
    print_selftest,
    rank_peaks,
    serving_line,
    training_summary,
)
from .pairs import bundle_manifests, load_model, pair_rows, thinking_mismatch
from .progress import prefill_progress, training_progress

if TYPE_CHECKING:
    from ..decode.generate import GenerationResponse

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="DFlash block-diffusion speculative decoding on Apple Silicon, in pure MLX.",
)
err = Console(stderr=True, highlight=False)


def fail(message: str) -> None:
    """One clear line on stderr, exit status 2 (from every rank of a group: it may be this rank's alone)."""
    if err.quiet:
        sys.stderr.write(f"rank {distributed.rank()}: error: {message}\n")
    err.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    raise typer.Exit(2)


def user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn DFlashError into one line and exit 2; Ctrl-C into exit 130 without a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except DFlashError as e:
            fail(str(e))
        except KeyboardInterrupt:
            err.print("\n[yellow]interrupted[/]")
            raise typer.Exit(130)

    return wrapper


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dflash-mlx {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """Under ``mlx.launch`` every rank runs the command; only rank 0 speaks (errors aside)."""
    try:
        quiet = not distributed.is_main()
    except DFlashError as e:
        fail(str(e))
    if quiet:
        err.quiet = True
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the group stops


TARGET = typer.Option(None, "--target", "-t", help="Target: repo id or folder (original, converted or quantized).")
MAX_TOKENS = typer.Option(256, "--max-tokens", "-m", help="Most tokens to generate (per reply).")
BLOCK_SIZE = typer.Option(None, "--block-size", "-b", help="Draft a full block of N every cycle \\[default: adaptive, up to the drafter's block].")
WINDOW = typer.Option(None, "--window", "-w", help="Attend to the last N positions only (bounded memory).")
SINKS = typer.Option(0, "--sinks", help="With --window: first positions that are never evicted.")
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
KV_BITS = typer.Option(None, "--kv-bits", help="Quantize the target's KV cache to this many bits (4 or 8, as mlx-lm) "
                                                 "once it holds --quantized-kv-start tokens \\[default: off].")
KV_GROUP = typer.Option(64, "--kv-group-size", help="Group size of --kv-bits.")
KV_START = typer.Option(5000, "--quantized-kv-start", help="With --kv-bits: tokens the cache holds before it turns "
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


def _warn(message: str) -> None:
    err.print(f"[yellow]warning:[/] {escape(message)}", soft_wrap=True)


def _before_decoding(window: Optional[int], sinks: int, block_size: Optional[int], drafter: Any) -> None:
    """Once the drafter is loaded: the flags that depend on it, then a warning if this machine's BLAS is slow.

    Every command that decodes gives that warning (Linux only). ``DFLASH_MLX_BLAS_WARNING=0``
    silences it, for those who know (the test suite, which checks what else the commands print).
    """
    from ..system import blas_check

    check_loaded(window, sinks, block_size, drafter)
    verdict = blas_check()
    if verdict is not None and verdict[0] != "ok" and os.environ.get("DFLASH_MLX_BLAS_WARNING") != "0":
        _warn(verdict[1])


@app.command()
@user_errors
def generate(
    draft: str = typer.Argument(..., help="Drafter: registry name, Hub repo id, drafter folder or converted bundle."),
    target: Optional[str] = TARGET,
    prompt: str = typer.Option(..., "--prompt", "-p", help="The prompt ('-' reads stdin)."),
    max_tokens: int = MAX_TOKENS,
    block_size: Optional[int] = BLOCK_SIZE,
    window: Optional[int] = WINDOW,
    sinks: int = SINKS,
    prefill_step_size: Optional[int] = PREFILL_STEP,
    temperature: float = TEMP,
    top_p: float = TOP_P,
    top_k: int = TOP_K,
    min_p: float = MIN_P,
    seed: Optional[int] = SEED,
    verify: str = VERIFY,
    stop: Optional[list[str]] = STOP,
    draft_source: str = SOURCE,
    repetition_penalty: Optional[float] = REPETITION,
    repetition_context_size: int = REPETITION_CONTEXT,
    presence_penalty: Optional[float] = PRESENCE,
    frequency_penalty: Optional[float] = FREQUENCY,
    logit_bias: Optional[str] = LOGIT_BIAS,
    chat_template: Optional[str] = TEMPLATE,
    chat_template_args: Optional[str] = TEMPLATE_ARGS,
    adapter_path: Optional[str] = ADAPTER,
    kv_bits: Optional[int] = KV_BITS,
    kv_group_size: int = KV_GROUP,
    quantized_kv_start: int = KV_START,
    raw: bool = typer.Option(False, "--no-chat-template", help="Send the prompt as raw text, without the chat template."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of text."),
) -> None:
    """Generate a reply to one prompt, losslessly, with DFlash speculative decoding."""
    from ..chat_template import encode_prompt, has_chat_template, render, user
    from ..decode.generate import check_context

    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed, verify=verify)
    check_options(block_size, max_tokens, window, sinks, prefill_step_size, draft_source, **sampling)
    penalties = processing(repetition_penalty, repetition_context_size, presence_penalty, frequency_penalty, logit_bias)
    template_kwargs = template_args(chat_template_args)
    kv = kv_settings(kv_bits, kv_group_size, quantized_kv_start)
    if raw and chat_template is not None:
        raise DFlashError("--chat-template and --no-chat-template contradict each other: pass one")
    if prompt == "-":
        prompt = sys.stdin.read()
    _, tgt, drafter, tokenizer = load_model(draft, target, chat_template, err, adapter_path)
    _before_decoding(window, sinks, block_size, drafter)
    chat = not raw and has_chat_template(tokenizer)
    ids = render(tokenizer, user(prompt), template_kwargs=template_kwargs) if chat else encode_prompt(tokenizer, prompt)
    if (budget := check_context(tgt.max_positions, len(ids), max_tokens)) < max_tokens:
        err.print(f"[dim]note: the prompt ({len(ids)} tokens) leaves {budget} of the model's {tgt.max_positions} "
                  "positions: the reply stops at the end of them[/]", soft_wrap=True)
    responses, stopped = _stream(tgt, drafter, tokenizer, ids, as_json, max_tokens=max_tokens, block_size=block_size,
                                 window=window, sinks=sinks, prefill_step_size=prefill_step_size, stop=stop,
                                 draft_source=draft_source,
                                 logits_processors=logits_processors(penalties, tgt.vocab_size), **sampling, **kv)
    _end_generation(responses, stopped, as_json)


def _stream(tgt: Any, drafter: Any, tokenizer: Any, ids: list[int], as_json: bool,
            **options: Any) -> tuple[list[GenerationResponse], Optional[int]]:
    """(responses, the exit code of an interruption or None): the text printed as it comes unless --json; Ctrl-C
    and SIGTERM keep what was generated."""
    from ..decode.generate import generate as run

    responses: list[GenerationResponse] = []

    def show(response: GenerationResponse) -> None:
        responses.append(response)
        if not as_json:
            sys.stdout.write(response.text)
            sys.stdout.flush()

    try:
        with prefill_progress(err) as progress, _terminate_as_interrupt():
            run(tgt, drafter, tokenizer, ids, on_response=show, prompt_progress_callback=progress, **options)
    except KeyboardInterrupt as e:  # what was generated is kept: printed, and in the JSON marked interrupted
        return responses, 143 if isinstance(e, _Terminated) else 130
    return responses, None


class _Terminated(KeyboardInterrupt):
    """SIGTERM (a supervisor, `timeout`, `kill`) during a generation: handled as Ctrl-C is, exit 143."""


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM raises ``_Terminated`` while generating, so what was generated is kept and reported."""
    def terminated(signum: int, frame: Any) -> None:
        raise _Terminated()

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _end_generation(responses: list[GenerationResponse], stopped: Optional[int], as_json: bool) -> None:
    """The JSON (or the reply's last newline) on stdout, the figures on stderr; after an interruption, its exit code
    (``stopped``: 130 after Ctrl-C, 143 after SIGTERM)."""
    from ..decode.generate import INTERRUPTED, GenerationResult

    interrupted = stopped is not None
    result = GenerationResult.from_responses(responses, INTERRUPTED if interrupted else None) if responses else None
    if as_json:
        typer.echo(generation_json(result, interrupted, rank_peaks(result.peak_memory if result else 0.0, interrupted)))
    else:
        sys.stdout.write("\n")
    if result is None:
        err.print("[yellow]interrupted[/] before the first token")
    else:
        err.print(generation_stats(result), soft_wrap=True)
    if stopped is not None:
        raise typer.Exit(stopped)


@app.command()
@user_errors
def models(as_json: bool = typer.Option(False, "--json", help="Print the registry as JSON.")) -> None:
    """List the published drafter -> target pairs, which are downloaded or converted, and the converted bundles."""
    manifests = bundle_manifests()
    rows = pair_rows(manifests)
    if as_json:
        typer.echo(json.dumps(rows, indent=1))
        return
    print_models(Console(highlight=False), rows, manifests)


@app.command()
@user_errors
def convert(
    source: str = typer.Argument(..., help="Drafter (registry name, Hub repo id or folder), or a .gguf model file."),
    out: str = typer.Option(..., "--out", "-o", help="Bundle folder to write (a model folder, for a .gguf)."),
    target: Optional[str] = TARGET,
    quantize: Optional[str] = typer.Option(None, "--quantize", "-q", help="Target quantization: 4bit, 8bit, mixed_4_6, ..."),
    q_group_size: int = typer.Option(64, "--q-group-size", help="Quantization group size."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Float dtype: bfloat16, float16 or float32 (a .gguf: "
                                                               "dequantize every tensor to it)."),
    draft_quantize: str = typer.Option("none", "--draft-quantize", help="Drafter quantization: none, 8bit or 4bit."),
    quantize_fc: bool = typer.Option(False, "--quantize-fc", help="With --draft-quantize: quantize fc too."),
    force: bool = typer.Option(False, "--force", help="Replace an existing OUT."),
) -> None:
    """Convert a drafter and its target into one offline MLX bundle (optionally quantized), or a GGUF file
    (llama.cpp, Ollama, LM Studio) into an mlx-lm model folder for --target, alone, or `dflash-mlx train`."""
    from ..models.convert import convert as run
    from ..models.convert import summary

    if not distributed.is_main():  # it writes files and shards nothing: under mlx.launch rank 0 runs it alone
        return

    with err.status("checking the pair") as status:  # transient: only the result or one error line stays
        path = run(source, out, target=target, quantize=quantize, q_group_size=q_group_size, dtype=dtype,
                   draft_quantize=draft_quantize, quantize_fc=quantize_fc, force=force, log=status.update)
    typer.echo(summary(path))


@app.command()
@user_errors
def doctor(
    model: Optional[str] = typer.Argument(
        None, help="With --selftest: registry name, drafter repo/folder or bundle \\[default: fits this machine]."
    ),
    target: Optional[str] = TARGET,
    selftest: bool = typer.Option(False, "--selftest", help="Prove DFlash lossless on MODEL, on this machine."),
    max_tokens: int = typer.Option(128, "--max-tokens", "-m", help="With --selftest: tokens to decode per prompt."),
) -> None:
    """Check the MLX backend, the BLAS, versions, the Hugging Face cache and converted bundles.

    --selftest then decodes a math, a code and a chat prompt greedily with plain decoding and with
    DFlash, and compares them token for token. Exit status: 0 identical everywhere; 1 near-ties only
    (logits closer than the threshold it prints, which kernel rounding can flip); 3 a real divergence
    (a bug: please report it with the output).
    """
    if selftest:
        from ..eval.selftest import check_max_tokens
        from ..eval.selftest import selftest as run

        check_max_tokens(max_tokens)
    elif model is not None or target is not None:
        raise DFlashError("MODEL and --target are for the selftest: dflash-mlx doctor --selftest MODEL")
    out = Console(highlight=False, soft_wrap=True)
    print_machine(out)
    if not selftest:
        return
    model, tgt, drafter, tokenizer = load_model(model, target, None, err)
    with err.status("selftest: plain and DFlash greedy decoding") as status:
        result = run(tgt, drafter, tokenizer, max_tokens=max_tokens,
                     on_prompt=lambda record: status.update(f"selftest: {record['prompt']} done"))
    print_selftest(out, model, result, tokenizer, max_tokens)
    raise typer.Exit(result.exit_code)


@app.command()
@user_errors
def chat(
    model: Optional[str] = typer.Argument(None, help="Registry name, drafter repo/folder or bundle \\[default: fits this machine]."),
    target: Optional[str] = TARGET,
    window: Optional[int] = WINDOW,
    sinks: int = SINKS,
    block_size: Optional[int] = BLOCK_SIZE,
    temperature: float = TEMP,
    top_p: float = TOP_P,
    top_k: int = TOP_K,
    min_p: float = MIN_P,
    seed: Optional[int] = SEED,
    verify: str = VERIFY,
    stop: Optional[list[str]] = STOP,
    draft_source: str = SOURCE,
    repetition_penalty: Optional[float] = REPETITION,
    repetition_context_size: int = REPETITION_CONTEXT,
    presence_penalty: Optional[float] = PRESENCE,
    frequency_penalty: Optional[float] = FREQUENCY,
    logit_bias: Optional[str] = LOGIT_BIAS,
    chat_template: Optional[str] = TEMPLATE,
    chat_template_args: Optional[str] = TEMPLATE_ARGS,
    adapter_path: Optional[str] = ADAPTER,
    kv_bits: Optional[int] = KV_BITS,
    kv_group_size: int = KV_GROUP,
    quantized_kv_start: int = KV_START,
    max_tokens: int = typer.Option(1024, "--max-tokens", "-m", help="Most tokens per reply."),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt."),
    think: Optional[bool] = typer.Option(None, "--think/--no-think", help="The chat template's thinking mode."),
) -> None:
    """Chat interactively; each turn prefills only the new message. Pipe lines in to script it."""
    from ..decode.chat import ChatSession
    from .chat import converse

    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed, verify=verify)
    check_options(block_size, max_tokens, window, sinks, draft_source=draft_source, **sampling)
    penalties = processing(repetition_penalty, repetition_context_size, presence_penalty, frequency_penalty, logit_bias)
    template_kwargs = template_args(chat_template_args)
    kv = kv_settings(kv_bits, kv_group_size, quantized_kv_start)
    model, tgt, drafter, tokenizer = load_model(model, target, chat_template, err, adapter_path)
    if warning := thinking_mismatch(model, think):
        err.print(f"[yellow]warning:[/] {warning}")
    _before_decoding(window, sinks, block_size, drafter)
    session = ChatSession(tgt, drafter, tokenizer, system=system, think=think, window=window, sinks=sinks,
                          block_size=block_size, template_args=template_kwargs,
                          options=dict(max_tokens=max_tokens, **sampling, stop=stop, draft_source=draft_source,
                                       logits_processors=logits_processors(penalties, tgt.vocab_size), **kv))
    converse(session, model, err)


@app.command()
@user_errors
def bench(
    model: str = typer.Argument(..., help="Registry name, drafter repo/folder or bundle."),
    target: Optional[str] = TARGET,
    window: Optional[int] = WINDOW,
    sinks: int = SINKS,
    prompt_tokens: Optional[str] = typer.Option(None, "--prompt-tokens", help="Context sweep: prompt lengths, e.g. 1024,4096,8192."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-m", help="Tokens to decode per prompt."),
    dataset: str = typer.Option("all", "--dataset", help="math, code, chat, all (built in: the three interleaved), edit (a file asked back with one change), gsm8k, math500, humaneval, mbpp, mt-bench, or FILE.jsonl."),
    num_prompts: int = typer.Option(12, "--num-prompts", help="Most prompts to run."),
    block_size: Optional[int] = BLOCK_SIZE,
    draft_source: str = SOURCE,
    temperature: float = TEMP,
    adapter_path: Optional[str] = ADAPTER,
    kv_bits: Optional[int] = KV_BITS,
    kv_group_size: int = KV_GROUP,
    quantized_kv_start: int = KV_START,
    repeats: int = typer.Option(1, "--repeats", help="Runs per prompt; the order of the two paths alternates."),
    json_out: Optional[str] = typer.Option(None, "--json", help="Write every figure, the machine and versions here."),
    plot_out: Optional[str] = typer.Option(None, "--plot", help="Write speedup and tau vs context and the acceptance histogram (PNG)."),
    force: bool = typer.Option(False, "--force", help="Replace existing --json and --plot files."),
    score: bool = typer.Option(False, "--score", help="HumanEval/MBPP: run each completion's tests and report pass@1, "
                               "plain and dflash. This EXECUTES MODEL-WRITTEN CODE on this machine, each program in the "
                               "operating system's sandbox (bubblewrap or unshare, sandbox-exec): no network, no "
                               "writes outside an empty folder, a timeout; see the README for what remains)."),
    score_timeout: float = typer.Option(10.0, "--score-timeout", help="Seconds each program may run under --score."),
    score_unisolated: bool = typer.Option(False, "--score-unisolated", help="Where no sandbox works (bubblewrap or "
                                          "unshare on Linux, sandbox-exec on macOS), run --score's programs anyway, "
                                          "unconfined but for a timeout and limits."),
) -> None:
    """Measure DFlash against plain decoding of the same target, prompt by prompt, side by side.

    Ctrl-C stops early and keeps (prints and writes) the prompts measured so far.
    """
    from ..models.loader import load
    from . import bench as cli_bench

    check_options(block_size, max_tokens, window, sinks, draft_source=draft_source, temperature=temperature)
    kv = kv_settings(kv_bits, kv_group_size, quantized_kv_start)
    lengths = check_bench(repeats, num_prompts, dataset, prompt_tokens, score, score_timeout, score_unisolated,
                          json_out, plot_out, force)
    listed = cli_bench.listed_prompts(dataset, num_prompts)
    tgt, drafter, tokenizer = load(model, target, adapter_path=adapter_path)
    _before_decoding(window, sinks, block_size, drafter)
    conversations = cli_bench.bench_prompts(listed, lengths, dataset, num_prompts, tokenizer, tgt.max_positions)
    options = dict(max_tokens=max_tokens, block_size=block_size, draft_source=draft_source, window=window, sinks=sinks,
                   temperature=temperature, repeats=repeats, **kv)
    records, planned, interrupted = cli_bench.measure(err, tgt, drafter, tokenizer, conversations, **options)
    if interrupted and not records:
        err.print("[yellow]interrupted[/] before the first prompt was measured; nothing written")
        raise typer.Exit(130)
    console = Console(highlight=False, soft_wrap=True)  # long lines wrap instead of being cut
    report = cli_bench.report(model, target, dataset, drafter, records, planned, interrupted, options, console)
    lossless: Optional[bool] = True
    if score and distributed.is_main():  # after the gather: a Ctrl-C here stops this rank alone
        lossless = cli_bench.score(report, records, conversations, tokenizer, score_timeout, score_unisolated,
                                   temperature, console, err)
    cli_bench.write(report, json_out, plot_out)
    _end_bench(len(records), planned, interrupted, lossless, json_out, plot_out)


def _end_bench(measured: int, planned: int, interrupted: bool, lossless: Optional[bool], json_out: Optional[str],
               plot_out: Optional[str]) -> None:
    """Exit 130 after Ctrl-C (while measuring, or while testing: lossless None), saying what was kept and where;
    exit 1 when --score found different problems passing at temperature 0 (a bug)."""
    if interrupted or lossless is None:
        kept = " and ".join(p for p in (json_out, plot_out) if p)
        err.print(f"[yellow]interrupted:[/] measured {measured} of {planned} prompts"
                  + (f"; written to {escape(kept)}" if kept else ""), soft_wrap=True)
        raise typer.Exit(130)
    if not lossless:
        raise typer.Exit(1)


@app.command()
@user_errors
def train(
    target: str = typer.Argument(..., help="Target to train a drafter for: repo id or folder."),
    out: str = typer.Option(..., "--out", "-o", help="Folder for the drafter (z-lab layout) and its checkpoint."),
    prompts: Optional[str] = typer.Option(None, "--prompts", help="JSONL of prompts \\[default: built-in chat, code "
                                                                  "and math prompts]."),
    prompt_count: int = typer.Option(600, "--prompt-count", help="Built-in prompts to use (without --prompts)."),
    reply_tokens: int = typer.Option(128, "--reply-tokens", help="Longest reply the target writes per prompt."),
    layers: int = typer.Option(1, "--layers", help="Draft layers."),
    block_size: int = typer.Option(16, "--block-size", help="Block size to train for."),
    target_layer_ids: Optional[str] = typer.Option(None, "--target-layer-ids", help="Comma-separated target layers to read."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Training steps \\[default: 200]."),
    time_budget: Optional[str] = typer.Option(None, "--time", help="Training time instead of steps, e.g. 15m."),
    lr: float = typer.Option(6e-4, "--lr", help="Peak learning rate (AdamW, cosine, 4% warmup)."),
    batch_size: int = typer.Option(4, "--batch-size", help="Sequences per step."),
    resume: bool = typer.Option(False, "--resume", help="Continue from OUT's last checkpoint."),
) -> None:
    """Train a DFlash drafter for TARGET on the target's own outputs, on this machine."""
    if not distributed.is_main():  # it writes files and shards nothing: under mlx.launch rank 0 runs it alone
        return
    from ..training.train import train as run

    if steps is not None and time_budget is not None:
        raise DFlashError("pass --steps or --time, not both")
    ids = integers(target_layer_ids, "--target-layer-ids") if target_layer_ids else None
    budget = duration(time_budget) if time_budget else None
    with training_progress(err, budget) as show:
        try:
            result = run(target, out, prompts=prompts, prompt_count=prompt_count, response_tokens=reply_tokens,
                         layers=layers, block_size=block_size, target_layer_ids=ids,
                         steps=steps, time_budget=budget, lr=lr, batch_size=batch_size, resume=resume, progress=show)
        except KeyboardInterrupt:  # train() has checkpointed the last completed step, if training had begun
            _training_interrupted(out)
    Console(highlight=False).print(training_summary(result, block_size), soft_wrap=True)
    if note := looping_note(result):
        err.print(note, soft_wrap=True)


def _training_interrupted(out: str) -> NoReturn:
    """Say what Ctrl-C left (the checkpoint to --resume from, or nothing) and exit 130."""
    from pathlib import Path

    from ..training.train import CHECKPOINT, saved_step

    step = saved_step(out)
    if step is None:
        err.print("\n[yellow]interrupted[/] before the first training step; nothing was saved", soft_wrap=True)
    else:
        where = escape(str(Path(out).expanduser() / CHECKPOINT))
        err.print(f"\n[yellow]interrupted:[/] checkpoint of step {step} saved in {where}; "
                  "run the same command with --resume to continue", soft_wrap=True)
    raise typer.Exit(130)


@app.command()
@user_errors
def serve(
    model: Optional[str] = typer.Argument(None, help="Registry name, drafter repo/folder or bundle \\[default: fits this machine]."),
    target: Optional[str] = TARGET,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8080, "--port", help="TCP port."),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Require this key (Authorization: Bearer KEY, or x-api-key: KEY)."),
    block_size: Optional[int] = BLOCK_SIZE,
    draft_source: str = SOURCE,
    window: Optional[int] = WINDOW,
    sinks: int = SINKS,
    prefill_step_size: Optional[int] = PREFILL_STEP,
    chat_template: Optional[str] = TEMPLATE,
    chat_template_args: Optional[str] = typer.Option(
        None, "--chat-template-args", help="Keyword arguments for the chat template, as JSON, that a request's "
        "chat_template_kwargs add to or override: '{\"enable_thinking\": false}'."),
    adapter_path: Optional[str] = ADAPTER,
    kv_bits: Optional[int] = KV_BITS,
    kv_group_size: int = KV_GROUP,
    quantized_kv_start: int = KV_START,
    temperature: float = typer.Option(0.0, "--temp", help="Temperature of requests that set none (0: greedy)."),
    top_p: float = typer.Option(1.0, "--top-p", help="top_p of requests that set none."),
    top_k: int = typer.Option(0, "--top-k", help="top_k of requests that set none."),
    min_p: float = typer.Option(0.0, "--min-p", help="min_p of requests that set none."),
    max_tokens: int = typer.Option(4096, "--max-tokens", "-m", help="Token budget of requests that set none."),
    allowed_origins: Optional[str] = typer.Option(
        None, "--allowed-origins", help="CORS: comma-separated origins browser pages may call from ('*': any) \\[default: none]."),
    log_level: str = typer.Option("info", "--log-level", help="debug, info (a line per request), warning or error."),
    cache_entries: int = typer.Option(10, "--prompt-cache-size", help="Conversations' caches kept in memory."),
    cache_bytes: Optional[str] = typer.Option(
        None, "--prompt-cache-bytes", help="Memory cap of the kept caches, e.g. 8GB \\[default: a quarter of memory]."),
    cache_dir: Optional[str] = typer.Option(
        None, "--prompt-cache-dir", help="Keep the caches on disk too, here; a restart resumes from them \\[default: off]."),
    cache_disk_bytes: str = typer.Option("20GB", "--prompt-cache-disk-bytes", help="Size cap of --prompt-cache-dir."),
    keepalive: float = typer.Option(
        15.0, "--keepalive", help="Seconds of silence (queue, prefill) after which a stream carries a keep-alive."),
    max_batch: Optional[int] = typer.Option(
        None, "--max-batch", help="Requests decoded together, verified in one pass (1: one at a time, in order) "
        "\\[default: rows of 8k tokens in half the memory, at most 8]."),
) -> None:
    """Serve the pair over OpenAI's, Anthropic's and the Responses API (Claude Code, Codex, editors; tools, reasoning)."""
    from ..models.caches import KVQuantization
    from ..server.request import Defaults

    check_http_stack()
    from ..server import serve as run

    check_options(block_size, max_tokens, window, sinks, prefill_step_size, draft_source, temperature=temperature,
                  top_p=top_p, top_k=top_k, min_p=min_p)
    check_serving(port, keepalive, log_level, max_batch)
    kv = KVQuantization.of(**kv_settings(kv_bits, kv_group_size, quantized_kv_start))
    caches = prompt_caches(cache_entries, cache_bytes, cache_disk_bytes, cache_dir)
    model, engine = _engine(model, target, chat_template, adapter_path, caches, window, sinks, block_size,
                            draft_source=draft_source, kv=kv,
                            prefill_step_size=prefill_step_size, max_batch=max_batch,
                            defaults=Defaults(temperature, top_p, top_k, min_p, max_tokens, template_args(chat_template_args)))
    if not distributed.is_main():  # rank 0 listens and hands each request over
        engine.follow()
        return
    run(engine, host, port, api_key, allowed_origins=origins(allowed_origins), log_level=log_level, keepalive=keepalive,
        on_ready=lambda: err.print(serving_line(model, host, port), soft_wrap=True))
    err.print("stopped")


def _engine(model: Optional[str], target: Optional[str], chat_template: Optional[str], adapter_path: Optional[str],
            caches: dict[str, Any], window: Optional[int], sinks: int, block_size: Optional[int],
            **options: Any) -> tuple[str, Any]:
    """(name, engine): the pair loaded under a status line, its prompt caches capped at a quarter of memory
    unless --prompt-cache-bytes says otherwise or the target is sharded."""
    from ..decode.batch import default_max_batch
    from ..server import Engine
    from ..system import machine_description

    with err.status("loading the model"):
        model, tgt, drafter, tokenizer = load_model(model, target, chat_template, err, adapter_path)
    _before_decoding(window, sinks, block_size, drafter)
    if caches["cache_bytes"] is None and tgt.group is None:
        caches["cache_bytes"] = machine_description()["memory_bytes"] // 4
    if options["max_batch"] is None:
        options["max_batch"] = default_max_batch(tgt, machine_description()["memory_bytes"])
    return model, Engine(tgt, drafter, tokenizer, name=model, window=window, sinks=sinks, block_size=block_size,
                         **options, **caches)
