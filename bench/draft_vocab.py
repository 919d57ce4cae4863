"""A drafter's own vocabulary against the target's whole one, on the real pair, side by side in one run.

The bundle's drafter is loaded twice: as exported (its head cut to its own vocabulary, ``models.vocabulary``) and
with the target's whole head. Every prompt of each dataset runs both, in alternating order, each against mlx-lm's
plain decoding of the same prompt, and what each drafts is compared teacher-forced on the target's own replies
(both as ``bench/side_by_side.py`` does). First it times one draft pass's head both ways.

    python bench/draft_vocab.py [--pair BUNDLE] [--datasets math,chat,code,edit] [--prompts 6] [--max-tokens 128]
                                [--rounds 1]
"""

from __future__ import annotations

from common import CACHE, median_time, print_machine  # re-execs with OpenBLAS first
from side_by_side import acceptance, prompt_options, speedups

import argparse  # noqa: E402
import sys  # noqa: E402

import mlx.core as mx  # noqa: E402

import dflash_mlx  # noqa: E402
from dflash_mlx.errors import DFlashError  # noqa: E402
from dflash_mlx.models.loader import cast_floats, load_drafter  # noqa: E402

PAIR = CACHE / "smollm2" / "bundle"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default=str(PAIR), help="a bundle whose drafter has its own vocabulary")
    prompt_options(parser, "math,chat,code,edit")
    args = parser.parse_args()
    print_machine()
    target, cut, tokenizer = dflash_mlx.load(args.pair)
    if cut.vocabulary is None:
        sys.exit(f"error: the drafter of {args.pair} drafts from the target's whole vocabulary (train it again, or "
                 "--resume its training, to export one with its own)")
    whole = load_drafter(cut.source)
    whole.update(cast_floats(whole.parameters(), target.dtype))
    whole.vocabulary, whole.context_window = None, cut.context_window
    drafters = {"whole": whole, "own": cut}
    print(f"pair: {args.pair}; the drafter's own vocabulary: {len(cut.vocabulary):,} of {target.vocab_size:,} tokens")

    h = mx.random.normal((cut.block_size - 1, target.hidden_size)).astype(target.dtype)
    heads = {name: median_time(lambda d=d: mx.eval(d.head_logits(target, h))) for name, d in drafters.items()}
    print(f"a draft pass's head ({cut.block_size - 1} rows): whole {heads['whole'] * 1e3:.2f} ms, "
          f"own {heads['own'] * 1e3:.2f} ms ({heads['whole'] / heads['own']:.1f}x)\n")

    datasets = args.datasets.split(",")
    acceptance(target, tokenizer, drafters, datasets, args.prompts, args.max_tokens)
    speedups(target, tokenizer, drafters, datasets, args.prompts, args.max_tokens, args.rounds)


if __name__ == "__main__":
    try:
        main()
    except DFlashError as e:  # a wrong path, a drafter that does not fit: one line
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
