"""What is loaded and run: the target adapter, the drafters, their layer caches, and the files they come from.

Imports only the shared modules at the package's top (errors, files, system, sampling, distributed,
chat_template); everything above builds on it.
"""
