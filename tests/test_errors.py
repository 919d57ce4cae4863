"""Bad input gets one clear error naming the problem: from the API and from the CLI."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from dflash_mlx import DFlashError, generate, load
from dflash_mlx.cli.main import app
from dflash_mlx.models import fixtures
from dflash_mlx.models.loader import resolve


def _broken_drafter(tmp_path, models_dir, edit=None, name="drafter"):
    """A copy of the good Qwen3 drafter, with its config edited."""
    path = tmp_path / name
    shutil.copytree(models_dir / "qwen3-dflash", path)
    if edit:
        config = json.loads((path / "config.json").read_text())
        edit(config)
        (path / "config.json").write_text(json.dumps(config))
    return path


def _expect(models_dir, draft, match, target="qwen3"):
    with pytest.raises(DFlashError, match=match):
        load(str(draft), str(models_dir / target))
    result = CliRunner().invoke(app, ["generate", str(draft), "--target", str(models_dir / target), "-p", "hi"])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and result.exception is None or isinstance(result.exception, SystemExit)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    return lines[0]


def test_hidden_size_mismatch(tmp_path, models_dir):
    config = fixtures.drafter_config(fixtures.target_config(hidden_size=32, num_hidden_layers=4, num_attention_heads=4), 1)
    draft = fixtures.write_drafter(tmp_path / "d", config)
    _expect(models_dir, draft, "hidden_size 32 does not match the target's 64")


def test_vocab_mismatch(tmp_path, models_dir):
    config = fixtures.drafter_config(fixtures.target_config(vocab_size=500), 1)
    draft = fixtures.write_drafter(tmp_path / "d", config)
    _expect(models_dir, draft, "vocab_size 500 does not match")


def test_layer_count_mismatch(tmp_path, models_dir):
    draft = _broken_drafter(tmp_path, models_dir, lambda c: c.update(num_target_layers=36))
    _expect(models_dir, draft, "expects a 36-layer target")


def test_target_layer_ids_out_of_range(tmp_path, models_dir):
    draft = _broken_drafter(tmp_path, models_dir, lambda c: c["dflash_config"].update(target_layer_ids=[7]))
    _expect(models_dir, draft, r"target_layer_ids \[7\] out of range for a 4-layer target")


def test_missing_weights(tmp_path, models_dir):
    draft = _broken_drafter(tmp_path, models_dir)
    (draft / "model.safetensors").unlink()
    _expect(models_dir, draft, "no safetensors weights")


def test_missing_shard(tmp_path, models_dir):
    draft = tmp_path / "d"
    shutil.copytree(models_dir / "llama-dflash", draft)
    (draft / "model-00002-of-00003.safetensors").unlink()
    _expect(models_dir, draft, "shard missing.*model-00002-of-00003", target="llama")


def test_corrupt_weights(tmp_path, models_dir):
    draft = _broken_drafter(tmp_path, models_dir)
    data = (draft / "model.safetensors").read_bytes()
    (draft / "model.safetensors").write_bytes(data[: len(data) // 2])
    _expect(models_dir, draft, "corrupt or not a safetensors file")


@pytest.mark.parametrize("edit", [dict(num_hidden_layers=2, layer_types=["full_attention"] * 2), dict(intermediate_size=100)])
def test_weights_not_matching_config(tmp_path, models_dir, edit):
    draft = _broken_drafter(tmp_path, models_dir, lambda c: c.update(edit))
    _expect(models_dir, draft, "do not match its config")


def test_inconsistent_layer_types(tmp_path, models_dir):
    draft = _broken_drafter(tmp_path, models_dir, lambda c: c.update(num_hidden_layers=2))
    _expect(models_dir, draft, "layer_types lists 1 layers, config has 2")


def test_not_a_drafter(models_dir):
    """The target folder itself passed as the drafter."""
    _expect(models_dir, models_dir / "qwen3", "is not a DFlash drafter")


def test_unsupported_drafter_architecture(tmp_path, models_dir):
    """NeMo saves DFlash2 drafters under their class name, which no runtime reads: refused, naming the known ones."""
    draft = _broken_drafter(tmp_path, models_dir, lambda c: c.update(architectures=["Qwen3DFlash2DraftModel"]))
    line = _expect(models_dir, draft, "Qwen3DFlash2DraftModel is not supported")
    assert "DFlashDraftModel" in line and "DFlash2DraftModel" in line


def test_missing_paths(tmp_path, models_dir):
    _expect(models_dir, tmp_path / "nope", "no such folder")
    with pytest.raises(DFlashError, match="no such folder"):
        load(str(models_dir / "qwen3-dflash"), str(tmp_path / "nope"))


def test_mistyped_relative_folder_is_not_taken_for_a_repo_id(tmp_path, monkeypatch):
    """"models/qwen" looks like a repo id; when it cannot be fetched and ./models exists, the error
    names the missing folder rather than a failed download."""
    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DFlashError, match="models/qwen: no such folder"):
        resolve("models/qwen", "target")


def test_target_folder_without_model(tmp_path, models_dir):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DFlashError, match="not a model folder"):
        load(str(models_dir / "qwen3-dflash"), str(tmp_path / "empty"))


def test_no_target(models_dir):
    with pytest.raises(DFlashError, match="needs its target: pass --target"):
        load(str(models_dir / "qwen3-dflash"))


@pytest.mark.parametrize("block_size", [0, -3])
def test_bad_block_size(pairs, models_dir, block_size):
    target, drafter, tokenizer = pairs["qwen3"]
    with pytest.raises(DFlashError, match="block_size must be"):
        generate(target, drafter, tokenizer, "hi", block_size=block_size)
    result = CliRunner().invoke(
        app, ["generate", str(models_dir / "qwen3-dflash"), "-t", str(models_dir / "qwen3"), "-p", "hi", "-b", str(block_size)]
    )
    assert result.exit_code == 2 and "block-size must be >= 1" in result.stderr


def test_empty_prompt(pairs):
    target, drafter, tokenizer = pairs["qwen3"]
    with pytest.raises(DFlashError, match="prompt is empty"):
        generate(target, drafter, tokenizer, [])


def _one_line(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error:"), result.output
    return lines[0]


def test_path_errors_say_what_was_given_not_a_drafter(tmp_path, models_dir, monkeypatch):
    """Issue 49, a new user's item 7: a typo, a bundle to convert, a bundle without or with a broken manifest."""
    import shutil

    monkeypatch.chdir(tmp_path)
    line = _one_line("generate", "./bundel", "-p", "hi")
    assert "./bundel: no such folder" in line and "drafter" not in line

    bundle = tmp_path / "bundle"
    shutil.copytree(models_dir / "qwen3-dflash", bundle / "draft")
    shutil.copytree(models_dir / "qwen3", bundle / "target")
    line = _one_line("generate", bundle, "-p", "hi")  # draft/ and target/ but no manifest
    assert "no dflash.json" in line and "convert it again" in line
    (bundle / "dflash.json").write_text("{not json")
    assert "dflash.json is unreadable" in _one_line("generate", bundle, "-p", "hi")
    with pytest.raises(DFlashError, match="dflash.json is unreadable"):
        load(str(bundle))
    (bundle / "dflash.json").write_text('["a list"]')
    assert "is not a dflash-mlx manifest" in _one_line("generate", bundle, "-p", "hi")
    (bundle / "dflash.json").write_text('{"format": 1}')
    assert load(str(bundle))[1].block_size > 1  # a readable manifest: the bundle loads
    line = _one_line("convert", bundle, "-o", tmp_path / "out")
    assert "is already a bundle" in line and not (tmp_path / "out").exists()
