"""`dflash-mlx bench` on tiny checkpoints: complete, self-consistent figures and clear errors."""

from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

from dflash_mlx.cli.main import app
from dflash_mlx.eval import bench
from dflash_mlx.eval.bench import degenerate, repetition
from dflash_mlx.eval.prompts import Conversation, builtin
from dflash_mlx.eval.report import figure, summarize
from dflash_mlx.models import loader


def _bench(models_dir, tmp_path, *extra, columns=200, exit_code=0):
    out = tmp_path / "bench.json"
    args = ["bench", str(models_dir / "qwen3-dflash"), "--target", str(models_dir / "qwen3"), "-m", "24",
            "--json", str(out), *map(str, extra)]
    result = CliRunner(env={"COLUMNS": str(columns)}).invoke(app, args)
    assert result.exit_code == exit_code and "Traceback" not in result.output, result.output
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


def test_draft_sources_are_reported_and_pinned(models_dir, tmp_path):
    """`--draft-source copy` on the re-emission set: only copies are drafted, still identical to plain; every
    record counts each source's tokens and how much of its output re-emits its prompt."""
    report, result = _bench(models_dir, tmp_path, "--dataset", "edit", "--num-prompts", "2", "--draft-source", "copy")
    assert report["draft_source"] == "copy" and len(report["records"]) == 2
    for r in report["records"]:
        assert r["identical"] is True and 0 <= r["from_prompt"] <= 1
        assert r["sources"]["drafter"]["drafted"] == 0
        assert r["sources"]["copy"]["drafted"] == sum(k * n for k, n in enumerate(r["depth_histogram"]))
    totals = report["summary"]["sources"]
    kept = [r for r in report["records"] if not r["flagged"]]
    assert totals["copy"]["accepted"] == sum(r["sources"]["copy"]["accepted"] for r in kept)
    over = f" over the {len(kept)} prompts not flagged" if len(kept) < 2 else ""  # the summary says what it counts
    assert f"drafted (accepted) tokens by source{over}: drafter 0 (0), copy" in result.stdout
    assert "draft source must be one of auto, drafter, copy, got 'nope'" in _error(models_dir, "--draft-source", "nope")


def test_the_edit_set_asks_for_files_back():
    edits = builtin("edit")
    assert len(edits) == 6 and all("```python\n" in c.turns[0] and "one change:" in c.turns[0] for c in edits)
    assert not any(c.name.startswith("edit") for c in builtin("all"))  # the default mix stays ordinary text


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


def test_plot_figure_and_force(models_dir, tmp_path):
    pytest.importorskip("matplotlib")
    plot, report_file = tmp_path / "plot.png", tmp_path / "bench.json"
    plot.write_text("old")
    report_file.write_text("old")
    report, _ = _bench(models_dir, tmp_path, "--prompt-tokens", "20,60", "--plot", plot, "--force")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 5000  # --force replaced both
    assert not list(tmp_path.glob(".*.tmp*"))  # written atomically, nothing left behind

    for r in report["records"]:  # whatever the tiny model did, draw every prompt
        r["flagged"] = []
    report["summary"] = summarize(report["records"])
    fig = figure(report)
    speed, tau, hist = fig.axes
    assert (speed.get_title(), tau.get_title(), hist.get_title()) == ("speedup", "tau", "acceptance")
    assert any(list(line.get_ydata()) == [1.0, 1.0] for line in speed.get_lines())  # the 1.0x reference
    assert list(speed.get_lines()[0].get_ydata()) == [r["speedup"] for r in report["records"]]
    assert list(tau.get_lines()[0].get_ydata()) == [r["tau"] for r in report["records"]]
    title = fig.get_suptitle()
    machine = report["machine"]
    assert str(models_dir / "qwen3-dflash") in title and "window off" in title
    assert machine["processor"] in title and "BLAS" in title
    block = report["block_size"]
    assert list(hist.get_xticks()) == list(range(block))  # every possible accepted count, integer bins
    counts = report["summary"]["acceptance_histogram"]
    plain = report["summary"]["plain_steps"]  # cycles that drafted nothing, a bar of their own at 0 accepted
    assert plain == sum(r["depth_histogram"][0] for r in report["records"])
    bars = [p.get_height() for p in hist.patches]
    assert bars[:block] == [counts[0] - plain] + counts[1:] + [0] * (block - len(counts))
    assert bars[block:] == ([plain] if plain else [])
    low, high = tau.get_ylim()  # a nearly flat tau is drawn flat, from 1 (none accepted) up
    assert low <= 1.0 and high >= 2.0
    assert not fig.get_supxlabel()  # nothing was left out

    report["records"][0]["flagged"] = ["degenerate loop"]
    report["summary"] = summarize(report["records"])
    fig = figure(report)
    assert len(fig.axes[0].get_lines()[0].get_ydata()) == len(report["records"]) - 1
    note = fig.get_supxlabel()  # the missing point is said, with why
    assert f"1 of {len(report['records'])} prompts" in note and report["records"][0]["prompt"] in note
    assert "degenerate loop" in note

    for r in report["records"]:
        r["flagged"] = ["degenerate loop"]
    fig = figure(report)
    assert not fig.axes and "flagged" in " ".join(t.get_text() for t in fig.texts)


def test_default_prompts_mix_the_sets(models_dir, tmp_path):
    assert [c.name.split("-")[0] for c in builtin()[:6]] == ["math", "code", "chat"] * 2
    assert sorted(c.name for c in builtin()) == sorted(c.name for s in ("math", "code", "chat") for c in builtin(s))
    report, _ = _bench(models_dir, tmp_path, "--num-prompts", "3", "-m", "8")
    assert [r["prompt"] for r in report["records"]] == ["math-0", "code-0", "chat-0"]


def test_table_loses_nothing_at_80_columns(models_dir, tmp_path, monkeypatch):
    calls = iter(range(100))
    monkeypatch.setattr(bench, "degenerate", lambda tokens: next(calls) == 1)  # flag the second prompt
    report, result = _bench(models_dir, tmp_path, "--num-prompts", "3", columns=80)  # captured: not a TTY
    records = report["records"]
    assert [r["flagged"] for r in records] == [[], ["degenerate loop"], []]
    lines = result.stdout.splitlines()
    for r in records:
        row = next(line.split() for line in lines if line.split()[:1] == [r["prompt"]])
        cells = [str(r["prompt_tokens"]), f"{r['plain']['decode_tps']:.1f}", f"{r['dflash']['decode_tps']:.1f}",
                 f"{r['speedup']:.2f}x", f"{r['tau']:.2f}", f"{r['dflash']['prefill_tps']:.0f}",
                 f"{r['dflash']['peak_memory_gb']:.2f}"] + (["yes"] if r["flagged"] else [])
        assert row[1:] == cells, row
    assert "  code-0  " in result.stdout and "flagged: degenerate loop" in result.stdout
    assert "…" not in result.stdout


def test_a_run_whose_every_prompt_is_flagged_says_it_has_no_figure(models_dir, tmp_path, monkeypatch):
    """A target that only loops (trained on a busy machine, say) must never read as a speedup."""
    monkeypatch.setattr(bench, "degenerate", lambda tokens: True)
    report, result = _bench(models_dir, tmp_path, "--num-prompts", "2", columns=200)
    assert report["summary"]["speedup"] is None
    assert "no usable figure: all 2 prompts were flagged (2 degenerate loop)" in result.stdout
    assert "speedup median" not in result.stdout


def test_ctrl_c_keeps_what_was_measured(models_dir, tmp_path, monkeypatch):
    record, calls = bench._record, []

    def interrupt_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return record(*args, **kwargs)

    monkeypatch.setattr(bench, "_record", interrupt_third)
    report, result = _bench(models_dir, tmp_path, "--dataset", "code", "--num-prompts", "5", "-m", "8", exit_code=130)
    assert report["interrupted"] is True and (report["measured"], report["planned"]) == (2, 5)
    assert [r["prompt"] for r in report["records"]] == ["code-0", "code-1"] and report["summary"]["prompts"] == 2
    assert "  code-1  " in result.stdout and "code-2" not in result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("WARNING")]
    assert lines[-1].startswith("interrupted: measured 2 of 5 prompts; written to"), result.stderr


def _error(models_dir, *extra):
    result = CliRunner().invoke(app, ["bench", str(models_dir / "qwen3-dflash"), "--target", str(models_dir / "qwen3"),
                                      *map(str, extra)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("WARNING")]
    assert lines[-1].startswith("error:"), result.stderr
    return lines[-1]


def test_outputs_are_checked_before_loading(models_dir, tmp_path, monkeypatch):
    def load(*args, **kwargs):
        raise AssertionError("loaded the model before checking the outputs")

    monkeypatch.setattr(loader, "load", load)
    assert "folder" in _error(models_dir, "--plot", tmp_path / "missing" / "p.png")
    assert "does not exist" in _error(models_dir, "--json", tmp_path / "missing" / "b.json")
    assert "is a folder" in _error(models_dir, "--json", tmp_path)
    existing = tmp_path / "b.json"
    existing.write_text("keep")
    assert "already exists; pass --force" in _error(models_dir, "--json", existing)
    assert existing.read_text() == "keep"
    assert "name the same file" in _error(models_dir, "--json", tmp_path / "x", "--plot", tmp_path / "x")
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as if not installed
    assert "--plot needs matplotlib" in _error(models_dir, "--plot", tmp_path / "p.png")


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


def test_reuse_prefix_prefills_only_what_the_last_run_did_not_hold(pairs):
    """Prompts cut from one text at growing lengths, one of them twice, then one of another text: with
    ``reuse_prefix`` a prompt is prefilled once for both paths, only the tokens the caches' history did not begin
    with (one for a repeat; all after the other text), each run then prefills its last token, and both paths give
    the tokens they give from fresh caches."""
    target, drafter, tokenizer = pairs["qwen3"]
    text = tokenizer.encode(" ".join(f"line {i}: value = compute({i}, {i * 7 % 13})" for i in range(40)))
    other = tokenizer.encode("import json\nimport os\n\nclass Config:\n    def load(self, path):\n        return")
    cuts = [text[:60], text[:120], text[:120], other, text[:200]]
    conversations = [Conversation(f"p{i}", [], token_ids=ids) for i, ids in enumerate(cuts)]
    fresh = bench.measure(target, drafter, tokenizer, conversations, max_tokens=12, repeats=2)
    reused = bench.measure(target, drafter, tokenizer, conversations, max_tokens=12, repeats=2, reuse_prefix=True)
    for a, b in zip(fresh, reused):
        assert b["identical"] and a["dflash"]["tokens"] == b["dflash"]["tokens"] == b["plain"]["tokens"]
        assert a["plain"]["prefilled_tokens"] == a["dflash"]["prefilled_tokens"] == a["prompt_tokens"]
        assert "shared_prefill_tokens" not in a and b["plain"]["prefilled_tokens"] == b["dflash"]["prefilled_tokens"] == 1
    shared = [r["shared_prefill_tokens"] for r in reused]
    assert shared[0] == 60 and shared[1] <= 60 and shared[2] == 1 and shared[3:] == [len(other), 200], shared
