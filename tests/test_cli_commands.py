"""`models`, `convert` and `doctor`, and registry name resolution, through the real CLI."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
from helpers import plain_greedy
from typer.testing import CliRunner

from dflash_mlx import DFlashError, generate, load, registry
from dflash_mlx.cli import app
from dflash_mlx.convert import convert


def _run(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert "Traceback" not in result.output
    return result


def _one_error_line(result, *fragments):
    assert result.exit_code == 2, result.output
    lines = [l for l in result.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


# -- registry -------------------------------------------------------------------

def test_aliases_resolve():
    b16 = registry.find("z-lab/Qwen3-8B-DFlash-b16")
    assert b16 is not None and b16.target == "Qwen/Qwen3-8B" and b16.supported
    assert registry.find("z-lab/Qwen3-8B-DFlash") is b16
    assert registry.find("Qwen3-8B") is b16 and registry.find("qwen3-8b") is b16
    assert registry.find("Qwen3") is None  # ambiguous or unknown names do not guess


def test_every_entry_is_complete_and_honest():
    from dflash_mlx.target import SUPPORTED_MODEL_TYPES

    for p in registry.pairs():
        assert p.drafter.startswith("z-lab/") and "/" in p.target
        assert p.thinking in ("on", "off", "none") and p.block_size >= 1 and p.memory_gb > 0
        assert p.supported == (p.model_type in SUPPORTED_MODEL_TYPES)
    assert not registry.find("Kimi-K2.5").supported


def test_unknown_drafter_suggests_names_and_flag():
    result = _run("generate", "Qwen3-9B-DFlash", "-p", "hi")
    _one_error_line(result, "unknown drafter", "did you mean", "--target")


def test_unsupported_architecture_in_registry():
    result = _run("generate", "Kimi-K2.5", "-p", "hi")
    _one_error_line(result, "kimi_k25", "does not run yet")


def test_default_pair_fits_memory():
    assert registry.default_pair(8 * 2**30).drafter == "z-lab/Qwen3-4B-DFlash-b16"
    assert registry.default_pair(64 * 2**30).drafter == "z-lab/Qwen3-8B-DFlash-b16"


# -- models -----------------------------------------------------------------------

def test_models_marks_downloaded_and_converted(tmp_path, monkeypatch, models_dir):
    """A fake Hub cache holding one pair, and a converted bundle in the working folder."""
    cache = tmp_path / "hub"
    for repo in ("z-lab/Qwen3-4B-DFlash-b16", "Qwen/Qwen3-4B"):
        folder = cache / f"models--{repo.replace('/', '--')}"
        (folder / "refs").mkdir(parents=True)
        (folder / "refs" / "main").write_text("a" * 40)
        (folder / "snapshots" / ("a" * 40)).mkdir(parents=True)
        (folder / "blobs").mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    bundle = tmp_path / "q8"
    bundle.mkdir()
    (bundle / "dflash.json").write_text(json.dumps({"drafter": "z-lab/Qwen3-8B-DFlash-b16"}))
    rows = {r["drafter"]: r for r in json.loads(_run("models", "--json").stdout)}
    assert len(rows) == len(registry.pairs())
    assert rows["z-lab/Qwen3-4B-DFlash-b16"]["downloaded"]
    assert not rows["z-lab/Qwen3-8B-DFlash-b16"]["downloaded"]
    assert rows["z-lab/Qwen3-8B-DFlash-b16"]["converted"] == [str(bundle.resolve())]
    table = CliRunner(env={"COLUMNS": "220"}).invoke(app, ["models"])
    assert table.exit_code == 0 and "Qwen3-8B-DFlash-b16" in table.stdout and "converted" in table.stdout


# -- convert ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def float_bundle(models_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("bundles") / "qwen3-f32"
    result = _run("convert", models_dir / "qwen3-dflash", "--target", models_dir / "qwen3", "-o", out, "--dtype", "float32")
    assert result.exit_code == 0, result.output
    return out


def test_float_bundle_round_trip(float_bundle, pairs):
    manifest = json.loads((float_bundle / "dflash.json").read_text())
    assert manifest["dtype"] == "float32" and manifest["quantize"] is None and manifest["drafter_revision"] == "local"
    target, drafter, tokenizer = load(str(float_bundle))  # no target argument: the bundle has it
    ref_target, ref_drafter, _ = pairs["qwen3"]
    ids = tokenizer.encode("The quick brown fox")
    ours = generate(target, drafter, tokenizer, ids, max_tokens=100, block_size=8, eos_token_ids=[]).tokens
    theirs = generate(ref_target, ref_drafter, tokenizer, ids, max_tokens=100, block_size=8, eos_token_ids=[]).tokens
    assert ours == theirs == plain_greedy(ref_target.model, ids, 100)


def test_generate_from_bundle_offline(float_bundle, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = _run("generate", float_bundle, "-p", "hello", "-m", "10", "--json")
    assert result.exit_code == 0 and len(json.loads(result.stdout)["tokens"]) <= 10


@pytest.mark.parametrize("draft_quantize", ["none", "8bit"])
def test_4bit_bundle_is_lossless_against_the_quantized_target(models_dir, tmp_path, monkeypatch, draft_quantize):
    out = tmp_path / "q4"
    result = _run("convert", models_dir / "llama-dflash", "--target", models_dir / "llama", "-o", out,
                  "--quantize", "4bit", "--q-group-size", "32", "--draft-quantize", draft_quantize)
    assert result.exit_code == 0, result.output
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    target, drafter, tokenizer = load(str(out))
    assert hasattr(target.body.layers[0].self_attn.q_proj, "scales")  # really quantized
    if draft_quantize == "8bit":
        assert hasattr(drafter.layers[0].self_attn.q_proj, "scales") and not hasattr(drafter.fc, "scales")
    ids = tokenizer.encode("import json")
    out_tokens = generate(target, drafter, tokenizer, ids, max_tokens=120, block_size=16, eos_token_ids=[]).tokens
    assert out_tokens == plain_greedy(target.model, ids, 120)


def _partials(parent):
    return [p.name for p in parent.iterdir() if p.name.endswith(".partial") or ".old" in p.name]


def test_existing_out_needs_force(models_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    args = ["convert", models_dir / "qwen3-dflash", "--target", models_dir / "qwen3", "-o", out]
    _one_error_line(_run(*args), "already exists", "--force")
    assert (out / "keep.txt").read_text() == "mine"
    assert _run(*args, "--force").exit_code == 0
    assert (out / "dflash.json").is_file() and not (out / "keep.txt").exists() and not _partials(tmp_path)


@pytest.mark.parametrize(
    "extra,fragments",
    [
        (["--quantize", "3.5bit"], ["invalid --quantize", "4bit"]),
        (["--dtype", "float8"], ["invalid --dtype"]),
        (["--draft-quantize", "2bit"], ["invalid --draft-quantize"]),
    ],
)
def test_bad_options(models_dir, tmp_path, extra, fragments):
    result = _run("convert", models_dir / "qwen3-dflash", "--target", models_dir / "qwen3", "-o", tmp_path / "o", *extra)
    _one_error_line(result, *fragments)
    assert not (tmp_path / "o").exists() and not _partials(tmp_path)


def test_missing_path_and_mismatched_pair(models_dir, tmp_path):
    _one_error_line(_run("convert", tmp_path / "nope", "--target", models_dir / "qwen3", "-o", tmp_path / "o"), "no such folder")
    result = _run("convert", models_dir / "llama-dflash", "--target", models_dir / "qwen3", "-o", tmp_path / "o")
    _one_error_line(result, "expects a 5-layer target")
    assert not (tmp_path / "o").exists() and not _partials(tmp_path)


def test_not_a_model_folder(models_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    result = _run("convert", models_dir / "qwen3-dflash", "--target", tmp_path / "empty", "-o", tmp_path / "o")
    _one_error_line(result, "not a model folder")


def test_interrupted_convert_leaves_nothing(models_dir, tmp_path):
    def interrupt(message):
        if message.startswith("writing the drafter"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert(str(models_dir / "qwen3-dflash"), str(tmp_path / "o"), target=str(models_dir / "qwen3"), log=interrupt)
    assert list(tmp_path.iterdir()) == []


def test_not_enough_disk_space(models_dir, tmp_path, monkeypatch):
    import collections

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 10**6, 1000))
    with pytest.raises(DFlashError, match="not enough disk space"):
        convert(str(models_dir / "qwen3-dflash"), str(tmp_path / "o"), target=str(models_dir / "qwen3"))
    assert list(tmp_path.iterdir()) == []


# -- doctor -------------------------------------------------------------------------

def test_doctor(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    result = _run("doctor")
    assert result.exit_code == 0, result.output
    for fragment in ("MLX backend", "versions", "mlx-lm", "HF cache", "bundles"):
        assert fragment in result.stdout
    if sys.platform == "linux":
        assert "BLAS" in result.stdout


def test_draft_quantize_skips_layers_the_group_size_does_not_divide(models_dir, tmp_path):
    """Input widths of 64 (projections) cannot take groups of 128; 128-wide down_proj can."""
    out = tmp_path / "q"
    result = _run("convert", models_dir / "qwen3-dflash", "--target", models_dir / "qwen3", "-o", out,
                  "--draft-quantize", "4bit", "--q-group-size", "128")
    assert result.exit_code == 0, result.output
    target, drafter, tokenizer = load(str(out))
    layer = drafter.layers[0]
    assert hasattr(layer.mlp.down_proj, "scales") and not hasattr(layer.self_attn.q_proj, "scales")
    ids = tokenizer.encode("hello")
    assert generate(target, drafter, tokenizer, ids, max_tokens=40, eos_token_ids=[]).tokens == plain_greedy(target.model, ids, 40)
