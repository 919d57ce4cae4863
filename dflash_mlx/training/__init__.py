"""Training a drafter for a target: the corpus and its replies (``data``, ``prompts``), the target's features kept
on disk (``features``), the new drafter's first weights (``drafter_init``), what a step optimizes (``objective``)
and the loop (``train``).

Builds on ``eval`` (degenerate replies are found as the benchmarks find them), ``decode`` and ``models``.
"""
