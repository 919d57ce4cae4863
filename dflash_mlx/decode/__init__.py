"""The decode loop and what it decides: one generation (``generate``), rows together (``batch``), how deep to draft
(``policy``, ``repeats``), stops, the responses it hands back, and caches kept as files.

Builds on ``models``; knows nothing of benchmarks, training, the server or the command line.
"""
