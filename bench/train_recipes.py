"""Drafter training recipes at equal time, on the real pair's stored features (after `make pair`).

Each recipe trains a fresh drafter for ``--minutes`` of step time on the features ``make pair``
stored (bench/.cache/smollm2/draft: features.npy, data.json), with the training loop's own pieces
(``training.objective``), and says every ``--eval-every`` seconds how many tokens a block of its size
(16, or 8 for the block-8 recipes) would have had accepted, and how many within 7 drafted tokens (what a
block of 8 holds), teacher-forced, on 8 blocks of each of the 24 last sequences, which it never trains on,
and the same on 24 sequences it trains on (the gap is what the drafter memorised). No decoding: a recipe's
learning speed, not its speedup. ``--sequences N`` trains on the first N sequences only, to
weigh what more data is worth, or to see in minutes what an hour's dozens of passes over the data do
(memorising it: the noise recipes).

``--target-layers`` feeds the drafter other target layers than make pair's 14 and 29: their features are
computed once into bench/.cache/smollm2/features-<layers>/ (``training.features``).

    python bench/train_recipes.py [--minutes 8] [--recipes base,small-lr3-g3,wd0.1] [--target-layers 1,8,14,20,27]
                                  [--sequences 258]
"""

from __future__ import annotations

from common import CACHE, print_machine  # re-execs with OpenBLAS first

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402

from dflash_mlx.models.drafter import Blocks, Drafter, DrafterArgs  # noqa: E402
from dflash_mlx.models.loader import load_target  # noqa: E402
from dflash_mlx.models.target import Target  # noqa: E402
from dflash_mlx.training import objective  # noqa: E402
from dflash_mlx.training.data import training_sequences  # noqa: E402
from dflash_mlx.training.drafter_init import draft_config, init_from_target, pick_mask_token  # noqa: E402
from dflash_mlx.training.features import FeatureStore, feature_store  # noqa: E402

PAIR = CACHE / "smollm2"
LAYERS = [14, 29]  # make pair's feature layers
HELD_BACK = 24


@dataclass(frozen=True)
class Recipe:
    batch: int = 2  # sequences a step
    anchors: int = 16  # blocks a sequence
    lr: float = 3e-3  # peak learning rate
    gamma: float = 3.0  # position-weight decay
    from_target: bool = True  # the drafter's layer initialised from the target's
    weight_decay: float = 0.01  # AdamW's (MLX's default)
    layers: int = 1  # draft layers
    block: int = 16  # block size the drafter is trained for (and measured at)
    noise: float = 0.0  # noise on the target features, a share of their scale (objective.perturb_features)


RECIPES = {
    "base": Recipe(8, 32, 1e-3, 7.0),  # make pair's first recipe (the published gamma for blocks of 16)
    "small": Recipe(lr=1e-3, gamma=7.0),
    "small-lr3": Recipe(gamma=7.0),
    "small-rand": Recipe(gamma=7.0, from_target=False),
    "small-lr3-g3": Recipe(),  # make pair's recipe at block 16
    "mid-lr3-g3": Recipe(batch=4),
    "base-lr3-g3": Recipe(8, 32),
    "wd0.1": Recipe(weight_decay=0.1),
    "2-layers": Recipe(layers=2),
    "block8": Recipe(block=8),  # make pair's recipe
    "2-layers-block8": Recipe(layers=2, block=8),
    "block8-noise0.1": Recipe(block=8, noise=0.1),
    "block8-noise0.3": Recipe(block=8, noise=0.3),  # train's default noise
    "block8-noise0.6": Recipe(block=8, noise=0.6),
    "block8-noise1": Recipe(block=8, noise=1.0),
}


def run(name: str, target: Target, tokenizer, sequences, store: FeatureStore, minutes: float, every: float,
        trained_on: int) -> None:
    recipe = RECIPES[name]
    batch, anchors, lr, gamma = recipe.batch, recipe.anchors, recipe.lr, recipe.gamma
    name = name if target.layer_ids == LAYERS else f"{name} L{','.join(map(str, target.layer_ids))}"
    train = list(range(min(trained_on, len(sequences) - HELD_BACK)))
    held = list(range(len(sequences) - HELD_BACK, len(sequences)))
    mx.random.seed(0)
    drafter = Drafter(DrafterArgs.from_dict(draft_config(target, recipe.layers, recipe.block, target.layer_ids,
                                                         pick_mask_token(tokenizer, target))))
    if recipe.from_target:
        init_from_target(drafter, target)
    optimizer = optim.AdamW(learning_rate=lr, weight_decay=recipe.weight_decay)
    weights = objective.position_weights(recipe.block, gamma)
    head = objective.Head.of(target, [sequences[i] for i in train])
    loss_and_grad = nn.value_and_grad(drafter, lambda b: objective.block_loss(drafter, target, b, weights))

    def blocks(rows: list[int]) -> objective.Batch:
        return objective.make_batch(target, [sequences[i] for i in rows], [store[i] for i in rows],
                                    np.random.default_rng(123), 8, recipe.block, drafter.mask_token_id)

    held_back, seen = blocks(held), blocks(train[::max(1, len(train) // HELD_BACK)][:HELD_BACK])

    def accepted(check: objective.Batch) -> tuple[float, float, float]:
        """E[accepted] of a block, the same within 7 drafted tokens (what a block of 8 can hold), first right."""
        S, N, k = check.labels.shape
        h = drafter(check.embeddings, check.features, Blocks(check.anchors, check.features.shape[1], k + 1))
        right = np.array(mx.argmax(target.lm_head(h.reshape(S, N, k + 1, -1)[:, :, 1:].astype(target.dtype)), -1)
                         == check.labels)
        run = np.cumprod(right, axis=-1)
        return float(run.sum(-1).mean()), float(run[..., :7].sum(-1).mean()), float(right[..., 0].mean())

    spent, step, shown, losses = 0.0, 0, 0.0, []
    while spent < minutes * 60:
        tic = time.perf_counter()
        rng = np.random.default_rng([0, step])
        picks = rng.choice(train, size=batch, replace=False)
        b = objective.make_batch(target, [sequences[i] for i in picks], [store[i] for i in picks], rng, anchors,
                                 recipe.block, drafter.mask_token_id)
        b.columns = head.sample(rng, np.array(b.labels))
        b.features = objective.perturb_features(b.features, recipe.noise, len(target.layer_ids), mx.random.key(step))
        optimizer.learning_rate = objective.learning_rate(spent / (minutes * 60), lr)
        loss, grads = loss_and_grad(b)
        optimizer.update(drafter, optim.clip_grad_norm(grads, 1.0)[0])
        mx.eval(drafter.parameters(), optimizer.state, loss)
        losses.append(loss.item())
        spent += time.perf_counter() - tic
        step += 1
        if spent - shown >= every or spent >= minutes * 60:
            shown = spent
            e, within7, first = accepted(held_back)
            print(f"{name:>15} {spent / 60:5.1f} min  step {step:5d}  loss {np.mean(losses[-20:]):.3f}  "
                  f"E[accepted] {e:.3f} ({within7:.3f} within 7)  first position right {100 * first:.0f}%  "
                  f"(on trained sequences {accepted(seen)[0]:.3f})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=8.0, help="step time per recipe")
    parser.add_argument("--recipes", default="base,small-lr3,small-rand,small-lr3-g3",
                        help=f"comma-separated, of: {', '.join(RECIPES)}")
    parser.add_argument("--sequences", type=int, default=None,
                        help="train on the first N training sequences only (the data's worth) [default: all]")
    parser.add_argument("--eval-every", type=float, default=90.0, help="seconds of step time between measurements")
    parser.add_argument("--target-layers", default=",".join(map(str, LAYERS)),
                        help="comma-separated target layers feeding the drafter")
    args = parser.parse_args()
    try:
        layers = [int(x) for x in args.target_layers.split(",")]
    except ValueError:
        parser.error(f"--target-layers takes comma-separated layer numbers, got {args.target_layers!r}")
    names = args.recipes.split(",")
    if unknown := [n for n in names if n not in RECIPES]:
        parser.error(f"unknown recipe {', '.join(unknown)}")
    if not (PAIR / "draft" / "features.npy").is_file():
        parser.error("no stored features: run `make pair` first")
    print_machine()
    model, tokenizer = load_target(PAIR / "target")
    target = Target(model, layers)
    data, index = (json.loads((PAIR / "draft" / name).read_text()) for name in ("data.json", "features.json"))
    # the sequences make pair stored features of: those whose reply holds a block of the size it trained at
    sequences = next((s for b in (8, 16) if (s := training_sequences(data, b)) and
                      hashlib.sha256(json.dumps(s).encode()).hexdigest() == index["sequences"]), None)
    if sequences is None:
        parser.error("the stored features are of other sequences than make pair's: run `make pair` again")
    lengths = [len(p) + len(r) for p, r in sequences]
    if layers == LAYERS:
        store = FeatureStore(np.load(PAIR / "draft" / "features.npy", mmap_mode="r"), lengths)
    else:
        folder = PAIR / f"features-{'-'.join(map(str, layers))}"
        folder.mkdir(exist_ok=True)
        tic = time.perf_counter()
        store = feature_store(folder, target, sequences, {"pair": "smollm2"}, lambda e: None)
        print(f"features of layers {layers}: {time.perf_counter() - tic:.0f} s", flush=True)
    for name in names:
        run(name, target, tokenizer, sequences, store, args.minutes, args.eval_every,
            args.sequences or len(sequences))


if __name__ == "__main__":
    main()
