"""Through the HTTP server: time to first token and decode tok/s, 1 and 8 concurrent clients.

Starts `dflash-mlx serve` on the CPU pair twice, DFlash (the default adaptive policy)
and plain decoding of the same target (`--block-size 1`: every cycle a plain step),
and sends the same streamed /v1/completions requests to each. Decode tok/s is per
request, from its first streamed token to its last; with 8 clients the server runs
them one at a time, so their time to first token includes the wait in the queue.

With ``--tools`` it measures instead what splitting a chat reply (reasoning, tool calls) costs
the stream: one DFlash server, each prompt sent as a text completion (raw text, nothing
parsed), a chat completion, and a chat completion with ``tools``, in rotating order. The
chat template is given with ``--chat-template``: the pair's own (messages as text) plus, in
a comment, the markers mlx-lm infers Qwen's tool-call parser from, so the three send the
same prompt and decode the same reply, and only the parsing differs.

With ``--clients 1,2,4,8`` it measures continuous batching instead: this server (``--max-batch``
as sized, every client's rows verified in one pass), the same server one request at a time
(``--max-batch 1``, the FIFO server) and ``mlx_lm.server`` on the target alone (its batched plain
decoding), each with that many clients sending requests back to back: aggregate tok/s, decode
tok/s per request, and time to first token p50/p95.

``--hogs N`` runs that measurement beside N CPU busy loops (a machine with other work on it).

With ``--join 8192`` it measures what a long prompt's prefill costs a request that arrives during
it: its time to first token, in the long prompt's prefill chunks, batched and one at a time.

    python bench/serve.py [--pair DIR] [--prompts 8] [--max-tokens 128] [--tools] [--clients 1,2,4,8 [--repeats 3] [--hogs N]]
    python bench/serve.py --pair DIR --join 8192 --max-tokens 16
    python bench/serve.py --random 256,4 --clients 1,4 --max-tokens 512   # a small, fast pair
"""

from __future__ import annotations

from common import CACHE, build_models, cpu_hogs, print_machine, serve_on_free_port, start_server, stop_server  # re-execs with OpenBLAS first

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from importlib import resources  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx2 as httpx  # noqa: E402


# The pair's chat template (the messages' text) and, in a comment that renders nothing, the markers mlx-lm
# infers Qwen's tool-call parser from ("<tool_call>" and "tool_call.name").
TOOLS_TEMPLATE = ("{#- <tool_call> tool_call.name -#}"
                  "{%- for m in messages %}{{- m['content'] }}{%- if not loop.last %}{{- '\\n' }}{%- endif %}{%- endfor %}")
TOOLS = [{"type": "function", "function": {"name": "run_python", "description": "Run Python code",
                                           "parameters": {"type": "object", "properties": {"code": {"type": "string"}}}}}]


def request(url: str, prompt: str, max_tokens: int, tools: bool = None) -> dict:
    """One streamed completion (a chat one when ``tools`` is not None): seconds to the first text, decode tok/s
    after it, the text."""
    body = {"max_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    path = "/v1/completions"
    if tools is None:
        body["prompt"] = prompt
    else:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
        body |= {"tools": TOOLS} if tools else {}
    tic, first, last, text, usage = time.perf_counter(), None, None, [], None
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{path} answered {r.status_code}: {r.read().decode()[:200]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            piece = (chunk["choices"][0].get("text") or chunk["choices"][0].get("delta", {}).get("content")
                     if chunk["choices"] else None)
            if piece:
                last = time.perf_counter()
                first = first or last
                text.append(piece)
    tokens = usage["completion_tokens"] if usage else len(text)  # (a server that reports no usage: pieces)
    if first is None:  # no text at all (an immediate end of reply): the first token is the end
        first = last = time.perf_counter()
    return {"ttft": first - tic, "tps": (tokens - 1) / (last - first) if last > first else 0.0, "text": "".join(text),
            "tokens": tokens}


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
    parser.add_argument("--random", default=None, metavar="HIDDEN,LAYERS",
                        help="a random pair of this shape instead, built once (256,4: a small, fast pair, whose ~1 ms "
                        "cycles stand for a big Mac running a small model: host work per cycle decides)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--tools", action="store_true", help="measure what tool and reasoning parsing cost")
    parser.add_argument("--clients", default=None, help="comma-separated client counts: measure batching")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the batching measurement")
    parser.add_argument("--hogs", type=int, default=0, help="CPU busy loops beside the batching measurement")
    parser.add_argument("--join", type=int, default=None, metavar="TOKENS",
                        help="time to first token of a request sent during a prompt of this many tokens")
    args = parser.parse_args()
    print_machine()
    pair = args.pair or max(CACHE.glob("pair-*"), key=lambda p: p.stat().st_mtime, default=None)
    if args.random:
        pair = build_models(*(int(x) for x in args.random.split(",")))
    if pair is None:
        sys.exit("no trained pair: run python bench/build_pair.py first (or pass --pair)")
    sets = json.loads(resources.files("dflash_mlx").joinpath("data/prompts.json").read_text())
    heldout = pair / "heldout.jsonl"  # the toy pair's held-out code; others take the built-in code prompts
    held = ([json.loads(line)["prompt"] for line in heldout.read_text().splitlines()] if heldout.exists()
            else sets["code"])
    prompts = [p for pair_ in zip(held, sets["chat"]) for p in pair_][: args.prompts]  # code and chat, alternating
    print(f"{pair.name}: {len(prompts)} prompts (code and built-in chat), {args.max_tokens} tokens, greedy")
    if args.tools:
        with_and_without_tools(pair, prompts, args.max_tokens)
        return
    if args.join:
        join_during_prefill(pair, args.join, args.max_tokens)
        return
    if args.clients:
        with cpu_hogs(args.hogs):
            if args.hogs:
                print(f"under load: {args.hogs} CPU hogs (a busy loop each) run beside the servers")
            batching(pair, prompts, args.max_tokens, [int(c) for c in args.clients.split(",")], args.repeats)
        return
    figures = {}
    for name, extra in (("dflash", []), ("plain", ["--block-size", "1"])):
        proc, url = start_server(pair, extra)
        try:
            run(url, prompts[:2], 16, 1)  # warm-up (the adaptive policy measures its first cycles here)
            figures[name] = {c: run(url, prompts, args.max_tokens, c) for c in (1, 8)}
        finally:
            stop_server(proc)
    for c in (1, 8):
        d, p = figures["dflash"][c], figures["plain"][c]
        assert [r["text"] for r in d] == [r["text"] for r in p], "dflash and plain served different text"
        ttft = {k: statistics.median(r["ttft"] for r in v) for k, v in (("dflash", d), ("plain", p))}
        tps = {k: statistics.median(r["tps"] for r in v) for k, v in (("dflash", d), ("plain", p))}
        print(f"{c} client(s): time to first token (median) dflash {ttft['dflash'] * 1e3:.0f} ms, plain "
              f"{ttft['plain'] * 1e3:.0f} ms; decode tok/s (median per request) dflash {tps['dflash']:.1f}, "
              f"plain {tps['plain']:.1f}, ratio {tps['dflash'] / tps['plain']:.2f}; texts identical")


def clients_at_once(url: str, prompts: list[str], max_tokens: int, clients: int) -> dict:
    """``clients`` clients, each sending its share of ``prompts`` back to back: aggregate and per-request figures."""
    shares = [prompts[i::clients] for i in range(clients)]
    results: list[dict] = []

    def client(share: list[str]) -> None:
        for prompt in share:
            results.append(request(url, prompt, max_tokens) | {"prompt": prompt})

    tic = time.perf_counter()
    threads = [threading.Thread(target=client, args=(share,)) for share in shares if share]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - tic
    ttfts = sorted(r["ttft"] for r in results)
    return {"aggregate": sum(r["tokens"] for r in results) / wall, "per_request": statistics.median(r["tps"] for r in results),
            "ttft_p50": ttfts[len(ttfts) // 2], "ttft_p95": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))],
            "texts": {r["prompt"]: r["text"] for r in results}}


def mlx_lm_server(target: Path) -> tuple[subprocess.Popen, str]:
    """``mlx_lm.server`` on the target alone (its batched plain decoding), on a free loopback port."""
    return serve_on_free_port(lambda port: [sys.executable, "-m", "mlx_lm", "server", "--model", str(target), "--port",
                                            str(port), "--log-level", "WARNING"], "/v1/models")


def batching(pair: Path, prompts: list[str], max_tokens: int, counts: list[int], repeats: int) -> None:
    """Each server in turn (rotating order, ``repeats`` rounds), each client count on it; the same prompts, greedy.
    The machine's speed drifts between rounds: ratios are taken within a round, then their median."""
    servers = {"dflash batched": lambda: start_server(pair, ["--log-level", "warning"]),
               "dflash one at a time": lambda: start_server(pair, ["--max-batch", "1", "--log-level", "warning"]),
               "mlx_lm.server (target)": lambda: mlx_lm_server(pair / "target")}
    names = list(servers)
    rounds: list[dict[str, dict[int, dict]]] = []
    for r in range(repeats):
        figures: dict[str, dict[int, dict]] = {}
        for name in names[r % 3:] + names[: r % 3]:
            proc, url = servers[name]()
            try:
                run(url, prompts[:2], 16, 1)  # warm-up
                figures[name] = {c: clients_at_once(url, prompts, max_tokens, c) for c in counts}
            finally:
                stop_server(proc)
        rounds.append(figures)
    print(f"{len(prompts)} requests of {max_tokens} tokens per client count, {repeats} rounds; medians over rounds of: "
          "aggregate tok/s (all clients), decode tok/s per request (median), time to first token p50 / p95")
    print(f"{'server':24s} {'clients':>7s} {'aggregate':>9s} {'per req':>8s} {'ttft p50':>9s} {'ttft p95':>9s}")
    for name in names:
        for c in counts:
            f = {k: statistics.median(r[name][c][k] for r in rounds) for k in ("aggregate", "per_request", "ttft_p50",
                                                                               "ttft_p95")}
            print(f"{name:24s} {c:7d} {f['aggregate']:9.1f} {f['per_request']:8.1f} {f['ttft_p50'] * 1e3:7.0f}ms "
                  f"{f['ttft_p95'] * 1e3:7.0f}ms")
    ours, fifo, mlx = names
    for c in counts:
        vs_fifo = [r[ours][c]["aggregate"] / r[fifo][c]["aggregate"] for r in rounds]
        vs_mlx = [r[ours][c]["aggregate"] / r[mlx][c]["aggregate"] for r in rounds]
        same = all(r[ours][c]["texts"] == r[fifo][c]["texts"] for r in rounds)
        print(f"{c} clients: batched / one at a time {statistics.median(vs_fifo):.2f}x "
              f"({min(vs_fifo):.2f}-{max(vs_fifo):.2f}), batched / mlx_lm.server {statistics.median(vs_mlx):.2f}x "
              f"({min(vs_mlx):.2f}-{max(vs_mlx):.2f}); texts {'identical' if same else 'DIFFER'} between the two "
              f"dflash servers, {'identical' if all(r[ours][c]['texts'] == r[mlx][c]['texts'] for r in rounds) else 'different'} "
              "from mlx_lm.server's")


def join_during_prefill(pair: Path, context: int, max_tokens: int) -> None:
    """A client sends a ``context``-token prompt; once its prefill is under way another sends a short one. The second's
    time to first token, against the first's prefill chunks (``--prefill-step``, 2048 by default), batched and one at
    a time."""
    from dflash_mlx import load

    _, _, tokenizer = load(str(pair / "draft"), str(pair / "target"))
    words = " ".join(f"w{i % 997}" for i in range(context * 2))
    long = tokenizer.encode(words)[:context]
    for name, extra in (("batched", []), ("one at a time", ["--max-batch", "1"])):
        proc, url = start_server(pair, extra + ["--log-level", "warning"])
        try:
            request(url, "warm up", 4)
            out: dict[str, dict] = {}
            first = threading.Thread(target=lambda: out.__setitem__("long", request(url, long, max_tokens)))
            tic = time.perf_counter()
            first.start()
            time.sleep(1.0)  # the long prompt's prefill is under way
            joined = time.perf_counter()
            out["short"] = request(url, "The quick brown fox", max_tokens)
            first.join()
        finally:
            stop_server(proc)
        long_first = tic + out["long"]["ttft"]
        chunk = out["long"]["ttft"] / -(-context // 2048)
        print(f"{name:14s}: the {context}-token prompt's first token after {out['long']['ttft']:.1f} s "
              f"({chunk:.2f} s per 2048-token chunk); a short request sent {joined - tic:.1f} s in got its first "
              f"token {out['short']['ttft']:.2f} s later ({out['short']['ttft'] / chunk:.1f} chunks), "
              f"{'before' if joined + out['short']['ttft'] < long_first else 'after'} the long prompt's")


def with_and_without_tools(pair: Path, prompts: list[str], max_tokens: int, repeats: int = 3) -> None:
    """One DFlash server; each prompt as a text completion (no parsing), a chat completion, and a chat completion
    with tools (every piece through the tool-call parser), in rotating order; medians of decode tok/s."""
    proc, url = start_server(pair, ["--chat-template", TOOLS_TEMPLATE, "--log-level", "warning"])
    variants = {"text completion": None, "chat": False, "chat + tools": True}
    try:
        request(url, prompts[0], 16, tools=True)  # warm-up
        runs: dict[str, list[dict]] = {name: [] for name in variants}
        for r in range(repeats):
            for i, prompt in enumerate(prompts):
                names = list(variants)
                for name in names[(r + i) % 3:] + names[: (r + i) % 3]:
                    runs[name].append(request(url, prompt, max_tokens, tools=variants[name]))
    finally:
        stop_server(proc)
    texts = [[r["text"] for r in v] for v in runs.values()]
    assert texts[0] == texts[1] == texts[2], "the variants decoded different replies"
    tps = {name: statistics.median(r["tps"] for r in v) for name, v in runs.items()}
    base = tps["text completion"]
    print(f"streamed, {repeats} x {len(prompts)} requests each, replies identical; decode tok/s, median per request:")
    for name, value in tps.items():
        print(f"  {name:16s} {value:7.1f}  ({value / base:.3f} of the text completion)")


if __name__ == "__main__":
    main()
