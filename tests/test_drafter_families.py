"""The drafter families beyond z-lab's Qwen-style DFlash: Gemma 4's, poolside's Laguna DFlash, Meta's Muse Glimmer
assistant. Each loads as published, drafts the same tokens as mlx-vlm 0.7.10's implementation on tiny random
weights (first cycles, greedy), and decodes its target losslessly."""

from __future__ import annotations

import importlib
import json
import sys
import types
import zipfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import PROMPTS
from helpers import plain_greedy

from dflash_mlx import DFlashError, generate, load
from dflash_mlx.models import fixtures
from dflash_mlx.models.laguna_dflash import LagunaDrafter
from dflash_mlx.models.muse_assistant import MuseAssistant

ROOT = Path(__file__).resolve().parent.parent
BLOCK, WINDOW = 8, 12


def _gemma4_config(target: dict) -> dict:
    """z-lab's Gemma 4 drafters: Transformers 5 exports (RoPE in ``rope_parameters``, the soft-cap at the top level),
    no mask token in ``dflash_config`` (Gemma's <mask>, id 4, is meant)."""
    config = fixtures.drafter_config(target, 2, block_size=BLOCK, target_layer_ids=[1, 4])
    del config["dflash_config"]["mask_token_id"], config["rope_theta"], config["rope_scaling"]
    config.update(model_type="gemma4", rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
                  final_logit_softcapping=30.0)
    return config


FAMILIES = {  # name: (target model_type, drafter config of the target's config)
    "gemma4": ("gemma4_text", _gemma4_config),
    "laguna": ("laguna", lambda t: fixtures.laguna_drafter_config(t, 2, BLOCK, WINDOW, target_layer_ids=[0, 2])),
    "muse": ("muse_glimmer", lambda t: fixtures.muse_assistant_config(t, 2, BLOCK, WINDOW, target_layer_ids=[0, 2])),
}


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("families")
    out = {}
    for name, (model_type, make) in FAMILIES.items():
        config = fixtures.target_config(model_type)
        fixtures.write_target(root / model_type, config, seed=7)
        draft = make(config)
        fixtures.write_drafter(root / f"{name}-draft", draft, seed=3)
        out[name] = (root / f"{name}-draft", root / model_type, draft, load(str(root / f"{name}-draft"),
                                                                                str(root / model_type)))
    return out


@pytest.fixture(scope="module")
def mlx_vlm(tmp_path_factory):
    """mlx-vlm 0.7.10's drafter modules from its wheel (``make refs``), without its package imports (it is not
    installed: its dependencies are a vision stack)."""
    wheel = next((ROOT / ".refs").glob("mlx_vlm-0.7.10-*.whl"), None)
    if wheel is None:
        pytest.skip("mlx-vlm 0.7.10's wheel is not in .refs (make refs downloads it)")
    where = tmp_path_factory.mktemp("mlx_vlm")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(where, [n for n in z.namelist() if n.startswith("mlx_vlm/")])
    saved = {k: v for k, v in sys.modules.items() if k == "mlx_vlm" or k.startswith("mlx_vlm.")}
    for name in ("mlx_vlm", "mlx_vlm.models", "mlx_vlm.speculative", "mlx_vlm.speculative.drafters"):
        stub = types.ModuleType(name)
        stub.__path__ = [str(where / name.replace(".", "/"))]
        sys.modules[name] = stub
    try:
        yield {name: importlib.import_module(f"mlx_vlm.speculative.drafters.{name}")
               for name in ("gemma4_dflash", "laguna_dflash", "muse_glimmer_assistant")}
    finally:
        for k in [k for k in sys.modules if k == "mlx_vlm" or k.startswith("mlx_vlm.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def _reference(mlx_vlm, name: str, draft_dir: Path, config: dict, target):
    """mlx-vlm's drafter of this family, its weights read from the same checkpoint, bound to our target's embedding
    and head as its ``bind`` binds them."""
    module = mlx_vlm[{"gemma4": "gemma4_dflash", "laguna": "laguna_dflash", "muse": "muse_glimmer_assistant"}[name]]
    model = module.Model(module.ModelConfig.from_dict(config))
    weights = dict(mx.load(str(draft_dir / "model.safetensors")))
    weights = {k: v.astype(target.dtype) for k, v in (model.sanitize(weights) if name != "laguna" else weights).items()}
    model.load_weights(list(weights.items()))
    body = target.model.model
    model.embed_tokens = body.embed_tokens
    model.embed_scale = getattr(body, "embed_scale", 1.0) if name == "gemma4" else 1.0
    model.lm_head = getattr(target.model, "lm_head", None) or body.embed_tokens.as_linear
    return model


@pytest.mark.parametrize("name", list(FAMILIES))
def test_first_cycles_draft_as_mlx_vlm_does(families, mlx_vlm, name):
    """Three cycles on one pair of caches each: new context, the last token and a block of masks; the same logits
    and greedy drafts."""
    draft_dir, _, config, (target, drafter, tokenizer) = families[name]
    reference = _reference(mlx_vlm, name, draft_dir, config, target)
    ids = tokenizer.encode(PROMPTS[0])
    _, features = target(mx.array(ids)[None], target.make_cache())
    ours, theirs = drafter.make_cache(block_size=BLOCK), reference.make_cache()
    cuts = [5, 8, 10]  # at most WINDOW - 1 context positions in all: both readers keep them all
    assert cuts[-1] < len(ids) and cuts[-1] <= WINDOW - 1
    for start, end in zip([0, *cuts], cuts):
        context, last = features[:, start:end], ids[end]
        got = drafter.draft_logits(target, mx.array([last]), context, ours, BLOCK - 1)
        block = mx.array([[last] + [drafter.mask_token_id] * (BLOCK - 1)])
        want = reference(block, context, theirs)[0, 1:]
        np.testing.assert_allclose(np.array(got, dtype=np.float32), np.array(want, dtype=np.float32), rtol=2e-3,
                                   atol=2e-3)
        assert mx.argmax(got, -1).tolist() == mx.argmax(want, -1).tolist()
    assert drafter.mask_token_id == (4 if name == "gemma4" else fixtures.SPECIAL_TOKENS.index("<|mask|>"))


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("block_size", [4, BLOCK])
def test_lossless_on_their_targets(families, name, block_size):
    _, _, _, (target, drafter, tokenizer) = families[name]
    for prompt in PROMPTS[:2]:
        ids = tokenizer.encode(prompt)
        ref = plain_greedy(target.model, ids, 60)
        out = generate(target, drafter, tokenizer, ids, max_tokens=60, block_size=block_size, eos_token_ids=[])
        assert out.tokens == ref, f"{name} B={block_size}"


def test_kinds_follow_the_config(families):
    assert isinstance(families["laguna"][3][1], LagunaDrafter)
    assert isinstance(families["muse"][3][1], MuseAssistant)
    gemma = families["gemma4"][3][1]
    assert type(gemma).__name__ == "Drafter" and gemma.compute_logits(mx.array([100.0])).item() == pytest.approx(
        30.0 * np.tanh(100 / 30), rel=1e-5)
    target = families["gemma4"][3][0]
    np.testing.assert_allclose(np.array(target.embed(mx.array([7]))),
                               np.array(target.model.model.embed_tokens(mx.array([7]))) * 64**0.5, rtol=1e-6)


def test_laguna_split_projections_load_fused(families, tmp_path):
    """A Transformers export with q/k/v_proj apart loads as poolside's fused qkv_proj, drafting the same."""
    draft_dir, target_dir, _, (target, drafter, tokenizer) = families["laguna"]
    weights = dict(mx.load(str(draft_dir / "model.safetensors")))
    split = {}
    for k, v in weights.items():
        if k.endswith("qkv_proj.weight"):
            q, kk, vv = mx.split(v, [4 * 16, 6 * 16], axis=0)
            for part, w in zip(("q_proj", "k_proj", "v_proj"), (q, kk, vv)):
                split["model." + k.replace("qkv_proj", part)] = w
        else:
            split["model." + k] = v
    (tmp_path / "d").mkdir()
    mx.save_safetensors(str(tmp_path / "d" / "model.safetensors"), split)
    (tmp_path / "d" / "config.json").write_text((draft_dir / "config.json").read_text())
    _, again, _ = load(str(tmp_path / "d"), str(target_dir))
    ids = tokenizer.encode(PROMPTS[1])

    def drafts(d) -> list[list[int]]:
        seen: list[list[int]] = []
        generate(target, d, tokenizer, ids, max_tokens=30, block_size=4, eos_token_ids=[],
                 on_response=lambda r: seen.append(r.drafted))
        return seen

    assert drafts(again) == drafts(drafter) and any(drafts(drafter))


@pytest.mark.parametrize("name, edit, match", [
    ("laguna", lambda c: c["dflash_config"].update(causal=False), "draft causally"),
    ("laguna", lambda c: c.update(gating="per-channel"), "per-head gating"),
    ("laguna", lambda c: c.update(draft_vocab_size=100), "draft_vocab_size"),
    ("muse", lambda c: c.update(target_layer_ids=[0]), "one target layer per layer"),
    ("gemma4", lambda c: c.update(model_type="qwen3"), "no dflash_config.mask_token_id"),
])
def test_bad_configs_are_one_line_errors(families, tmp_path, name, edit, match):
    draft_dir, target_dir, config, _ = families[name]
    config = json.loads(json.dumps(config))
    edit(config)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "model.safetensors").symlink_to(draft_dir / "model.safetensors")
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    with pytest.raises(DFlashError, match=match):
        load(str(tmp_path / "d"), str(target_dir))
