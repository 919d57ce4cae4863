"""`dflash-mlx serve`: OpenAI's, Anthropic's and the Responses API over one loaded pair, for chat apps, editors and
coding agents (Claude Code, Codex CLI, Qwen Code).

- ``engine``: the pair, its caches across requests, and the loop that runs them one at a time;
  ``batching``: the loop that runs many together (continuous batching, ``--max-batch``).
- ``request``: what a request asks for (``Completion``), whichever API it came through, and ``Dialect``.
- ``openai_api``, ``anthropic_api``, ``responses_api``: one module per API; a new one is one module and one
  entry in ``app.DIALECTS``.
- ``app``: the application and the server's lifecycle; ``routes``: the HTTP handlers, streams with keep-alives.
- ``prompt_cache``: many conversations' caches, in memory and on disk.
- ``replies``: a chat reply split into content, reasoning and tool calls as it streams.
"""

from .app import create_app, serve
from .engine import Engine

__all__ = ["Engine", "create_app", "serve"]
