"""One rank of a sharded run, for tests/test_distributed.py.

    mlx.launch -n 2 --backend ring -- python sharded_run.py DRAFT TARGET OUT PROMPT

Loads the pair through the public loader (the target sharded over the group),
decodes every case of ``CASES`` through the public API, and writes this rank's
tokens to ``OUT/rank{r}.json``, so the test can compare the ranks with each other
and with single-process decoding.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import dflash_mlx
from dflash_mlx import distributed

WINDOW = 24
MAX_TOKENS = 48
CASES = [
    {"block_size": 4},
    {"block_size": 16},
    {"block_size": None},  # adaptive: every rank must pick the same depths although each times its own cycles
    {"block_size": 4, "window": WINDOW},
    {"block_size": 16, "window": WINDOW},
    {"block_size": None, "window": WINDOW},
    {"block_size": None, "temperature": 1.0, "top_p": 0.9, "seed": 7},
    {"block_size": None, "temperature": 1.0},  # no seed: rank 0 draws one for all
]


def main() -> None:
    draft, target, out, prompt = sys.argv[1:5]
    tgt, drafter, tokenizer = dflash_mlx.load(draft, target)
    ids = tokenizer.encode(prompt)
    results = []
    for case in CASES:
        r = dflash_mlx.generate(tgt, drafter, tokenizer, ids, max_tokens=MAX_TOKENS, eos_token_ids=[], **case)
        results.append({"case": case, "tokens": r.tokens, "acceptance": r.acceptance, "drafted": r.drafted})
    size = 1 if tgt.group is None else tgt.group.size()
    Path(out, f"rank{distributed.rank()}.json").write_text(json.dumps({"size": size, "results": results}))


if __name__ == "__main__":
    main()
