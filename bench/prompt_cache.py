"""The prompt cache through the server: time to first token of a conversation's turn 2 after another's turn.

Two conversations with long system prompts (``--system-tokens``, different for each),
alternating A1, B1, A2, B2 as agents and chat apps send them, streamed
/v1/chat/completions, greedy. Measured, each in a server of its own, side by side:

- turn 2 of A after B1 with the prompt cache (10 entries, the default) and with one entry
  (what `serve` kept before: B1 pushes A out, so A2 prefills everything again);
- after a restart: A2 from the cache on disk (``--prompt-cache-dir``), and A2 cold;
- the disk's bytes per 1,000 cached tokens.

    python bench/prompt_cache.py [--system-tokens 4096] [--hidden 1024] [--layers 8] [--pair DIR]
"""

from __future__ import annotations

from common import build_models, print_machine, start_server, stop_server  # re-execs with OpenBLAS first

import argparse  # noqa: E402
import base64  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx2 as httpx  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

TEXT = ("Answer in the voice of a careful engineer who checks every number twice and explains each step of the "
        "reasoning before the result, citing the measurement that supports it. ")


def ask(url: str, messages: list[dict]) -> tuple[float, str, int]:
    """Seconds to the first streamed token, the reply, and the prompt tokens the server had cached."""
    body = {"messages": messages, "max_tokens": 16, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    tic, first, text, cached = time.perf_counter(), None, [], 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=3600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = first or time.perf_counter()
                text.append(chunk["choices"][0]["delta"]["content"])
    return (first or time.perf_counter()) - tic, "".join(text), cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system-tokens", type=int, default=4096, help="about this many tokens of system prompt each")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--pair", type=Path, default=None,
                        help="a folder with draft/ and target/ (e.g. bench/.cache/smollm2) instead of a random pair")
    args = parser.parse_args()
    print_machine()
    pair = args.pair or build_models(args.hidden, args.layers)
    vocabulary = TEXT.split()
    tokenizer = AutoTokenizer.from_pretrained(str(pair / "target"))
    words = max(1, args.system_tokens * len(vocabulary) // len(tokenizer.encode(TEXT)))
    system = {name: f"You are assistant {name}. " + " ".join(vocabulary[(i * 7 + ord(name)) % len(vocabulary)]
                                                             for i in range(words))
              for name in "AB"}

    def conversation(name: str, turns: int, replies: dict) -> list[dict]:
        messages = [{"role": "system", "content": system[name]}]
        for t in range(turns):
            messages.append({"role": "user", "content": f"Question {t + 1} of conversation {name}?"})
            if t < turns - 1:
                messages.append({"role": "assistant", "content": replies[name, t]})
        return messages

    def alternate(url: str) -> tuple[dict, dict]:
        replies, seconds = {}, {}
        for turn in range(2):
            for name in "AB":
                seconds[name, turn], replies[name, turn], cached = ask(url, conversation(name, turn + 1, replies))
                seconds[name, turn, "cached"] = cached
        return replies, seconds

    figures = {}
    for label, extra in (("cache, 10 entries", []), ("one entry", ["--prompt-cache-size", "1"])):
        proc, url = start_server(pair, extra)
        try:
            ask(url, [{"role": "user", "content": "warm up"}])
            replies, seconds = alternate(url)
        finally:
            stop_server(proc)
        figures[label] = seconds
        print(f"{label:18s} A2 after B1: time to first token {seconds['A', 1]:.2f} s ({seconds['A', 1, 'cached']} "
              f"tokens cached); A1 cold {seconds['A', 0]:.2f} s", flush=True)
    with tempfile.TemporaryDirectory() as disk:
        proc, url = start_server(pair, ["--prompt-cache-dir", disk])
        try:
            for name in "AB":
                ask(url, conversation(name, 1, {}))
        finally:
            stop_server(proc)
        files = list(Path(disk).rglob("*.safetensors"))
        size, held = sum(f.stat().st_size for f in files), sum(entry_tokens(f) for f in files)
        a2 = conversation("A", 2, replies)
        restarted = {}
        for label, extra in (("from disk", ["--prompt-cache-dir", disk]), ("cold", [])):
            proc, url = start_server(pair, extra)
            try:
                restarted[label] = ask(url, a2)
            finally:
                stop_server(proc)
    print(f"after a restart, A2: from disk {restarted['from disk'][0]:.2f} s ({restarted['from disk'][2]} tokens "
          f"cached), cold {restarted['cold'][0]:.2f} s; replies identical: "
          f"{restarted['from disk'][1] == restarted['cold'][1] == replies['A', 1]}")
    print(f"on disk: {len(files)} entries, {size / 2**20:.1f} MiB for {held} "
          f"tokens: {size / held * 1000 / 2**20:.2f} MiB per 1,000 tokens")


def entry_tokens(path: Path) -> int:
    """The tokens a cache file holds, from its header."""
    with path.open("rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return len(base64.b64decode(header["__metadata__"]["tokens"])) // 4


if __name__ == "__main__":
    main()
