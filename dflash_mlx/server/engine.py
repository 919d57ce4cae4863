"""The loaded pair, its caches across requests, and the queue of requests the runner answers.

Requests wait in arrival order and run on the main thread, where the model was loaded; the
HTTP server runs in a thread of its own and hands each request over as a ``Job`` (``jobs``).
``runner.Runner`` answers them, up to ``max_batch`` together. A client that disconnects cancels
its request at the next cycle (or prefill chunk): its cycle in flight is abandoned, so the
caches stay valid and the next request reuses the prompt they hold.
"""

from __future__ import annotations

import queue
from typing import Any, Callable, Optional

from ..decode.batch import Batch, check_max_batch
from ..decode.cache_files import fingerprint
from ..decode.settings import DecodeSettings
from ..decode.transaction import DFlashCache
from ..errors import DFlashError
from .jobs import Job
from .metrics import Metrics
from .prompt_cache import CacheLimits, PromptCache
from .request import Defaults
from .runner import Runner


class Engine:
    """The loaded pair, its caches across requests, and the queue of requests.

    ``run`` is called on the main thread (the HTTP server runs in another): MLX work
    stays on the thread that loaded the model, and Ctrl-C lands in the cycle it
    interrupts, which is abandoned as any interrupted generation's is.
    """

    def __init__(self, target: Any, drafter: Any, tokenizer: Any, name: str,
                 decoding: DecodeSettings = DecodeSettings(), defaults: Defaults = Defaults(),
                 limits: CacheLimits = CacheLimits(), max_batch: int = 1):
        self.target, self.drafter, self.tokenizer, self.name = target, drafter, tokenizer, name
        self.decoding, self.defaults = decoding, defaults
        cache = DFlashCache.empty(target, drafter, decoding.layout)
        if target.group is not None and (limits.directory is not None or limits.max_bytes is not None):
            # Every rank must choose the same entry: by count alone (a rank's bytes are its share's).
            raise DFlashError("a sharded target keeps its prompt cache by entry count only: drop --prompt-cache-dir "
                              "and --prompt-cache-bytes under mlx.launch")
        print_ = fingerprint(target, drafter, cache.layout) if limits.directory is not None else None
        self.store = PromptCache(cache, limits, print_)
        check_max_batch(max_batch)
        # Rows share a pass only where every layer is full attention, without a window, on one machine.
        self.max_batch = max_batch if Batch.fits(target, cache) else 1
        self.runner: Optional[Runner] = None  # the loop, while it runs
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.cancelled = 0  # requests whose client left before they finished
        self.metrics = Metrics()

    def run(self, serving: Callable[[], bool]) -> None:
        """Answer queued requests while ``serving()`` holds (rank 0 of a sharded target, or the only process)."""
        self.runner = Runner(self)
        try:
            self.runner.run(serving)
        finally:
            self.store.close()  # what was kept is on disk before the process ends

    def follow(self) -> None:
        """Ranks > 0 of a sharded target: run the requests rank 0 hands over, until it stops."""
        Runner(self).follow()

    @property
    def cache(self) -> Any:
        """The caches requests generate with one at a time (the prompt cache restores entries into it)."""
        return self.store.cache
