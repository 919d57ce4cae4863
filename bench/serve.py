"""Through the HTTP server: time to first token and decode tok/s, 1 and 8 concurrent clients.

Starts `dflash-mlx serve` on the CPU pair twice, DFlash (the default adaptive policy)
and plain decoding of the same target (`--block-size 1`: every cycle a plain step),
and sends the same streamed /v1/completions requests to each. Decode tok/s is per
request, from its first streamed token to its last; with 8 clients the server runs
them one at a time, so their time to first token includes the wait in the queue.

    python bench/serve.py [--pair DIR] [--prompts 8] [--max-tokens 128]
"""

from __future__ import annotations

from common import CACHE, print_machine  # re-execs with OpenBLAS first

import argparse  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from importlib import resources  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx2 as httpx  # noqa: E402


def start(pair: Path, extra: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-c", "from dflash_mlx.cli import app; app()", "serve", str(pair / "draft"),
           "--target", str(pair / "target"), "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)


def request(url: str, prompt: str, max_tokens: int) -> dict:
    """One streamed completion: seconds to the first text, decode tok/s after it, the text."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    tic, first, last, text, usage = time.perf_counter(), None, None, [], None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                last = time.perf_counter()
                first = first or last
                text.append(chunk["choices"][0]["text"])
    tokens = usage["completion_tokens"]
    return {"ttft": first - tic, "tps": (tokens - 1) / (last - first) if last > first else 0.0, "text": "".join(text)}


def run(url: str, prompts: list[str], max_tokens: int, clients: int) -> list[dict]:
    results: list[dict] = [{}] * len(prompts)

    def worker(i: int) -> None:
        results[i] = request(url, prompts[i], max_tokens)

    for start_at in range(0, len(prompts), clients):
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(start_at, min(start_at + clients, len(prompts)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", type=Path, default=None, help="[default: newest bench/.cache/pair-*]")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    print_machine()
    pair = args.pair or max(CACHE.glob("pair-*"), key=lambda p: p.stat().st_mtime, default=None)
    if pair is None:
        sys.exit("no trained pair: run python bench/build_pair.py first (or pass --pair)")
    chat = json.loads(resources.files("dflash_mlx").joinpath("data/prompts.json").read_text())["chat"]
    held = [json.loads(line)["prompt"] for line in (pair / "heldout.jsonl").read_text().splitlines()]
    prompts = [p for pair_ in zip(held, chat) for p in pair_][: args.prompts]  # code and chat, alternating
    print(f"{pair.name}: {len(prompts)} prompts (held-out code and built-in chat), {args.max_tokens} tokens, greedy")
    figures = {}
    for name, extra in (("dflash", []), ("plain", ["--block-size", "1"])):
        proc, url = start(pair, extra)
        try:
            run(url, prompts[:2], 16, 1)  # warm-up (the adaptive policy measures its first cycles here)
            figures[name] = {c: run(url, prompts, args.max_tokens, c) for c in (1, 8)}
        finally:
            proc.send_signal(2)
            proc.wait(timeout=60)
    for c in (1, 8):
        d, p = figures["dflash"][c], figures["plain"][c]
        assert [r["text"] for r in d] == [r["text"] for r in p], "dflash and plain served different text"
        ttft = {k: statistics.median(r["ttft"] for r in v) for k, v in (("dflash", d), ("plain", p))}
        tps = {k: statistics.median(r["tps"] for r in v) for k, v in (("dflash", d), ("plain", p))}
        print(f"{c} client(s): time to first token (median) dflash {ttft['dflash'] * 1e3:.0f} ms, plain "
              f"{ttft['plain'] * 1e3:.0f} ms; decode tok/s (median per request) dflash {tps['dflash']:.1f}, "
              f"plain {tps['plain']:.1f}, ratio {tps['dflash'] / tps['plain']:.2f}; texts identical")


if __name__ == "__main__":
    main()
