"""DFlash block-diffusion speculative decoding in pure MLX.

The library's face: ``load`` a pair, then ``generate``/``stream_generate`` one prompt or ``batch_generate`` many.
The packages below it, lowest first: the shared modules here (errors, files, system, sampling, distributed,
chat_template), ``models``, ``decode``, ``eval``, ``training``, ``server``, ``cli``; each imports only those
before it (``tests/test_layers.py`` checks).
"""

from importlib.metadata import PackageNotFoundError, version

from .decode.generate import batch_generate, generate, stream_generate
from .decode.responses import GenerationResponse, GenerationResult
from .decode.transaction import DFlashCache, make_cache
from .errors import DFlashError
from .models.drafter import Drafter
from .models.loader import load, load_drafter
from .models.target import Target
from .system import DISTRIBUTION

try:
    __version__ = version(DISTRIBUTION)
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0"

__all__ = [
    "DFlashCache",
    "DFlashError",
    "Drafter",
    "GenerationResponse",
    "GenerationResult",
    "Target",
    "__version__",
    "batch_generate",
    "generate",
    "load",
    "load_drafter",
    "make_cache",
    "stream_generate",
]
