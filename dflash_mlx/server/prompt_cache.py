"""Many conversations' caches: in memory (an LRU within an entry count and a byte cap) and on disk.

An entry is a ``CacheState``: the target's caches, the drafter's context caches and its
pending features, and the history they hold, so drafting after a restore is what it
would have been without one. A request resumes from the entry with the longest usable
common prefix, whichever conversation made it: full-attention caches can go back to any
point of their history (a shared system prompt serves every conversation that starts
with it); a window ring or a recurrent state only to a point where an entry was taken,
so for those an entry is also kept where the prompt ends.

On disk (``serve --prompt-cache-dir``) an entry is one safetensors file, written in a
thread of its own after the request that made it (the next request does not wait) and
renamed into place whole. Its header names what it belongs to (``fingerprint``: the
target's and drafter's configs and weight files, read far enough to tell a rewrite from
the original, dtype and quantization, window, sinks, block size and this format's
version) and carries checksums of every array, of itself and of the token history; a
file that is truncated, corrupted, from another model or another version is ignored with
one log line, never loaded, and one whose caches still do not fit is dropped when a
request meets it (the request goes on cold). Files are read only when a request matches
them; the oldest go beyond a size cap. Several servers may share a folder: each writes
under a temporary name of its own, and only a temporary file nobody has written to for
``STALE_WRITE`` seconds (its writer died) is removed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import numpy as np

from ..decode.cache_files import FORMAT, TEMPORARY, is_temporary, read_header, read_state, write_state
from ..decode.transaction import CacheState, DFlashCache, common_prefix
from ..errors import DFlashError
from ..models.caches import rewindable_kinds

log = logging.getLogger("dflash_mlx.serve")

STALE_WRITE = 600  # seconds: a live writer's temporary file keeps growing; one untouched this long is a dead one's


def usable(tokens: list[int], rewindable: bool, ids: list[int]) -> int:
    """How many of ``ids`` a cache holding ``tokens`` serves (at least the last id must still run)."""
    common = common_prefix(tokens, ids)
    if rewindable:
        return min(common, len(ids) - 1)
    return len(tokens) if common == len(tokens) and len(tokens) < len(ids) else 0  # only where it was taken


@dataclass(eq=False)
class Entry:
    tokens: list[int]
    state: Optional[CacheState]  # None: on disk only, read when a request matches it
    rewindable: bool
    used: int = 0  # when last taken or kept (a counter), for the LRU
    path: Optional[Path] = None  # its file, once written
    disk_bytes: int = 0

    @property
    def nbytes(self) -> int:
        return self.state.nbytes if self.state is not None else 0


@dataclass(frozen=True)
class CacheLimits:
    """How much a server's prompt cache keeps (``serve --prompt-cache-*``)."""

    max_entries: int = 10
    max_bytes: Optional[int] = None  # memory cap over the entries' arrays; None: none
    directory: Optional[Path] = None  # the disk tier; None: memory only
    max_disk_bytes: Optional[int] = None


@dataclass
class PromptCache:
    """The entries a server resumes requests from, around the one ``DFlashCache`` it generates with."""

    cache: DFlashCache
    limits: CacheLimits = CacheLimits()
    fingerprint: Optional[str] = None  # the pair's and layout's (``cache_files.fingerprint``): needed on disk
    entries: list[Entry] = field(default_factory=list)
    directory: Optional[Path] = field(default=None, init=False)  # the disk tier: the limits' folder for the fingerprint
    _clock: int = 0
    _writes: Optional[queue.Queue] = field(default=None, repr=False)
    _writer: Optional[threading.Thread] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.limits.max_entries < 1:
            raise DFlashError(f"the prompt cache holds at least 1 entry, got {self.limits.max_entries}")
        if self.limits.directory is None:
            return
        if self.fingerprint is None:
            raise DFlashError("a prompt cache on disk needs the pair's fingerprint")
        self.directory = Path(self.limits.directory).expanduser() / f"v{FORMAT}-{self.fingerprint[:16]}"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DFlashError(f"cannot use {self.directory} for the prompt cache: {e.strerror or e}") from None
        _remove_dead_writes(self.directory)
        for path, stat in _files(self.directory):
            try:
                tokens, header = read_header(path, self.fingerprint)
            except (OSError, ValueError) as e:
                log.warning("prompt cache: ignoring %s: %s", path, e)
                continue
            rewindable = rewindable_kinds(kind for kind, _, _ in header["layout"]["target"])  # (the drafter follows)
            self.entries.append(Entry(tokens, None, rewindable, self._tick(), path, stat.st_size))
        self._writes = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="dflash-mlx prompt cache", daemon=True)
        self._writer.start()

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def prepare(self, ids: list[int], cache: Optional[DFlashCache] = None) -> Optional[Entry]:
        """Restore the entry that serves the most of ``ids`` into ``cache`` (the server's one by default), if it
        serves more than the cache does; the entry restored. One that does not restore is dropped (a log line) and
        the next best tried."""
        cache = self.cache if cache is None else cache
        self.entries = [e for e in self.entries if e.state is not None or e.path is not None]  # files trimmed away
        held = usable(cache.tokens, cache.rewindable, ids)
        for entry in sorted(self.entries, key=lambda e: (usable(e.tokens, e.rewindable, ids), e.used), reverse=True):
            if usable(entry.tokens, entry.rewindable, ids) <= held:
                return None
            state = entry.state if entry.state is not None else self._read(entry)
            if state is None:
                continue  # unreadable: dropped, try the next best
            try:
                cache.restore(state)
            except Exception as e:  # noqa: BLE001 (whatever a file that passed its checks still holds wrong)
                log.warning("prompt cache: dropping %s: %s", entry.path or "an entry", textwrap.shorten(str(e), 200, placeholder=" ..."))
                self._drop(entry)  # else every request sharing its prefix would fail on it again
                cache.reset()  # a restore that failed half-way leaves caches nobody can vouch for
                held = 0
                continue
            entry.used = self._tick()
            if entry.path is not None:
                _touch(entry.path)
            return entry
        return None

    def discard(self, entry: Optional[Entry], cache: DFlashCache) -> None:
        """A request failed on ``cache``, restored from ``entry``: the entry goes (its file too) and the cache starts
        over, so that neither serves another request."""
        if entry is not None and entry in self.entries:
            log.warning("prompt cache: dropping %s, which a request failed on", entry.path or "an entry")
            self._drop(entry)
        cache.reset()

    def prompt_done(self, cache: Optional[DFlashCache] = None) -> None:
        """The prompt is prefilled in ``cache`` (the server's one by default): an entry here, where a window or a
        recurrent state could not go back to."""
        cache = self.cache if cache is None else cache
        if not cache.rewindable:
            self.keep(cache)

    def keep(self, cache: Optional[DFlashCache] = None) -> None:
        """Take what ``cache`` (the server's one by default) holds now as an entry (the newest); write it to disk in
        the background."""
        cache = self.cache if cache is None else cache
        if not cache.tokens:
            return
        state = cache.snapshot()
        tokens = state.tokens
        superseded = [e for e in self.entries if e.tokens == tokens
                      or (state.rewindable and e.rewindable and tokens[: len(e.tokens)] == e.tokens)]
        for e in superseded:  # the new entry can go back to each of them
            self._drop(e)
        entry = Entry(tokens, state, state.rewindable, self._tick())
        self.entries.append(entry)
        self._evict()
        if self._writes is not None:
            mx.eval(state.arrays)
            self._writes.put((entry, state))

    def _evict(self) -> None:
        """Within both caps: the least recently used entries leave memory (a written one stays on disk)."""
        def over() -> bool:
            in_memory = [e for e in self.entries if e.state is not None]
            return len(in_memory) > self.limits.max_entries or (
                self.limits.max_bytes is not None and sum(e.nbytes for e in in_memory) > self.limits.max_bytes and len(in_memory) > 1)

        while over():
            oldest = min((e for e in self.entries if e.state is not None), key=lambda e: e.used)
            if oldest.path is not None:
                oldest.state = None
            else:
                self.entries.remove(oldest)

    def _drop(self, entry: Entry) -> None:
        self.entries.remove(entry)
        if entry.path is not None:
            entry.path.unlink(missing_ok=True)

    def _read(self, entry: Entry) -> Optional[CacheState]:
        try:
            state, _ = read_state(entry.path, self.fingerprint)
        except (OSError, ValueError) as e:
            log.warning("prompt cache: ignoring %s: %s", entry.path, e)
            self._drop(entry)
            return None
        entry.state = state
        self._evict()
        return state

    def _write_loop(self) -> None:
        """The writer thread: files only (the entries list is the main thread's; it reads ``path`` as set here)."""
        while (item := self._writes.get()) is not None:
            entry, state = item
            try:
                name = hashlib.sha256(np.asarray(entry.tokens, dtype="<i4").tobytes()).hexdigest()[:32]
                path = self.directory / f"{name}.safetensors"
                entry.disk_bytes = write_state(path, state, self.fingerprint)
                entry.path = path
                self._trim_disk(entry)
            except Exception as e:  # noqa: BLE001 (a full disk, a removed folder: the server goes on without it)
                log.warning("prompt cache: could not write an entry to %s: %s", self.directory, e)
            finally:
                self._writes.task_done()

    def _trim_disk(self, newest: Entry) -> None:
        """The oldest files go until the folder is within its cap (the newest stays, whatever its size)."""
        if self.limits.max_disk_bytes is None:
            return
        files = _files(self.directory)
        total = sum(stat.st_size for _, stat in files)
        for f, stat in files:
            if total <= self.limits.max_disk_bytes:
                break
            if f == newest.path:
                continue
            total -= stat.st_size
            f.unlink(missing_ok=True)
            for e in list(self.entries):
                if e.path == f:
                    e.path, e.disk_bytes = None, 0

    def flush(self) -> None:
        """Wait until every entry kept so far is on disk."""
        if self._writes is not None:
            self._writes.join()

    def close(self) -> None:
        if self._writes is not None:
            self._writes.put(None)
            self._writer.join(timeout=60)
            self._writes = None

    @property
    def newest(self) -> int:
        """Tokens of the entry kept or taken last (what the last request left), 0 when there is none."""
        return len(max(self.entries, key=lambda e: e.used).tokens) if self.entries else 0

    def stats(self) -> dict[str, Any]:
        in_memory = [e for e in self.entries if e.state is not None]
        on_disk = _files(self.directory) if self.directory is not None else []
        return {"entries": len(in_memory), "bytes": sum(e.nbytes for e in in_memory),
                "disk_entries": len(on_disk), "disk_bytes": sum(stat.st_size for _, stat in on_disk)}


def _files(directory: Path) -> list[tuple[Path, os.stat_result]]:
    """The folder's cache files with their stats, oldest first: no file still being written, and none that another
    server sharing the folder removed meanwhile."""
    found = []
    for path in directory.glob("*.safetensors"):
        if is_temporary(path):
            continue
        try:
            found.append((path, path.stat()))
        except OSError:
            continue
    return sorted(found, key=lambda f: f[1].st_mtime)


def _remove_dead_writes(directory: Path) -> None:
    """Temporary files whose writer died (a crash, a kill): untouched for ``STALE_WRITE`` seconds. Not by pid: on a
    folder shared over the network another machine's live writer has a pid that means nothing here."""
    for path in directory.glob(f"*{TEMPORARY}"):
        try:
            if is_temporary(path) and time.time() - path.stat().st_mtime > STALE_WRITE:
                path.unlink()
        except OSError:
            continue


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass
