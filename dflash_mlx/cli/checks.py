"""The command line's flag values, parsed and checked before gigabytes of weights load.

Each check raises DFlashError naming the flag, which the CLI prints as one line: a typo
costs a second, not the minutes of a download and a load.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from .. import distributed
from ..errors import DFlashError

if TYPE_CHECKING:
    from ..models.caches import KVQuantization
    from ..server.prompt_cache import CacheLimits


def check_options(block_size: Optional[int], max_tokens: int, window: Optional[int], sinks: int,
                  prefill_step_size: Optional[int] = None, draft_source: str = "auto",
                  draft_window: Optional[int] = None, **sampling: Any) -> None:
    """Fail on bad flag values before loading gigabytes of weights (the window against the drafter's block after)."""
    from ..decode.policy import check_source
    from ..decode.settings import check_draft_window
    from ..models.caches import check_window
    from ..sampling import Sampling

    check_source(draft_source)
    if block_size is not None and block_size < 1:
        raise DFlashError(f"--block-size must be >= 1, got {block_size}")
    if prefill_step_size is not None and prefill_step_size < 1:
        raise DFlashError(f"--prefill-step must be >= 1, got {prefill_step_size}")
    if max_tokens < 1:
        raise DFlashError(f"--max-tokens must be >= 1, got {max_tokens}")
    check_window(window, sinks, block_size or 1)
    check_draft_window(draft_window, block_size or 1)
    Sampling(**sampling)


def processing(repetition_penalty: Optional[float], repetition_context_size: int, presence_penalty: Optional[float],
               frequency_penalty: Optional[float], logit_bias: Optional[str]) -> dict[str, Any]:
    """mlx-lm's logits processors' settings from the flags (``make_logits_processors``' arguments), checked."""
    import json

    for flag, value in (("--presence-penalty", presence_penalty), ("--frequency-penalty", frequency_penalty)):
        if value is not None and not math.isfinite(value):
            raise DFlashError(f"{flag} must be a finite number, got {value}")
    if repetition_penalty is not None and not 0 < repetition_penalty < math.inf:
        raise DFlashError(f"--repetition-penalty must be above 0 (1 leaves the logits alone), got {repetition_penalty}")
    if repetition_context_size < 1:
        raise DFlashError(f"--repetition-context-size must be >= 1, got {repetition_context_size}")
    settings: dict[str, Any] = {"repetition_penalty": repetition_penalty,
                                "repetition_context_size": repetition_context_size,
                                "presence_penalty": presence_penalty, "frequency_penalty": frequency_penalty}
    if logit_bias is not None:
        try:
            settings["logit_bias"] = {int(k): float(v) for k, v in json.loads(logit_bias).items()}
        except (ValueError, TypeError, AttributeError):
            raise DFlashError(f"--logit-bias takes a JSON object of token ids to numbers, like '{{\"42\": -5}}', "
                              f"got {logit_bias!r}") from None
        if not all(math.isfinite(v) for v in settings["logit_bias"].values()):
            raise DFlashError(f"--logit-bias values must be finite numbers, got {logit_bias!r}")
    return {k: v for k, v in settings.items() if v is not None}


def kv_quantization(kv_bits: Optional[int], kv_group_size: int, quantized_kv_start: int) -> Optional[KVQuantization]:
    """--kv-bits, --kv-group-size and --quantized-kv-start, checked (None: off)."""
    from ..models.caches import KVQuantization

    kv = KVQuantization.of(kv_bits, kv_group_size, quantized_kv_start)
    if kv is not None:
        kv.check(set())  # the head size against the group once the target is loaded
    return kv


def template_args(text: Optional[str]) -> dict[str, Any]:
    """--chat-template-args: a JSON object of keyword arguments for the chat template (as mlx-lm's server)."""
    import json

    if text is None:
        return {}
    try:
        args = json.loads(text)
    except ValueError:
        args = None
    if not isinstance(args, dict):
        raise DFlashError(f"--chat-template-args takes a JSON object, like '{{\"enable_thinking\": false}}', got {text!r}")
    return args


def logits_processors(settings: dict[str, Any], vocab_size: int) -> Optional[list[Any]]:
    """The processors of checked ``processing`` settings, once the target's vocabulary is known (None: none set)."""
    from mlx_lm.sample_utils import make_logits_processors

    outside = [t for t in settings.get("logit_bias", {}) if not 0 <= t < vocab_size]
    if outside:
        raise DFlashError(f"--logit-bias: token {outside[0]} is outside the vocabulary (0-{vocab_size - 1})")
    return make_logits_processors(**settings) or None


def integers(text: str, flag: str, *, skip_blanks: bool = False) -> list[int]:
    """A comma-separated list of integers ('1024,4096,'); ``skip_blanks`` lets empty items pass."""
    try:
        return [int(x) for x in text.split(",") if x.strip() or not skip_blanks]
    except ValueError:
        raise DFlashError(f"{flag} takes comma-separated integers, got {text!r}") from None


def size(text: str, flag: str) -> int:
    """'8GB', '512MiB', '1.5G' or plain bytes, in bytes."""
    units = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
    value = text.strip().upper().removesuffix("B")
    number = value.rstrip("KMGTI")
    try:
        amount = float(number) * units[value[len(number):]]
    except (ValueError, KeyError):
        raise DFlashError(f"{flag} takes a size like 8GB, 512MiB or a number of bytes, got {text!r}") from None
    if not 0 < amount < math.inf:  # nan and 1e400 fail too
        raise DFlashError(f"{flag} must be a finite size above 0, got {text!r}")
    return int(amount)


def duration(text: str) -> float:
    """'90', '90s', '15m' or '1.5h' in seconds."""
    units = {"s": 1, "m": 60, "h": 3600}
    try:
        seconds = float(text[:-1]) * units[text[-1]] if text and text[-1] in units else float(text)
    except ValueError:
        raise DFlashError(f"--time takes a duration like 90s, 15m or 1.5h, got {text!r}") from None
    if not math.isfinite(seconds):
        raise DFlashError(f"--time must be a finite duration, got {text!r}")
    return seconds


def cache_folder(path: str) -> Path:
    """A folder for the prompt cache: made if missing, refused in one line if it cannot be written."""
    folder = Path(path).expanduser()
    if folder.exists() and not folder.is_dir():
        raise DFlashError(f"--prompt-cache-dir {path} is a file; give a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DFlashError(f"--prompt-cache-dir {path}: {e.strerror or e}") from None
    if not os.access(folder, os.W_OK):
        raise DFlashError(f"--prompt-cache-dir {path} is not writable")
    return folder


def check_http_stack() -> None:
    """serve's HTTP stack is an extra: say how to install it rather than fail on an import."""
    from ..system import install_hint

    try:
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise DFlashError(f"serve needs its HTTP stack: {install_hint('serve', 'starlette', 'uvicorn', 'prometheus-client')}"
                          ) from None


def check_serving(port: int, keepalive: float, log_level: str, max_batch: Optional[int],
                  api_key: Optional[str] = None) -> None:
    """serve's listening, access and batching flags."""
    from ..decode.batch import check_max_batch

    check_max_batch(max_batch)
    if api_key is not None and not api_key.strip():
        # What `--api-key "$KEY"` gives with KEY unset: serving without a key would be a silent surprise.
        raise DFlashError("--api-key is empty (an unset variable?): give the key, or leave the flag out to serve "
                          "without one")
    if not 0 < port < 65536:
        raise DFlashError(f"--port must be between 1 and 65535, got {port}")
    if not 0 < keepalive <= 3600:
        raise DFlashError(f"--keepalive must be between 0 and 3600 seconds, got {keepalive}")
    if log_level.lower() not in ("debug", "info", "warning", "error"):
        raise DFlashError(f"--log-level takes debug, info, warning or error, got {log_level!r}")


def origins(allowed: Optional[str]) -> tuple[str, ...]:
    """--allowed-origins as the CORS list; blanks between the commas are dropped."""
    return tuple(o.strip() for o in (allowed or "").split(",") if o.strip())


def prompt_caches(entries: int, memory: Optional[str], disk: str, folder: Optional[str]) -> CacheLimits:
    """serve's --prompt-cache-* flags; a memory cap of None is decided once the target loads."""
    from ..server.prompt_cache import CacheLimits

    if entries < 1:
        raise DFlashError(f"--prompt-cache-size must be >= 1, got {entries}")
    return CacheLimits(entries, size(memory, "--prompt-cache-bytes") if memory else None,
                       cache_folder(folder) if folder is not None else None, size(disk, "--prompt-cache-disk-bytes"))


def check_bench(repeats: int, num_prompts: int, dataset: str, prompt_tokens: Optional[str], score: bool,
                score_timeout: float, score_unisolated: bool, json_out: Optional[str], plot_out: Optional[str],
                force: bool) -> Optional[list[int]]:
    """bench's flags, the sandbox --score needs and the files it would replace: the --prompt-tokens lengths."""
    from ..eval.report import check_outputs, require_matplotlib
    from ..eval.score import confinement

    if repeats < 1 or num_prompts < 1:
        raise DFlashError("--repeats and --num-prompts must be >= 1")
    if score and (dataset not in ("humaneval", "mbpp") or prompt_tokens):
        raise DFlashError("--score needs --dataset humaneval or mbpp (their prompts carry tests), without --prompt-tokens")
    if score_timeout <= 0:
        raise DFlashError(f"--score-timeout must be above 0, got {score_timeout:g}")
    if score and distributed.is_main():  # the only rank that runs the programs
        confinement(score_unisolated)  # refuses before minutes of decoding
    if distributed.is_main():  # the only rank that writes
        check_outputs({"--json": json_out, "--plot": plot_out}, force)
    if plot_out:
        require_matplotlib()
    return integers(prompt_tokens, "--prompt-tokens", skip_blanks=True) if prompt_tokens else None
