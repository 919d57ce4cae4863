"""The one error type users see."""


class DFlashError(Exception):
    """A problem with the user's input or files.

    The CLI prints its message as a single line and exits with status 2, so the
    message must name the problem and, where possible, the fix.
    """


class DownloadError(DFlashError):
    """A model could not be fetched from the Hugging Face Hub (offline, or no such repo)."""
