"""DFlash block-diffusion speculative decoding in pure MLX."""

from importlib.metadata import PackageNotFoundError, version

from .drafter import Drafter, load_drafter
from .errors import DFlashError
from .caches import DFlashCache, make_cache
from .generate import GenerationResponse, GenerationResult, generate, stream_generate
from .loader import load
from .target import Target

try:
    __version__ = version("dflash-mlx")
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
