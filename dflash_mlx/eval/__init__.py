"""Measuring and judging: paired benchmarks (``bench``) over prompt sets (``prompts``), their report, pass@1 in a
sandbox, the self-test, and the replay lab (``traces`` recorded, ``replay`` judged).

Builds on ``decode`` and ``models``.
"""
