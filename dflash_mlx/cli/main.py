"""The ``dflash-mlx`` command line: a thin layer over the library API.

Each command checks its flags (checks), loads MODEL (pairs), runs the library and
prints what it did (output, progress; the chat loop in chat, bench's steps in bench).
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
from typing import TYPE_CHECKING, Any, Iterator, Optional

import typer
from rich.console import Console
from rich.markup import escape

from .. import distributed
from ..errors import DFlashError
from .app import app, before_decoding, err, user_errors
from .checks import check_bench
from .options import ADAPTER, MAX_TOKENS, PREFILL_STEP, TARGET, TEMP, CacheFlags, ModelFlags, SamplingFlags, shared
from .output import generation_json, generation_stats, print_machine, print_models, print_selftest, rank_peaks
from .pairs import bundle_manifests, load_model, pair_rows, thinking_mismatch
from .progress import prefill_progress
from .serve import serve
from .train import train

if TYPE_CHECKING:
    from ..decode.generate import GenerationResponse
    from ..decode.settings import DecodeSettings, RequestSettings

@app.command()
@user_errors
@shared
def generate(
    draft: str = typer.Argument(..., help="Drafter: registry name, Hub repo id, drafter folder or converted bundle."),
    model: ModelFlags = ...,
    prompt: str = typer.Option(..., "--prompt", "-p", help="The prompt ('-' reads stdin)."),
    max_tokens: int = MAX_TOKENS,
    cache: CacheFlags = ...,
    prefill_step_size: Optional[int] = PREFILL_STEP,
    sampling: SamplingFlags = ...,
    raw: bool = typer.Option(False, "--no-chat-template", help="Send the prompt as raw text, without the chat template."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of text."),
) -> None:
    """Generate a reply to one prompt, losslessly, with DFlash speculative decoding."""
    from ..chat_template import encode_prompt, has_chat_template, render, user
    from ..decode.generate import check_context

    cache.check(max_tokens, prefill_step_size)
    decoding = cache.decoding(prefill_step_size)
    if raw and model.chat_template is not None:
        raise DFlashError("--chat-template and --no-chat-template contradict each other: pass one")
    if prompt == "-":
        prompt = sys.stdin.read()
    _, tgt, drafter, tokenizer = load_model(draft, model.target, model.chat_template, err, model.adapter_path)
    before_decoding(decoding.layout, tgt, drafter)
    chat = not raw and has_chat_template(tokenizer)
    ids = (render(tokenizer, user(prompt), template_kwargs=model.template_kwargs) if chat
           else encode_prompt(tokenizer, prompt))
    if (budget := check_context(tgt.max_positions, len(ids), max_tokens)) < max_tokens:
        err.print(f"[dim]note: the prompt ({len(ids)} tokens) leaves {budget} of the model's {tgt.max_positions} "
                  "positions: the reply stops at the end of them[/]", soft_wrap=True)
    responses, stopped = _stream(tgt, drafter, tokenizer, ids, as_json, decoding,
                                 sampling.request(max_tokens, tgt.vocab_size))
    _end_generation(responses, stopped, as_json)


def _stream(tgt: Any, drafter: Any, tokenizer: Any, ids: list[int], as_json: bool, decoding: DecodeSettings,
            asked: RequestSettings) -> tuple[list[GenerationResponse], Optional[int]]:
    """(responses, the exit code of an interruption or None): the text printed as it comes unless --json; Ctrl-C
    and SIGTERM keep what was generated."""
    from ..decode.generate import run, setup

    responses: list[GenerationResponse] = []
    try:
        with prefill_progress(err) as progress, _terminate_as_interrupt():
            for response in run(setup(tgt, drafter, tokenizer, ids, decoding, asked), tgt, progress):
                responses.append(response)
                if not as_json:
                    sys.stdout.write(response.text)
                    sys.stdout.flush()
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
    draft_window: Optional[int] = typer.Option(None, "--draft-window", help="The drafter context window the bundle "
                                               "decodes with unless a command says otherwise (0: all) \\[default: "
                                               "this version's]."),
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
                   draft_quantize=draft_quantize, quantize_fc=quantize_fc, force=force, log=status.update,
                   draft_window=draft_window)
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
@shared
def chat(
    model: Optional[str] = typer.Argument(None, help="Registry name, drafter repo/folder or bundle \\[default: fits this machine]."),
    pair: ModelFlags = ...,
    cache: CacheFlags = ...,
    sampling: SamplingFlags = ...,
    max_tokens: int = typer.Option(1024, "--max-tokens", "-m", help="Most tokens per reply."),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt."),
    think: Optional[bool] = typer.Option(None, "--think/--no-think", help="The chat template's thinking mode."),
) -> None:
    """Chat interactively; each turn prefills only the new message. Pipe lines in to script it."""
    from ..decode.chat import ChatSession
    from .chat import converse

    cache.check(max_tokens)
    decoding = cache.decoding()
    model, tgt, drafter, tokenizer = load_model(model, pair.target, pair.chat_template, err, pair.adapter_path)
    if warning := thinking_mismatch(model, think):
        err.print(f"[yellow]warning:[/] {warning}")
    before_decoding(decoding.layout, tgt, drafter)
    session = ChatSession(tgt, drafter, tokenizer, system=system, think=think, decoding=decoding,
                          asked=sampling.request(max_tokens, tgt.vocab_size), template_args=pair.template_kwargs)
    converse(session, model, err)


@app.command()
@user_errors
@shared
def bench(
    model: str = typer.Argument(..., help="Registry name, drafter repo/folder or bundle."),
    target: Optional[str] = TARGET,
    cache: CacheFlags = ...,
    prompt_tokens: Optional[str] = typer.Option(None, "--prompt-tokens", help="Context sweep: prompt lengths, e.g. 1024,4096,8192."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-m", help="Tokens to decode per prompt."),
    dataset: str = typer.Option("all", "--dataset", help="math, code, chat, all (built in: the three interleaved), edit (a file asked back with one change), gsm8k, math500, humaneval, mbpp, mt-bench, or FILE.jsonl."),
    num_prompts: int = typer.Option(12, "--num-prompts", help="Most prompts to run."),
    temperature: float = TEMP,
    adapter_path: Optional[str] = ADAPTER,
    repeats: int = typer.Option(1, "--repeats", help="Runs per prompt; the order of the two paths alternates."),
    json_out: Optional[str] = typer.Option(None, "--json", help="Write every figure, the machine and versions here."),
    plot_out: Optional[str] = typer.Option(None, "--plot", help="Write speedup and tau vs context and the acceptance histogram (PNG)."),
    force: bool = typer.Option(False, "--force", help="Replace existing --json and --plot files."),
    score: bool = typer.Option(False, "--score", help="HumanEval/MBPP: run each completion's tests and report pass@1, "
                               "plain and dflash. This EXECUTES MODEL-WRITTEN CODE on this machine, each program in the "
                               "operating system's sandbox (bubblewrap or unshare, sandbox-exec): no network, no "
                               "writes outside an empty folder, a timeout; docs/commands.md says what remains)."),
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

    cache.check(max_tokens, temperature=temperature)
    layout = cache.layout()
    lengths = check_bench(repeats, num_prompts, dataset, prompt_tokens, score, score_timeout, score_unisolated,
                          json_out, plot_out, force)
    listed = cli_bench.listed_prompts(dataset, num_prompts)
    tgt, drafter, tokenizer = load(model, target, adapter_path=adapter_path)
    before_decoding(layout, tgt, drafter)
    conversations = cli_bench.bench_prompts(listed, lengths, dataset, num_prompts, tokenizer, tgt.max_positions)
    options = dict(max_tokens=max_tokens, block_size=cache.block_size, draft_source=cache.draft_source,
                   window=cache.window, sinks=cache.sinks, draft_window=cache.draft_window, temperature=temperature,
                   repeats=repeats, **(layout.kv.keywords() if layout.kv is not None else {}))
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


# Registered last, so that --help lists them last.
app.command()(train)
app.command()(serve)
