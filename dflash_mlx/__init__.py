"""DFlash block-diffusion speculative decoding in pure MLX."""

from importlib.metadata import PackageNotFoundError, version

from .caches import DFlashCache, make_cache
from .drafter import Drafter
from .errors import DFlashError
from .generate import generate, stream_generate
from .responses import GenerationResponse, GenerationResult
from .loader import load, load_drafter
from .system import DISTRIBUTION
from .target import Target

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
    "generate",
    "load",
    "load_drafter",
    "make_cache",
    "stream_generate",
]
