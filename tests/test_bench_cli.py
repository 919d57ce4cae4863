"""`dflash-mlx bench` on tiny checkpoints: complete, self-consistent figures and clear errors."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dflash_mlx.bench import degenerate, repetition
from dflash_mlx.cli import app


def _bench(models_dir, tmp_path, *extra):
    out = tmp_path / "bench.json"
    args = ["bench", str(models_dir / "qwen3-dflash"), "--target", str(models_dir / "qwen3"), "-m", "24",
            "--json", str(out), *map(str, extra)]
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, args)
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text()), result


def test_json_is_complete_and_consistent(models_dir, tmp_path):
    report, result = _bench(models_dir, tmp_path, "--dataset", "code", "--num-prompts", "3", "--repeats", "2")
    assert report["machine"]["backend"] in ("cpu", "metal") and report["machine"]["mlx"]
    assert len(report["records"]) == 3 and report["repeats"] == 2
    for r in report["records"]:
        for path in ("plain", "dflash"):
            for key in ("ttft_s", "prefill_tps", "decode_tps", "peak_memory_gb", "tokens"):
                assert key in r[path]
        assert r["speedup"] == pytest.approx(r["dflash"]["decode_tps"] / r["plain"]["decode_tps"])
        hist = r["acceptance_histogram"]
        assert r["tau"] == pytest.approx(sum((k + 1) * c for k, c in enumerate(hist)) / sum(hist))
        assert r["identical"] is True  # temperature 0: dflash text == plain greedy text
        assert set(r) >= {"longest_repeat", "distinct_4gram_ratio", "flagged"}
        depths = r["depth_histogram"]  # the adaptive policy (no --block-size): cycles per drafted depth
        assert sum(depths) == sum(hist) == r["dflash"]["cycles"]
        assert f"  {r['prompt']}  " + " ".join(f"{k}:{n}" for k, n in enumerate(depths) if n) in result.stdout
    summary = report["summary"]
    assert summary["prompts"] == 3 and "acceptance_histogram" in summary
    assert report["policy"] == "adaptive"
    assert "dflash vs plain decoding" in result.stdout


def test_prompt_tokens_are_exact_and_window_honoured(models_dir, tmp_path):
    report, _ = _bench(models_dir, tmp_path, "--prompt-tokens", "40,100", "--window", "32")
    assert [r["prompt_tokens"] for r in report["records"]] == [40, 100]
    assert report["window"] == 32
    # Both paths ran the same windowed attention, so greedy texts agree past the window.
    assert all(r["identical"] for r in report["records"])


def test_jsonl_prompts_and_multi_turn(models_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "Say hi"}) + "\n\n"
        + json.dumps({"turns": ["First question", "And a follow-up"]}) + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "From messages"}]}) + "\n"
    )
    report, _ = _bench(models_dir, tmp_path, "--dataset", prompts)
    assert [(r["prompt"], r["turn"]) for r in report["records"]] == [("p-1", 0), ("p-3", 0), ("p-3", 1), ("p-4", 0)]
    first, second = report["records"][1:3]
    assert second["prompt_tokens"] > first["prompt_tokens"] + first["generated_tokens"]  # turn 2 carries turn 1


def test_plot_is_a_png(models_dir, tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "plot.png"
    _bench(models_dir, tmp_path, "--prompt-tokens", "20,60", "--plot", plot)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 5000


def _error(models_dir, *extra):
    result = CliRunner().invoke(app, ["bench", str(models_dir / "qwen3-dflash"), "--target", str(models_dir / "qwen3"),
                                      *map(str, extra)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    lines = [l for l in result.stderr.splitlines() if l.strip() and not l.startswith("WARNING")]
    assert lines[-1].startswith("error:"), result.stderr
    return lines[-1]


def test_bad_input(models_dir, tmp_path):
    assert "unknown dataset 'squad'" in _error(models_dir, "--dataset", "squad")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": \n')
    assert "bad.jsonl line 2" in _error(models_dir, "--dataset", bad)
    assert "exceeds the model's maximum of 4096" in _error(models_dir, "--prompt-tokens", "5000")


def test_degenerate_output_is_flagged():
    assert degenerate([7, 8, 9] * 20)
    assert repetition([7, 8, 9] * 20)[0] == 60
    assert not degenerate(list(range(60)))
