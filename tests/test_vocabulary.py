"""A drafter's own vocabulary: its head cut to the tokens it drafts, lossless, kept by its files and by convert."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import PROMPTS
from helpers import plain_greedy
from typer.testing import CliRunner

from dflash_mlx import DFlashError, generate, load
from dflash_mlx.cli.main import app
from dflash_mlx.models import fixtures
from dflash_mlx.models.convert import convert
from dflash_mlx.models.vocabulary import DraftVocabulary


def _with_vocabulary(source: Path, out: Path, ids) -> Path:
    shutil.copytree(source, out)
    return fixtures.write_draft_vocabulary(out, ids)


@pytest.mark.parametrize("name", ["qwen3", "llama"])  # its own LM head; tied embeddings
@pytest.mark.parametrize("quantized", [False, True], ids=["float", "4bit"])
def test_the_cut_head_is_the_target_heads_own_columns(models_dir, tmp_path, name, quantized):
    draft, target_path = models_dir / f"{name}-dflash", models_dir / name
    if quantized:  # QuantizedLinear / QuantizedEmbedding heads: weights, scales and biases cut alike
        draft = convert(str(draft), str(tmp_path / "bundle"), target=str(target_path), quantize="4bit")
        target_path = draft / "target"
    target, _, _ = load(str(draft), str(target_path))
    assert isinstance(target.head_module, (nn.QuantizedLinear, nn.QuantizedEmbedding)) == quantized
    ids = np.sort(np.random.default_rng(0).choice(target.vocab_size, 57, replace=False))
    vocabulary = DraftVocabulary(ids, target.vocab_size)
    h = mx.random.normal((2, 5, target.hidden_size), key=mx.random.key(1)).astype(target.dtype)
    cut, whole = vocabulary.head(target)(h), target.lm_head(h)
    assert cut.shape == (2, 5, 57)
    np.testing.assert_allclose(np.array(cut.astype(mx.float32)), np.array(whole[..., mx.array(ids)].astype(mx.float32)),
                               rtol=1e-2, atol=1e-2)
    assert vocabulary.head(target) is vocabulary.head(target)  # rows gathered once per target head


def test_drafts_come_from_the_vocabulary_only_and_map_back(looping_dir, looping, tmp_path):
    """The constant drafter drafts the loop token: with it in a vocabulary (at some inner position) its drafts are
    accepted as before; with it left out, none of the drafter's drafts is; both outputs are the target's own."""
    target, drafter, tokenizer, ids, ref, loop_token = looping
    full = generate(target, drafter, tokenizer, ids, max_tokens=len(ref), eos_token_ids=[], block_size=4,
                    draft_source="drafter")
    others = [t for t in range(0, target.vocab_size, 7) if t != loop_token]
    runs = {}
    for kind, vocab in (("with", sorted(others[:20] + [loop_token])), ("without", others)):
        folder = _with_vocabulary(looping_dir / "constant", tmp_path / kind, vocab)
        _, cut, _ = load(str(folder), str(looping_dir / "target"))
        assert cut.vocabulary.ids.tolist() == vocab
        runs[kind] = generate(target, cut, tokenizer, ids, max_tokens=len(ref), eos_token_ids=[], block_size=4,
                              draft_source="drafter")
        assert runs[kind].tokens == ref
    assert sum(full.acceptance) > 40  # 88 of 200 tokens: the loop token while the target repeats it
    assert runs["with"].acceptance == full.acceptance
    assert sum(runs["without"].acceptance) == 0


@pytest.mark.parametrize("block_size", [4, None])
def test_greedy_output_with_a_vocabulary_is_the_targets(models_dir, tmp_path, block_size):
    for name in ("qwen3", "llama"):  # the llama drafter is sharded in three files: the vocabulary joins them in one
        folder = _with_vocabulary(models_dir / f"{name}-dflash", tmp_path / f"{name}-{block_size}", range(1, 300, 3))
        target, drafter, tokenizer = load(str(folder), str(models_dir / name))
        assert drafter.vocabulary is not None
        for prompt in PROMPTS:
            prompt_ids = tokenizer.encode(prompt)
            out = generate(target, drafter, tokenizer, prompt_ids, max_tokens=60, block_size=block_size)
            assert out.tokens == plain_greedy(target.model, prompt_ids, 60, eos=tokenizer.eos_token_ids)


def test_convert_keeps_the_vocabulary(models_dir, tmp_path):
    folder = _with_vocabulary(models_dir / "qwen3-dflash", tmp_path / "drafter", [5, 9, 100, 200])
    for quantize in ("none", "4bit"):
        out = convert(str(folder), str(tmp_path / f"bundle-{quantize}"), target=str(models_dir / "qwen3"),
                      draft_quantize=quantize)
        _, drafter, _ = load(str(out))
        assert drafter.vocabulary.ids.tolist() == [5, 9, 100, 200]
        config = json.loads((out / "draft" / "config.json").read_text())
        assert config["dflash_config"]["draft_vocab_size"] == 4


def _edit(folder: Path, *, tensor=None, size=None, drop_tensor=False) -> None:
    weights = mx.load(str(folder / "model.safetensors"))
    if drop_tensor:
        weights.pop("draft_vocab")
    if tensor is not None:
        weights["draft_vocab"] = tensor
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    config = json.loads((folder / "config.json").read_text())
    if size == "drop":
        config["dflash_config"].pop("draft_vocab_size")
    elif size is not None:
        config["dflash_config"]["draft_vocab_size"] = size
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "case,edit,message",
    [
        ("no-tensor", dict(drop_tensor=True), "has a draft vocabulary without the tensor draft_vocab"),
        ("no-size", dict(size="drop"), "has a draft vocabulary without dflash_config.draft_vocab_size"),
        ("size", dict(size=5), "draft_vocab has shape [4], its config says draft_vocab_size 5"),
        ("order", dict(tensor=mx.array([9, 5, 100, 200], dtype=mx.int32)), "must be ascending and distinct"),
        ("range", dict(tensor=mx.array([5, 9, 100, 9000], dtype=mx.int32)), "holds token 9000, outside the vocabulary"),
        ("floats", dict(tensor=mx.array([5.0, 9.0, 100.0, 200.0])), "a non-empty list of token ids"),
    ],
)
def test_a_damaged_vocabulary_is_one_clear_error(models_dir, tmp_path, case, edit, message):
    folder = _with_vocabulary(models_dir / "qwen3-dflash", tmp_path / case, [5, 9, 100, 200])
    _edit(folder, **edit)
    with pytest.raises(DFlashError) as info:
        load(str(folder), str(models_dir / "qwen3"))
    assert message in str(info.value) and "\n" not in str(info.value)
    result = CliRunner().invoke(app, ["generate", str(folder), "-t", str(models_dir / "qwen3"), "-p", "hi", "-m", "4"])
    assert result.exit_code == 2 and message in result.stderr and "Traceback" not in result.output


def test_other_drafter_kinds_refuse_a_vocabulary(models_dir, tmp_path):
    config = json.loads((models_dir / "qwen3" / "config.json").read_text())
    folder = fixtures.write_dflash2_drafter(tmp_path / "d2", fixtures.dflash2_config(config, target_layer_ids=[1]))
    fixtures.write_draft_vocabulary(folder, [1, 2, 3])
    with pytest.raises(DFlashError, match="supported for DFlash drafters only"):
        load(str(folder), str(models_dir / "qwen3"))


def test_the_vocabulary_of_replies_ranks_replies_first():
    v = DraftVocabulary.from_replies([[7, 7, 3], [7, 4]], [[9, 9, 1, 3]], vocab_size=10, limit=3)
    assert v.ids.tolist() == [3, 4, 7]  # 7 (3 times), 3 (once, and in a prompt), 4 (once): 9 is prompt-only
    assert DraftVocabulary.from_replies([[1]], [], vocab_size=10, limit=0) is None
    assert DraftVocabulary.from_replies([list(range(10))], [], vocab_size=10, limit=20) is None  # all of it
    q = mx.log(mx.array([[0.25, 0.75, 0.0]]))
    full = np.array(DraftVocabulary([2, 5, 8], 10).expand(q))
    assert np.isneginf(full[0, [0, 1, 3, 4, 6, 7, 9]]).all() and np.allclose(np.exp(full[0, [2, 5]]), [0.25, 0.75])
