"""A target sharded over two local ranks (``mlx.launch -n 2 --backend ring`` on MLX's CPU backend).

Each launch starts two real processes that load tiny checkpoints through the
public loader, shard the target with mlx-lm's ``model.shard`` and decode; the
test compares their tokens with each other and with single-process decoding.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx
import pytest
from helpers import default_sigint, finish, plain_greedy

from dflash_mlx import generate, load
from dflash_mlx.models import fixtures

HERE = Path(__file__).resolve().parent
LAUNCH = Path(sys.executable).parent / "mlx.launch"
CLI = Path(sys.executable).parent / "dflash-mlx"
PROMPT = "The quick brown fox"
sys.path.insert(0, str(HERE))
import sharded_run  # noqa: E402  (its cases, to check against single-process decoding)

pytestmark = pytest.mark.skipif(not LAUNCH.exists(), reason="mlx.launch is not installed")


def free_port() -> int:
    """A base port with the next few free too (each rank listens on its own)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 60000 and all(_bindable(port + i) for i in range(1, 4)):  # else a rank's bind can fail (error 98)
            return port


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def launch(*command: str, ranks: int = 2, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    args = [str(LAUNCH), "-n", str(ranks), "--backend", "ring", "--starting-port", str(free_port()), "--", *command]
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def sharded_pairs(tmp_path_factory) -> dict:
    """A qwen3, a hybrid qwen3_5 and a hybrid MoE qwen3_5_moe target, each with a drafter that drafts its greedy loop token (long
    accepted runs, so rollbacks keep partial blocks on the sharded caches), each drafter with its own vocabulary."""
    root = tmp_path_factory.mktemp("sharded")
    pairs = {}
    for name in ("qwen3", "qwen3_5", "qwen3_5_moe"):
        config = fixtures.target_config(name, tie_word_embeddings=False)
        fixtures.write_target(root / name, config, seed=0, init_scale=2.0 if name == "qwen3_5_moe" else 1.0)
        fixtures.write_drafter(root / f"{name}-random", fixtures.drafter_config(config))
        target, _, tokenizer = load(str(root / f"{name}-random"), str(root / name))
        ref = plain_greedy(target.model, tokenizer.encode(PROMPT), 200)
        loop = collections.Counter(ref).most_common(1)[0][0]
        fixtures.write_constant_drafter(root / f"{name}-dflash", fixtures.drafter_config(config), root / name, loop)
        # its own vocabulary: qwen3_5's head is sharded (gathered whole, then cut), qwen3's is not (cut)
        fixtures.write_draft_vocabulary(root / f"{name}-dflash", sorted({loop, *range(0, config["vocab_size"], 3)}))
        pairs[name] = (root / f"{name}-dflash", root / name)
    return pairs


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5", "qwen3_5_moe"])
def test_two_ranks_decode_exactly_as_one_process(sharded_pairs, tmp_path, name):
    """Blocks 4 and 16 and adaptive, with and without a window, greedy and sampled: both ranks give the
    same tokens, and greedy ones equal plain greedy decoding of the unsharded target."""
    draft, target = sharded_pairs[name]
    run = launch(sys.executable, str(HERE / "sharded_run.py"), str(draft), str(target), str(tmp_path), PROMPT)
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["size"] for r in ranks] == [2, 2]
    assert ranks[0]["results"] == ranks[1]["results"]  # tokens, acceptances and depths, cycle for cycle

    tgt, drafter, tokenizer = load(str(draft), str(target))
    ids = tokenizer.encode(PROMPT)
    for case, result in zip(sharded_run.CASES, ranks[0]["results"]):
        if case.get("temperature"):
            continue
        window = case.get("window")
        cache = tgt.make_cache(window, 0, slack=1) if window else None
        assert result["tokens"] == plain_greedy(tgt.model, ids, sharded_run.MAX_TOKENS, prompt_cache=cache), case
        if case["block_size"] is not None and window is None:  # (a window changes the loop the drafter drafts)
            assert max(result["acceptance"]) >= 1, case  # partial blocks were kept: rollbacks happened
    seeded = generate(tgt, drafter, tokenizer, ids, max_tokens=sharded_run.MAX_TOKENS, eos_token_ids=[],
                      temperature=1.0, top_p=0.9, seed=7)
    assert ranks[0]["results"][6]["tokens"] == seeded.tokens  # a seed draws the same as on one machine


def test_cli_generate_json_reports_the_group(sharded_pairs):
    draft, target = sharded_pairs["qwen3"]
    run = launch(str(CLI), "generate", str(draft), "--target", str(target), "--prompt", PROMPT,
                 "--no-chat-template", "--max-tokens", "24", "--json")
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, run.stdout  # rank 0 alone prints
    report = json.loads(lines[0])
    assert report["group_size"] == 2 and len(report["rank_peak_memory_gb"]) == 2
    assert all(p > 0 for p in report["rank_peak_memory_gb"])
    tgt, _, tokenizer = load(str(draft), str(target))
    assert report["tokens"] == plain_greedy(tgt.model, tokenizer.encode(PROMPT), 24)


def test_doctor_names_the_group():
    run = launch(str(CLI), "doctor", timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    group = [line for line in run.stdout.splitlines() if line.startswith("group")]
    assert len(group) == 1 and "2 ranks over ring" in group[0] and "0=127.0.0.1" in group[0], run.stdout


def test_a_family_that_does_not_shard_is_refused_in_one_line(tmp_path):
    config = fixtures.target_config("gpt_oss")
    fixtures.write_target(tmp_path / "target", config)
    fixtures.write_drafter(tmp_path / "draft", fixtures.drafter_config(config))
    run = launch(str(CLI), "generate", str(tmp_path / "draft"), "--target", str(tmp_path / "target"), "-p", "hi")
    assert "exited with code 2" in run.stderr  # (mlx.launch itself exits 0 whatever its ranks do)
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    assert errors and all("gpt_oss target does not run sharded yet" in line for line in errors), run.stderr
    assert "Traceback" not in run.stderr


def test_a_rank_that_never_starts_ends_the_run_with_one_line(tmp_path):
    """Rank 0 of a two-rank ring whose rank 1 never comes: a timeout and one line, not a hang."""
    base = free_port()
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{base}"], [f"127.0.0.1:{base + 1}"]]))
    env = {**os.environ, "MLX_RANK": "0", "MLX_HOSTFILE": str(hostfile), "DFLASH_MLX_GROUP_TIMEOUT": "5"}
    tic = time.monotonic()
    run = subprocess.run([str(CLI), "doctor"], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode != 0 and time.monotonic() - tic < 60
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "did not form within 5 s" in lines[0], run.stderr


def test_chat_replies_as_on_one_machine(sharded_pairs, tmp_path):
    """mlx.launch hands every rank the same stdin lines; rank 0 alone prints, and /save writes one file."""
    draft, target = sharded_pairs["qwen3_5"]
    lines = f"hello there\n/save {tmp_path / 'chat.json'}\nand then?\n/quit\n"
    args = ["chat", str(draft), "--target", str(target), "-m", "12"]
    one = subprocess.run([str(CLI), *args], input=lines, capture_output=True, text=True, timeout=120)
    assert one.returncode == 0, one.stderr
    (tmp_path / "chat.json").unlink()
    two = subprocess.run([str(LAUNCH), "-n", "2", "--backend", "ring", "--starting-port", str(free_port()), "--",
                          str(CLI), *args], input=lines, capture_output=True, text=True, timeout=240)
    assert two.returncode == 0, two.stderr[-3000:]
    # The same replies and lines; /save keeps no caches for a sharded target (each rank holds a part of them)
    assert two.stdout == one.stdout.replace("2 messages, caches beside it", "2 messages") and two.stdout.strip()
    assert "caches beside it" in one.stdout
    assert json.loads((tmp_path / "chat.json").read_text())["messages"][0]["content"] == "hello there"
    assert not (tmp_path / "chat.json.cache.safetensors").exists()


def test_serve_answers_as_one_machine_and_stops_on_ctrl_c(sharded_pairs):
    draft, target = sharded_pairs["qwen3"]
    port = free_port()
    proc = subprocess.Popen([str(LAUNCH), "-n", "2", "--backend", "ring", "--starting-port", str(free_port()), "--",
                             str(CLI), "serve", str(draft), "--target", str(target), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=default_sigint)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.1)
        tgt, drafter, tokenizer = load(str(draft), str(target))
        ref = generate(tgt, drafter, tokenizer, PROMPT, max_tokens=30)
        body = {"prompt": PROMPT, "max_tokens": 30, "temperature": 0}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"] == ref.text
        # A client that leaves mid-stream: every rank stops at the same cycle, so the next answer is still exact.
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "max_tokens": 2000, "stream": True},
                          timeout=120) as r:
            next(line for line in r.iter_lines() if line.startswith("data:"))
        sampled = httpx.post(f"{url}/v1/completions", json={**body, "temperature": 1.0}, timeout=120)
        assert sampled.status_code == 200  # no seed: rank 0 draws one for both
        stop = ref.text[len(ref.text) // 2 : len(ref.text) // 2 + 3]
        cut = httpx.post(f"{url}/v1/completions", json={**body, "stop": [stop]}, timeout=120).json()["choices"][0]
        assert ref.text.startswith(cut["text"]) and stop not in cut["text"]
        again = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        assert again["choices"][0]["text"] == ref.text and again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert httpx.get(f"{url}/health", timeout=5).json()["cancelled"] == 1
    finally:
        os.kill(rank_pids(proc.pid)[0], 2)  # Ctrl-C to rank 0: it stops the others
        out, err = finish(proc, 60)
    assert "stopped" in err and "Traceback" not in err, err[-3000:]


def rank_pids(session: int) -> dict[int, int]:
    """rank -> pid of the processes mlx.launch started in ``session``."""
    ranks = {}
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError):
            if entry.name.isdigit() and os.getsid(int(entry.name)) == session:
                env = dict(v.split("=", 1) for v in (entry / "environ").read_text().split("\0") if "=" in v)
                if "MLX_RANK" in env and "dflash-mlx" in (entry / "cmdline").read_text():
                    ranks[int(env["MLX_RANK"])] = int(entry.name)
    return ranks


def test_ctrl_c_in_the_terminal_leaves_no_rank_behind(sharded_pairs):
    """Ctrl-C reaches the launcher and every rank: mid-generation, nobody is left waiting in a collective."""
    draft, target = sharded_pairs["qwen3"]
    proc = subprocess.Popen([str(LAUNCH), "-n", "2", "--backend", "ring", "--starting-port", str(free_port()), "--",
                             str(CLI), "generate", str(draft), "--target", str(target), "-p", PROMPT, "-m", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=default_sigint)
    for _ in range(600):
        if proc.stdout.readable() and len(rank_pids(proc.pid)) == 2 and proc.stdout.read(1):
            break  # rank 0 is printing: generating
        time.sleep(0.1)
    pids = rank_pids(proc.pid)
    os.killpg(proc.pid, 2)
    finish(proc, 60)
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids.values()), "a rank is still running"


def test_bench_json_records_the_group_and_only_rank_0_writes(sharded_pairs, tmp_path):
    draft, target = sharded_pairs["qwen3"]
    out = tmp_path / "bench.json"
    run = launch(str(CLI), "bench", str(draft), "--target", str(target), "--num-prompts", "1", "-m", "16",
                 "--json", str(out))
    assert run.returncode == 0 and "exited with code" not in run.stderr, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["group"]["size"] == 2 and report["group"]["backend"] == "ring"
    assert len(report["rank_peak_memory_gb"]) == 2 and all(p > 0 for p in report["rank_peak_memory_gb"])
    assert all("differs from plain" not in r["flagged"] for r in report["records"])  # (loops are flagged too)
    assert run.stdout.count("dflash vs plain decoding") == 1  # one table, from rank 0


def test_convert_under_launch_writes_one_bundle_from_rank_0(sharded_pairs, tmp_path):
    draft, target = sharded_pairs["qwen3"]
    run = launch(str(CLI), "convert", str(draft), "--target", str(target), "-o", str(tmp_path / "bundle"))
    assert run.returncode == 0 and "exited with code" not in run.stderr and "error" not in run.stderr, run.stderr
    assert (tmp_path / "bundle" / "dflash.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["bundle"]  # no second (temporary) copy from another rank


def test_a_model_that_does_not_split_evenly_is_refused(monkeypatch):
    """mlx-lm's shard would split a lone key/value head (or an odd width) unevenly without a word."""
    from dflash_mlx import distributed
    from dflash_mlx.errors import DFlashError

    config = fixtures.target_config("qwen3", num_key_value_heads=1)
    with pytest.raises(DFlashError, match=r"cannot be split over 2 ranks: its key/value heads \(1\)"):
        distributed.check_shardable(config, 2)
    distributed.check_shardable(fixtures.target_config("qwen3_5", num_key_value_heads=1), 2)  # repeated instead
    with pytest.raises(DFlashError, match=r"vocabulary \(385\)"):
        distributed.check_shardable(fixtures.target_config("qwen3_5", vocab_size=385), 2)
    monkeypatch.setenv("MLX_RANK", "0")
    monkeypatch.setenv("DFLASH_MLX_GROUP_TIMEOUT", "soon")
    distributed.group.cache_clear()
    try:
        with pytest.raises(DFlashError, match="DFLASH_MLX_GROUP_TIMEOUT must be a number of seconds, got 'soon'"):
            distributed.group()
    finally:
        distributed.group.cache_clear()
