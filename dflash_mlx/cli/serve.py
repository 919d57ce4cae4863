"""``dflash-mlx serve``: the pair loaded once, behind the HTTP APIs of ``dflash_mlx.server``."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional

import typer

from .. import distributed
from .app import before_decoding, err, user_errors, warn
from .checks import check_http_stack, check_serving, origins, prompt_caches, template_args
from .options import ADAPTER, PREFILL_STEP, TARGET, TEMPLATE, CacheFlags, shared
from .output import serving_line
from .pairs import load_model

if TYPE_CHECKING:
    from ..decode.settings import DecodeSettings
    from ..server.prompt_cache import CacheLimits
    from ..server.request import Defaults


@user_errors
@shared
def serve(
    model: Optional[str] = typer.Argument(None, help="Registry name, drafter repo/folder or bundle \\[default: fits this machine]."),
    target: Optional[str] = TARGET,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8080, "--port", help="TCP port."),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Require this key (Authorization: Bearer KEY, or x-api-key: KEY)."),
    cache: CacheFlags = ...,
    prefill_step_size: Optional[int] = PREFILL_STEP,
    chat_template: Optional[str] = TEMPLATE,
    chat_template_args: Optional[str] = typer.Option(
        None, "--chat-template-args", help="Keyword arguments for the chat template, as JSON, that a request's "
        "chat_template_kwargs add to or override: '{\"enable_thinking\": false}'."),
    adapter_path: Optional[str] = ADAPTER,
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
    from ..server.request import Defaults

    check_http_stack()
    from ..server import serve as run

    cache.check(max_tokens, prefill_step_size, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
    check_serving(port, keepalive, log_level, max_batch, api_key)
    decoding = cache.decoding(prefill_step_size)
    limits = prompt_caches(cache_entries, cache_bytes, cache_disk_bytes, cache_dir)
    defaults = Defaults(temperature, top_p, top_k, min_p, max_tokens, template_args(chat_template_args))
    model, engine = _engine(model, target, chat_template, adapter_path, decoding, defaults, limits, max_batch)
    if not distributed.is_main():  # rank 0 listens and hands each request over
        engine.follow()
        return
    run(engine, host, port, api_key, allowed_origins=origins(allowed_origins), log_level=log_level, keepalive=keepalive,
        on_ready=lambda: err.print(serving_line(model, host, port), soft_wrap=True))
    err.print("stopped")


def _engine(model: Optional[str], target: Optional[str], chat_template: Optional[str], adapter_path: Optional[str],
            decoding: DecodeSettings, defaults: Defaults, limits: CacheLimits, max_batch: Optional[int],
            ) -> tuple[str, Any]:
    """(name, engine): the pair loaded under a status line, its prompt caches capped at a quarter of memory
    unless --prompt-cache-bytes says otherwise or the target is sharded."""
    from ..decode.batch import default_max_batch
    from ..server import Engine
    from ..system import machine_description

    with err.status("loading the model"):
        model, tgt, drafter, tokenizer = load_model(model, target, chat_template, err, adapter_path)
    layout = decoding.layout
    before_decoding(layout, tgt, drafter)
    if limits.max_bytes is None and tgt.group is None:
        limits = dataclasses.replace(limits, max_bytes=machine_description()["memory_bytes"] // 4)
    rows = default_max_batch(tgt, machine_description()["memory_bytes"]) if max_batch is None else max_batch
    engine = Engine(tgt, drafter, tokenizer, model, decoding, defaults, limits, rows)
    if max_batch is not None and max_batch > 1 and engine.max_batch == 1:
        why = ("--window" if layout.window is not None else "--kv-bits" if layout.kv is not None
               else "a target sharded over machines" if tgt.group is not None
               else f"this {tgt.model_type} target's architecture")
        warn(f"--max-batch {max_batch}: requests run one at a time: {why} keeps rows from sharing a pass")
    return model, engine
