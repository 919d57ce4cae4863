"""``dflash-mlx train``: a drafter trained for a target on this machine, with progress and a resumable checkpoint."""

from __future__ import annotations

from typing import NoReturn, Optional

import typer
from rich.console import Console
from rich.markup import escape

from .. import distributed
from ..errors import DFlashError
from ..models.vocabulary import DRAFT_VOCAB
from ..training.objective import FEATURE_NOISE
from .app import err, user_errors
from .checks import duration, integers
from .output import looping_note, training_summary
from .progress import training_progress


@user_errors
def train(
    target: str = typer.Argument(..., help="Target to train a drafter for: repo id or folder."),
    out: str = typer.Option(..., "--out", "-o", help="Folder for the drafter (z-lab layout) and its checkpoint."),
    prompts: Optional[str] = typer.Option(None, "--prompts", help="JSONL of prompts \\[default: built-in chat, code "
                                                                  "and math prompts]."),
    prompt_count: int = typer.Option(600, "--prompt-count", help="Built-in prompts to use (without --prompts)."),
    reply_tokens: int = typer.Option(128, "--reply-tokens", help="Longest reply the target writes per prompt."),
    layers: int = typer.Option(1, "--layers", help="Draft layers."),
    block_size: int = typer.Option(8, "--block-size", help="Block size to train for (copies still fill 16)."),
    target_layer_ids: Optional[str] = typer.Option(None, "--target-layer-ids", help="Comma-separated target layers to read."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Training steps \\[default: 200]."),
    time_budget: Optional[str] = typer.Option(None, "--time", help="Training time instead of steps, e.g. 15m."),
    lr: float = typer.Option(3e-3, "--lr", help="Peak learning rate (AdamW, cosine, 4% warmup)."),
    batch_size: int = typer.Option(2, "--batch-size", help="Sequences per step."),
    blocks: int = typer.Option(16, "--blocks", help="Blocks cut from each sequence a step."),
    loss_gamma: Optional[float] = typer.Option(None, "--loss-gamma", help="Decay of the loss's weights over block "
                                               "positions, exp(-(k-1)/gamma) \\[default: 7 at block 16, 4 at 8]."),
    feature_noise: float = typer.Option(FEATURE_NOISE, "--feature-noise", help="Noise on the target's features "
                                        "as a share of their scale, against memorising the replies (0: none)."),
    draft_vocab: int = typer.Option(DRAFT_VOCAB, "--draft-vocab", help="Most tokens the drafter drafts from, the "
                                    "most frequent of its replies: a smaller head (0: the target's whole vocabulary)."),
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
                         steps=steps, time_budget=budget, lr=lr, batch_size=batch_size, anchors=blocks,
                         loss_gamma=loss_gamma, feature_noise=feature_noise, draft_vocab=draft_vocab,
                         resume=resume, progress=show)
        except KeyboardInterrupt:  # train() has checkpointed the last completed step, if training had begun
            _training_interrupted(out)
    Console(highlight=False).print(training_summary(result, block_size), soft_wrap=True)
    if note := looping_note(result):
        err.print(note, soft_wrap=True)


def _training_interrupted(out: str) -> NoReturn:
    """Say what Ctrl-C left (the checkpoint to --resume from, the replies so far, or nothing) and exit 130."""
    from pathlib import Path

    from ..training.data import DATA, replies_kept
    from ..training.train import CHECKPOINT, saved_step

    folder = Path(out).expanduser()
    step = saved_step(out)
    if step is None and (replies := replies_kept(folder)):
        err.print(f"\n[yellow]interrupted[/] before the first training step; the target's {replies} replies so far "
                  f"are kept in {escape(str(folder / DATA))}: the same command goes on from them", soft_wrap=True)
    elif step is None:
        err.print("\n[yellow]interrupted[/] before the first training step; nothing was saved", soft_wrap=True)
    else:
        where = escape(str(folder / CHECKPOINT))
        err.print(f"\n[yellow]interrupted:[/] checkpoint of step {step} saved in {where}; "
                  "run the same command with --resume to continue", soft_wrap=True)
    raise typer.Exit(130)
