"""The prompt cache: many conversations in memory and on disk, lossless, and never the wrong model's caches."""

from __future__ import annotations

import base64
import json
import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx2 as httpx
import mlx.core as mx
import numpy as np
import pytest
from helpers import finish, start_server

from dflash_mlx import DFlashError, generate, load, make_cache
from dflash_mlx.chat_template import render
from dflash_mlx.decode import cache_files
from dflash_mlx.decode.cache_files import (
    FORMAT,
    TEMPORARY,
    fingerprint,
    is_temporary,
    read_header,
    read_state,
    write_state,
)
from dflash_mlx.decode.settings import CacheLayout
from dflash_mlx.models import fixtures
from dflash_mlx.server.prompt_cache import STALE_WRITE, CacheLimits, PromptCache

SYSTEM = {"A": "You are the first assistant. " * 40, "B": "You are the second assistant. " * 40}
# Every kind of target cache: full attention, a window over it, GatedDeltaNet states, sliding layers (Gemma 3), a
# layer of a recurrent state and attention (Falcon-H1's CacheList), short-convolution states saved and replayed (LFM2).
LAYOUTS = {"full": ("qwen3", None), "window": ("qwen3", 48), "hybrid": ("qwen3_5", None),
           "sliding": ("gemma3_text", None), "group": ("falcon_h1", None), "replayed": ("lfm2", None)}
BLOCK = 8  # full blocks: every cycle drafts the same, so runs compare cycle by cycle


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """A pair for each of ``LAYOUTS``, each with its window setting."""
    root = tmp_path_factory.mktemp("layouts")
    pairs = {}
    for name, (model_type, window) in LAYOUTS.items():
        folder = root / model_type
        if not folder.exists():
            config = fixtures.target_config(model_type)
            fixtures.write_target(folder / "target", config)
            fixtures.write_drafter(folder / "draft", fixtures.drafter_config(config, 1, target_layer_ids=[1]))
        pairs[name] = (*load(str(folder / "draft"), str(folder / "target")), window, folder)
    return pairs


def _store(pair, directory=None, **caps) -> PromptCache:
    target, drafter, _, window, _ = pair
    print_ = fingerprint(target, drafter, CacheLayout(window, 0, BLOCK)) if directory is not None else None
    return PromptCache(make_cache(target, drafter, window, 0, BLOCK), CacheLimits(directory=directory, **caps), print_)


def _ask(pair, store: PromptCache, messages, responses=None):
    """One request as the server runs it: resume from the best entry, keep entries where the prompt ends and after."""
    target, drafter, tokenizer, window, _ = pair
    ids = render(tokenizer, messages)
    store.prepare(ids)
    out = generate(target, drafter, tokenizer, ids, max_tokens=12, window=window, cache=store.cache, block_size=BLOCK,
                   on_response=responses.append if responses is not None else None,
                   prompt_progress_callback=lambda done, total: done == total and store.prompt_done())
    store.keep()
    return ids, out


def _conversation(name: str, turns: int, replies: dict) -> list[dict]:
    messages = [{"role": "system", "content": SYSTEM[name]}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"question {turn} for {name}"})
        if turn < turns - 1:
            messages.append({"role": "assistant", "content": replies[name, turn]})
    return messages


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_alternating_conversations_resume_and_stay_lossless(layouts, layout):
    """A1, B1, A2, B2: turn 2 of each resumes from its own turn 1 (the full prompt, where only the prompt's end
    can be returned to), and every reply equals generation without a cache."""
    pair = layouts[layout]
    target, drafter, tokenizer, window, _ = pair
    store, replies = _store(pair), {}
    for turn in range(2):
        for name in "AB":
            messages = _conversation(name, turn + 1, replies)
            ids, out = _ask(pair, store, messages)
            assert out.tokens == generate(target, drafter, tokenizer, ids, max_tokens=12, window=window,
                                          block_size=BLOCK).tokens
            replies[name, turn] = out.text
            if turn == 1:
                first = render(tokenizer, _conversation(name, 1, replies))
                assert out.prompt_cached >= len(first), (layout, name, out.prompt_cached, len(first))
            store.cache.check()


def test_a_shared_system_prompt_serves_a_new_conversation(layouts):
    """Full attention goes back to any point: B's first turn starts from A's caches where they agree."""
    pair = layouts["full"]
    tokenizer = pair[2]
    store = _store(pair)
    shared = "A long instruction every conversation starts with. " * 30
    _ask(pair, store, [{"role": "system", "content": shared}, {"role": "user", "content": "first"}])
    ids, out = _ask(pair, store, [{"role": "system", "content": shared}, {"role": "user", "content": "second"}])
    assert out.prompt_cached >= len(tokenizer.encode(shared)) - 1


def test_both_caps_evict_the_least_recently_used(layouts):
    pair = layouts["full"]
    replies = {}
    store = _store(pair, max_entries=2)
    for name in ("A", "B"):
        _ask(pair, store, _conversation(name, 1, {}))
    _ask(pair, store, [{"role": "user", "content": "a third conversation"}])
    assert len(store.entries) == 2 and [e.tokens[:3] for e in store.entries] != []
    ids, out = _ask(pair, store, _conversation("A", 1, replies))  # A was evicted: only the template's start is shared
    assert out.prompt_cached < len(ids) // 2
    one = store.entries[-1].nbytes
    tight = _store(pair, max_bytes=int(1.5 * one))
    for name in ("A", "B"):
        _ask(pair, tight, _conversation(name, 1, {}))
    assert len(tight.entries) == 1 and tight.stats()["bytes"] <= 2 * one


def test_a_restart_resumes_from_disk_with_the_same_drafts(layouts, tmp_path):
    """Turn 2 after a restart: read from disk, nothing of turn 1 prefilled again, and every cycle drafts and
    accepts what it would have without the restart (the drafter's context and pending features are saved too)."""
    for layout in ("full", "hybrid", "sliding", "group", "replayed"):
        pair = layouts[layout]
        directory = tmp_path / layout
        replies = {}
        store = _store(pair, directory)
        _, out = _ask(pair, store, _conversation("A", 1, replies))
        replies["A", 0] = out.text
        store.flush()
        shutil.copytree(directory, tmp_path / f"{layout}-after-turn-1")  # the disk as a restart after turn 1 finds it
        before: list = []
        _ask(pair, store, _conversation("A", 2, replies), before)
        store.close()

        restarted = _store(pair, tmp_path / f"{layout}-after-turn-1")
        assert restarted.entries and all(e.state is None for e in restarted.entries)  # read only when matched
        after: list = []
        _ask(pair, restarted, _conversation("A", 2, replies), after)
        assert after[-1].prompt_cached == before[-1].prompt_cached > 0, layout
        assert [(r.drafted, r.accepted, r.tokens) for r in after] == [(r.drafted, r.accepted, r.tokens) for r in before]
        restarted.close()


def _rewrite(path: Path, edit, sign: bool) -> None:
    """The file with ``edit(header, tokens)`` applied to its header and history (re-signed as a writer would
    sign them where ``sign``: a crafted file, or a buggy writer's; else as a flipped bit leaves them)."""
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    outer = json.loads(data[8 : 8 + size])
    header = json.loads(outer["__metadata__"]["dflash"])
    tokens = np.frombuffer(base64.b64decode(outer["__metadata__"]["tokens"]), dtype="<i4").copy()
    header = edit(header, tokens)
    if sign:
        header["checksum"] = cache_files._sign(header, tokens.tobytes())
    outer["__metadata__"] |= {"dflash": json.dumps(header), "tokens": base64.b64encode(tokens.tobytes()).decode()}
    raw = json.dumps(outer).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + size :])


def _flip_token(header: dict, tokens: np.ndarray) -> dict:
    tokens[len(tokens) // 2] ^= 1
    return header


def _shift_layer(header: dict, tokens: np.ndarray) -> dict:
    header["layout"]["target"][0][1]["offset"] += 1
    return header


def _damaged(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "flipped":
        data[-10] ^= 0xFF  # inside the last array's bytes
        path.write_bytes(bytes(data))
    elif how == "garbage":
        path.write_bytes(b"not a cache at all")
    elif how == "version":  # an older or newer version's file: not signed as this one signs
        _rewrite(path, lambda header, _: header | {"format": FORMAT + 1}, sign=False)
    elif how == "foreign":
        _rewrite(path, lambda header, _: header | {"fingerprint": "0" * 64}, sign=True)
    elif how == "token":
        _rewrite(path, _flip_token, sign=False)
    elif how == "header":
        _rewrite(path, _shift_layer, sign=False)
    elif how == "not an object":
        _rewrite(path, lambda header, _: list(header), sign=False)
    elif how == "mistyped":
        _rewrite(path, lambda header, _: header | {"layout": {"target": "full", "drafter": []}}, sign=True)


REASONS = {"version": "another version", "foreign": "another model", "token": "does not match its checksum",
           "header": "does not match its checksum", "not an object": "not an object", "mistyped": "its layout"}


@pytest.mark.parametrize("how", ["truncated", "flipped", "garbage", "version", "foreign", "token", "header",
                                 "not an object", "mistyped"])
def test_a_damaged_or_foreign_file_is_ignored_in_one_line(layouts, tmp_path, caplog, how):
    """Whatever is wrong with a file, a restart ignores it with one line that says why, and serves cold: a flipped
    token id or header field (the header and history are checksummed too), a header that is JSON but not an
    object or has a field of the wrong type (a server that crashed on it would not start)."""
    pair = layouts["full"]
    target, drafter, tokenizer, window, _ = pair
    store = _store(pair, tmp_path)
    ids, first = _ask(pair, store, _conversation("A", 1, {}))
    store.close()
    [path] = list(store.directory.glob("*.safetensors"))
    _damaged(path, how)
    caplog.set_level(logging.WARNING, logger="dflash_mlx.serve")
    restarted = _store(pair, tmp_path)
    ids, out = _ask(pair, restarted, _conversation("A", 1, {}) + [{"role": "assistant", "content": first.text},
                                                                   {"role": "user", "content": "and then?"}])
    assert out.prompt_cached == 0  # nothing of the damaged file was used
    assert out.tokens == generate(target, drafter, tokenizer, ids, max_tokens=12, block_size=BLOCK).tokens
    warnings = [r.getMessage() for r in caplog.records if "prompt cache: ignoring" in r.getMessage()]
    assert len(warnings) == 1 and str(path) in warnings[0] and "\n" not in warnings[0]
    assert REASONS.get(how, "") in warnings[0], warnings[0]
    restarted.close()


def test_caches_that_do_not_fit_are_dropped_and_the_request_goes_on_cold(layouts, tmp_path, caplog):
    """A file that passes every check and still cannot be restored (here a writer's bug: a layer that holds one
    token more than the history) is dropped with one line; the request that met it, and the next with its prefix,
    are served, and correctly, not refused (as they were, every one, while the entry stayed)."""
    pair = layouts["full"]
    target, drafter, tokenizer, window, _ = pair
    store = _store(pair, tmp_path)
    _, first = _ask(pair, store, _conversation("A", 1, {}))
    store.close()
    [path] = list(store.directory.glob("*.safetensors"))
    state, _ = read_state(path, store.fingerprint)
    kind, arrays, meta = state.target[0]
    state.target[0] = (kind, arrays, meta | {"offset": meta["offset"] + 1})
    write_state(path, state, store.fingerprint)
    caplog.set_level(logging.WARNING, logger="dflash_mlx.serve")
    restarted = _store(pair, tmp_path)
    messages = _conversation("A", 1, {}) + [{"role": "assistant", "content": first.text},
                                            {"role": "user", "content": "and then?"}]
    ids, out = _ask(pair, restarted, messages)
    cold = generate(target, drafter, tokenizer, ids, max_tokens=12, block_size=BLOCK).tokens
    assert out.prompt_cached == 0 and out.tokens == cold
    warnings = [r.getMessage() for r in caplog.records if "prompt cache: dropping" in r.getMessage()]
    assert len(warnings) == 1 and str(path) in warnings[0] and "\n" not in warnings[0]
    assert path not in [e.path for e in restarted.entries] and not path.exists()
    _, again = _ask(pair, restarted, messages)
    assert again.tokens == cold and again.prompt_cached > 0  # from the entry the cold request kept
    restarted.close()


@pytest.mark.parametrize("mtime", ["changed", "kept"])
def test_weights_rewritten_in_place_never_meet_their_old_caches(layouts, tmp_path, mtime):
    """Other weights of the same names and sizes saved over the target's (a fine-tune, a re-export): the caches made
    with the old ones are not used after a restart, even where the copy kept the old mtime and inode (``cp -p`` over
    the file), and the reply is the new weights' own."""
    folder = tmp_path / "pair"
    shutil.copytree(layouts["full"][4], folder)
    pair = (*load(str(folder / "draft"), str(folder / "target")), None, folder)
    store = _store(pair, tmp_path / "caches")
    _, first = _ask(pair, store, _conversation("A", 1, {}))
    store.close()
    [old] = list(store.directory.glob("*.safetensors"))
    for f in sorted((folder / "target").glob("*.safetensors")):
        before, data = f.stat(), f.read_bytes()
        start = 8 + int.from_bytes(data[:8], "little")
        assert {t["dtype"] for name, t in json.loads(data[8:start]).items() if name != "__metadata__"} == {"F32"}
        with f.open("r+b") as out:  # into the file (same inode), under the same safetensors header
            out.seek(start)
            out.write((np.frombuffer(data[start:], dtype="<f4") + np.float32(0.01)).tobytes())
        if mtime == "kept":
            os.utime(f, ns=(before.st_atime_ns, before.st_mtime_ns))
        after = f.stat()
        assert (after.st_size, after.st_ino) == (before.st_size, before.st_ino)
        assert mtime == "changed" or after.st_mtime_ns == before.st_mtime_ns
    pair = (*load(str(folder / "draft"), str(folder / "target")), None, folder)  # the restart
    target, drafter, tokenizer, _, _ = pair
    restarted = _store(pair, tmp_path / "caches")
    with pytest.raises(ValueError, match="another model"):
        read_header(old, restarted.fingerprint)
    assert not restarted.entries
    ids, out = _ask(pair, restarted, _conversation("A", 1, {}) + [{"role": "assistant", "content": first.text},
                                                                  {"role": "user", "content": "and then?"}])
    assert out.prompt_cached == 0
    assert out.tokens == generate(target, drafter, tokenizer, ids, max_tokens=12, block_size=BLOCK).tokens
    restarted.close()


def test_each_write_has_a_temporary_name_of_its_own(layouts, tmp_path, monkeypatch):
    """Two servers sharing a folder may write the same entry at once: with one temporary name, one would rename
    the other's half-written file into place, or remove it."""
    pair = layouts["full"]
    store = _store(pair)
    _ask(pair, store, _conversation("A", 1, {}))
    written = []
    save = mx.save_safetensors
    monkeypatch.setattr(mx, "save_safetensors", lambda path, *a, **k: (written.append(Path(path)), save(path, *a, **k)))
    print_ = fingerprint(pair[0], pair[1], CacheLayout(pair[3], 0, BLOCK))
    for _ in range(2):
        write_state(tmp_path / "entry.safetensors", store.entries[-1].state, print_)
    assert len(set(written)) == 2 and all(is_temporary(p) and f".{os.getpid()}-" in p.name for p in written)
    assert [p.name for p in tmp_path.iterdir()] == ["entry.safetensors"]


def _with_writes(pair, directory: Path) -> tuple[Path, Path, int]:
    """A folder with one entry, a write another server has in progress and one a dead writer left; the entry's size."""
    store = _store(pair, directory)
    _ask(pair, store, _conversation("A", 1, {}))
    store.flush()
    store.close()
    [entry] = list(store.directory.glob("*.safetensors"))
    live = store.directory / f".{'a' * 32}.safetensors.4242-0123abcd{TEMPORARY}"
    dead = store.directory / f".{'b' * 32}.safetensors.4243-4567cdef{TEMPORARY}"
    for f, age in ((live, STALE_WRITE / 2), (dead, STALE_WRITE + 60)):
        f.write_bytes(b"\0" * 4096)
        os.utime(f, (time.time() - age, time.time() - age))
    return live, dead, entry.stat().st_size


def test_a_start_removes_only_a_dead_writers_temporary_file(layouts, tmp_path):
    pair = layouts["full"]
    live, dead, _ = _with_writes(pair, tmp_path)
    restarted = _store(pair, tmp_path)
    assert live.exists() and not dead.exists() and len(restarted.entries) == 1
    restarted.close()


def test_stats_and_the_disk_cap_leave_files_being_written_alone(layouts, tmp_path):
    """Another server's write in progress is not an entry: not counted, and not trimmed (the oldest file here)."""
    pair = layouts["full"]
    live, _, size = _with_writes(pair, tmp_path)
    restarted = _store(pair, tmp_path, max_disk_bytes=int(1.5 * size))
    assert restarted.stats()["disk_entries"] == 1 and restarted.stats()["disk_bytes"] == size
    _ask(pair, restarted, _conversation("B", 1, {}))
    restarted.flush()
    assert live.exists() and restarted.stats()["disk_entries"] == 1
    restarted.close()


def test_the_disk_cap_keeps_the_newest(layouts, tmp_path):
    pair = layouts["full"]
    store = _store(pair, tmp_path)
    _ask(pair, store, _conversation("A", 1, {}))
    store.flush()
    size = store.stats()["disk_bytes"]
    store.close()
    capped = _store(pair, tmp_path, max_disk_bytes=int(1.5 * size))
    _ask(pair, capped, _conversation("B", 1, {}))
    capped.flush()
    files = list(capped.directory.glob("*.safetensors"))
    assert len(files) == 1 and capped.stats()["disk_bytes"] <= 1.5 * size
    capped.close()
    assert len(_store(pair, tmp_path).entries) == 1


# -- through the server -------------------------------------------------------------------------------


def _start(folder: Path, *extra) -> tuple[subprocess.Popen, str]:
    return start_server(folder / "draft", folder / "target", "--log-level", "warning", *extra)


def _chat(url: str, messages) -> dict:
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 12}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_the_server_alternates_conversations_and_survives_a_restart(layouts, tmp_path):
    pair = layouts["full"]
    target, drafter, tokenizer, _, folder = pair
    proc, url = _start(folder, "--prompt-cache-dir", str(tmp_path))
    replies, cached = {}, {}
    try:
        for turn in range(2):
            for name in "AB":
                messages = _conversation(name, turn + 1, replies)
                out = _chat(url, messages)
                replies[name, turn] = out["choices"][0]["message"]["content"]
                cached[name, turn] = out["usage"]["prompt_tokens_details"]["cached_tokens"]
                ids = render(tokenizer, messages)
                assert replies[name, turn] == generate(target, drafter, tokenizer, ids, max_tokens=12).text
        health = httpx.get(f"{url}/health").json()
    finally:
        proc.send_signal(signal.SIGTERM)  # what launchd and systemd send: a clean stop, pending writes finished
        _, err = finish(proc, 60)
    assert proc.returncode == 0 and "stopped" in err and "Traceback" not in err, err
    for name in "AB":
        assert cached[name, 1] >= len(render(tokenizer, _conversation(name, 1, replies)))
    memory = health["prompt_cache"]
    assert memory["entries"] >= 2 and memory["bytes"] > 0 and memory["disk_entries"] >= 1 and memory["disk_bytes"] > 0

    proc, url = _start(folder, "--prompt-cache-dir", str(tmp_path))
    try:
        messages = _conversation("B", 3, replies)
        out = _chat(url, messages)
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(render(tokenizer, _conversation(
            "B", 2, replies)))  # from disk, after the restart
        assert out["choices"][0]["message"]["content"] == generate(target, drafter, tokenizer, render(
            tokenizer, messages), max_tokens=12).text
    finally:
        proc.send_signal(2)
        finish(proc, 60)


def test_a_cache_of_an_adapted_target_is_not_the_bare_targets(models_dir, tmp_path):
    """A LoRA adapter changes the target's states: the fingerprint follows the adapter's files."""
    from dflash_mlx import load
    from dflash_mlx.models import fixtures

    adapters = [fixtures.write_lora_adapter(tmp_path / f"a{seed}", models_dir / "qwen3", seed=seed) for seed in (0, 1)]
    bare = load(str(models_dir / "qwen3-dflash"), str(models_dir / "qwen3"))
    prints = [fingerprint(bare[0], bare[1], CacheLayout(block_size=BLOCK))]
    for adapter in adapters:
        target, drafter, _ = load(str(models_dir / "qwen3-dflash"), str(models_dir / "qwen3"), adapter_path=str(adapter))
        prints.append(fingerprint(target, drafter, CacheLayout(block_size=BLOCK)))
    assert len(set(prints)) == 3


def test_a_long_reason_is_cut_at_a_word(layouts, tmp_path):
    """A damaged file's reason, when mlx's error is long, is cut at a word with ' ...', never in the middle."""
    pair = layouts["full"]
    store = _store(pair, tmp_path)
    _ask(pair, store, _conversation("A", 1, {}))
    store.close()
    [path] = list(store.directory.glob("*.safetensors"))
    _damaged(path, "truncated")
    try:
        mx.load(str(path))
    except Exception as e:  # noqa: BLE001
        whole = " ".join(str(e).split())
    with pytest.raises(ValueError) as raised:
        read_state(path, store.fingerprint)
    reason = str(raised.value).removeprefix("unreadable (").removesuffix(")")
    assert len(whole) > 120  # mlx's message is long enough to be cut
    assert reason.endswith(" ...") and (whole + " ").startswith(reason.removesuffix(" ...") + " "), reason


def _forged(state, layer: int = 0):
    """``state`` with its target layer ``layer``'s arrays twice as wide (keys of twice the head size; a recurrent
    layer's states twice the size), as a re-signed file can carry: the checksums are unkeyed."""
    kind, arrays, meta = state.target[layer]
    forged = list(state.target)
    forged[layer] = (kind, [mx.concatenate([a, a], axis=-1) for a in arrays], meta)
    return type(state)(state.tokens, forged, state.drafter, state.context, state.window, state.sinks,
                       state.block_size)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_forged_entry_on_disk_is_dropped_and_the_request_goes_on_cold(layouts, layout, tmp_path, caplog):
    """Entries whose target layer 0 has the wrong shape pass the file's checks (re-signed: the checksums are
    unkeyed): one used to restore, then fail every request sharing its prefix with a 500, and be stored again by
    each. Checked against this model's shapes, each is refused at restore: dropped (its file too) with one log
    line, never stored again, and the request runs cold, its reply as without a cache."""
    pair = layouts[layout]
    target, drafter, tokenizer, window, _ = pair
    store = _store(pair, tmp_path)
    _, first = _ask(pair, store, _conversation("A", 1, {}))
    store.close()
    files = sorted(store.directory.glob("*.safetensors"))
    for path in files:  # every entry forged, and re-signed with the fingerprint, as a forger can
        state, _ = read_state(path, store.fingerprint)
        write_state(path, _forged(state), store.fingerprint)
    caplog.set_level(logging.WARNING, logger="dflash_mlx.serve")
    restarted = _store(pair, tmp_path)
    ids, out = _ask(pair, restarted, _conversation("A", 2, {("A", 0): first.text}))  # the second turn: resumable
    warnings = [r.getMessage() for r in caplog.records if "prompt cache: dropping" in r.getMessage()]
    assert out.prompt_cached == 0 and warnings and all("target layer 0" in w for w in warnings), warnings
    assert out.tokens == generate(target, drafter, tokenizer, ids, max_tokens=12, window=window,
                                  block_size=BLOCK).tokens
    restarted.close()
    dropped = [path for path in files if str(path) in " ".join(warnings)]
    assert dropped and not any(path.exists() for path in dropped)
    kept = set(restarted.directory.glob("*.safetensors")) - set(files)
    assert kept  # what the cold request kept is sound: it restores
    for path in kept:
        restarted.cache.restore(read_state(path, restarted.fingerprint)[0])


def test_a_forged_snapshot_is_refused_naming_the_layer(layouts):
    """restore() checks every layer's kind, dtypes and shapes against this model's (and the pending features'):
    a snapshot of another shape is a one-line DFlashError, and the cache is left as it was."""
    pair = layouts["full"]
    store = _store(pair)
    _ask(pair, store, _conversation("A", 1, {}))
    state = store.cache.snapshot()
    fresh = make_cache(pair[0], pair[1], pair[3], 0, BLOCK)
    with pytest.raises(DFlashError, match="target layer 1 holds .* array of shape"):
        fresh.restore(_forged(state, layer=1))
    assert fresh.tokens == [] and fresh.check() is None
    wide_context = type(state)(state.tokens, state.target, state.drafter,
                               mx.concatenate([state.context, state.context], axis=-1), state.window, state.sinks,
                               state.block_size)
    with pytest.raises(DFlashError, match="pending features"):
        fresh.restore(wide_context)
    fresh.restore(state)  # the true one restores
    fresh.check()
