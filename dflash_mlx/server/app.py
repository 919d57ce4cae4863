"""The HTTP side of ``serve``: the application over one engine (its handlers in ``routes``), and the lifecycle.

Starlette on uvicorn runs in a thread of its own; requests are parsed there (off the
event loop, so ``count_tokens``, ``/v1/models`` and keep-alives answer while a long prompt
is tokenized) and queued for the engine on the main thread. A streamed answer carries
the dialect's keep-alive whenever it would otherwise be silent for ``keepalive`` seconds:
clients drop a stream that says nothing for 300 s (Claude Code, Codex), some for 120 s,
and a long prefill or a wait in the queue can take that long on a laptop.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any, Callable, Optional

from ..errors import DFlashError
from . import anthropic_api, openai_api, responses_api
from .engine import Engine
from .request import Dialect

MAX_BODY_BYTES = 16 * 2**20  # agents send 50-80 kB; long conversations with tool output grow to megabytes
KEEPALIVE_SECONDS = 15.0
DIALECTS: tuple[Dialect, ...] = (openai_api.CHAT, openai_api.TEXT, anthropic_api.MESSAGES, responses_api.RESPONSES)
log = logging.getLogger("dflash_mlx.serve")


def create_app(engine: Engine, api_key: Optional[str] = None, max_body: int = MAX_BODY_BYTES,
               allowed_origins: tuple[str, ...] = (), keepalive: float = KEEPALIVE_SECONDS) -> Any:
    """The Starlette application over ``engine``: each dialect's routes, count_tokens, models, health and metrics."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware

    from .routes import Routes  # the HTTP stack is an extra: imported once a server is made

    routes = Routes(engine, DIALECTS, api_key, max_body, keepalive)
    middleware = [Middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                             allow_headers=["*"])] if allowed_origins else []
    return Starlette(routes=routes.table(), middleware=middleware, exception_handlers={HTTPException: routes.http_error})


def serve(engine: Engine, host: str, port: int, api_key: Optional[str] = None,
          on_ready: Callable[[], None] = lambda: None, allowed_origins: tuple[str, ...] = (),
          log_level: str = "info", keepalive: float = KEEPALIVE_SECONDS) -> None:
    """Listen on ``host:port`` in a thread and answer requests on this one, until Ctrl-C or SIGTERM.

    ``on_ready`` runs once the port is bound. A port in use (or an address that is
    not this machine's) is a one-line DFlashError; Ctrl-C stops cleanly, and so does
    SIGTERM (what launchd, systemd and `kill` send; a job a shell starts in the
    background ignores Ctrl-C's SIGINT), the prompt cache's pending writes finished.
    Each request logs one line on stderr at ``log_level`` info (and below).
    """
    import uvicorn

    logging.basicConfig(format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    log.setLevel(log_level.upper())
    app = create_app(engine, api_key=api_key, allowed_origins=allowed_origins, keepalive=keepalive)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                           timeout_graceful_shutdown=5))
    http = threading.Thread(target=server.run, name="dflash-mlx http", daemon=True)
    http.start()
    while not server.started and http.is_alive():
        time.sleep(0.05)
    if not server.started:  # uvicorn logs why (the port is taken, no such address) and gives up
        raise DFlashError(f"could not listen on {host}:{port} (in use, or not an address of this machine)")
    on_ready()
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        engine.run(serving=http.is_alive)
    except KeyboardInterrupt:  # the way to stop a server: not an error
        pass
    finally:
        server.should_exit = True
        http.join(timeout=10)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
