"""`models`, `convert` and `doctor`, and registry name resolution, through the real CLI."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import sys
from importlib import resources

import pytest
from helpers import plain_greedy
from typer.testing import CliRunner

from dflash_mlx import DFlashError, generate, load
from dflash_mlx.cli.main import app
from dflash_mlx.models import registry
from dflash_mlx.models.convert import convert


def _run(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert "Traceback" not in result.output
    return result


def _one_error_line(result, *fragments):
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
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
    """Every published drafter's target runs, and its architecture is among those tested lossless here."""
    from dflash_mlx.models.target import TESTED_MODEL_TYPES

    for p in registry.pairs():
        assert p.drafter.startswith(("z-lab/", "meta-models/")) and "/" in p.target
        assert p.thinking in ("on", "off", "none", "unknown") and p.memory_gb > 0
        assert p.supported and p.tested and p.model_type in TESTED_MODEL_TYPES
        assert not p.gated or "gated" in p.notes
    raw = json.loads(resources.files("dflash_mlx").joinpath("data/registry.json").read_text())["pairs"]
    assert not any("block_size" in entry for entry in raw)  # the drafter's config.json is the one source


def test_registry_matches_the_published_repos():
    """What the model cards and configs say (issue 15): names, target architectures, gating, new entries."""
    assert registry.find("z-lab/GLM-5.1-DFlash") is None
    glm = registry.find("GLM-5.1")
    assert glm.drafter == "z-lab/GLM-5.1-FP8-DFlash" and glm.gated
    assert registry.find("MiniMax-M2.5").model_type == "minimax_m2" and registry.find("MiniMax-M2.5").gated
    assert registry.find("MiniMax-M2.7").gated and registry.find("Kimi-K2.6").gated
    assert registry.find("gemma-4-26B-A4B").target == "google/gemma-4-26B-A4B-it"
    assert registry.find("Qwen3.5-4B").thinking == "on" and registry.find("Qwen3-8B").thinking == "off"


def test_unknown_repo_asks_for_its_target():
    """Offline, a repo not in the registry may be a model alone or a drafter: the line covers both."""
    result = _run("generate", "z-lab/Qwen3-9B-DFlash", "-p", "hi")
    _one_error_line(result, "cannot download model z-lab/Qwen3-9B-DFlash", "not in the registry", "--target TARGET")
    assert "Pass" not in result.stderr


def test_mistyped_name_or_folder_says_no_such_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    _one_error_line(_run("generate", "Qwen3-9B-DFlash", "-p", "hi"), "no such folder or registry name", "did you mean")
    _one_error_line(_run("generate", "models/qwen3-dflsh", "-p", "hi"), "no such folder")
    _one_error_line(_run("generate", "my-drafter", "-p", "hi"), "my-drafter: no such folder")
    (tmp_path / "model.safetensors").write_bytes(b"x")  # a file where a folder is expected says so
    _one_error_line(_run("generate", "model.safetensors", "-p", "hi"), "model.safetensors is a file")


def test_sinks_without_a_window_are_refused(models_dir):
    """Sinks are positions a window keeps: alone they would be silently ignored."""
    result = _run("generate", models_dir / "qwen3-dflash", "--target", models_dir / "qwen3", "-p", "hi", "--sinks", "4")
    _one_error_line(result, "give a window too")


def test_a_batch_of_no_rows_is_refused_before_loading(models_dir):
    for bad in ("0", "-2"):
        result = _run("serve", models_dir / "qwen3-dflash", "--target", models_dir / "qwen3", "--max-batch", bad)
        _one_error_line(result, "--max-batch must be an integer of at least 1")


def test_an_empty_api_key_is_refused_before_loading(models_dir):
    """`--api-key "$KEY"` with KEY unset must not serve without a key (issue 49, item 3)."""
    for empty in ("", "  "):
        result = _run("serve", models_dir / "qwen3-dflash", "--target", models_dir / "qwen3", "--api-key", empty)
        _one_error_line(result, "--api-key is empty")


def test_nan_and_infinity_are_refused_before_loading(models_dir):
    """Non-finite numbers end in one line, never a traceback or garbage sampled at exit 0 (issue 49, item 5)."""
    pair = [models_dir / "qwen3-dflash", "--target", models_dir / "qwen3"]
    for value in ("nan", "inf", "1e400"):
        _one_error_line(_run("generate", *pair, "-p", "hi", "--temp", value), "temperature must be >= 0 and finite")
        for flag in ("--prompt-cache-bytes", "--prompt-cache-disk-bytes"):
            _one_error_line(_run("serve", *pair, flag, value), f"{flag} must be a finite size above 0")
    for flag in ("--presence-penalty", "--frequency-penalty"):
        _one_error_line(_run("generate", *pair, "-p", "hi", flag, "nan"), f"{flag} must be a finite number")
    _one_error_line(_run("generate", *pair, "-p", "hi", "--repetition-penalty", "inf"), "--repetition-penalty")
    _one_error_line(_run("generate", *pair, "-p", "hi", "--logit-bias", '{"1": NaN}'), "must be finite numbers")
    _one_error_line(_run("train", models_dir / "qwen3", "-o", models_dir / "unused", "--time", "inf"),
                    "--time must be a finite duration")


def test_usage_errors_are_one_line(models_dir):
    """A mistyped number, an unknown flag or command, a missing argument: one error line naming the help, exit 2
    (issue 49, a new user's item 10), not a usage block and a boxed panel."""
    cases = [(["generate", "x", "--max-tokens", "abc"], "Invalid value for '--max-tokens'"),
             (["generate", "x", "--bogus"], "No such option: --bogus"), (["convert"], "Missing argument"),
             (["nosuch"], "No such command 'nosuch'")]
    for args, fragment in cases:
        _one_error_line(_run(*args), fragment, "--help)")
    bare = _run()
    assert bare.exit_code == 2 and "COMMAND [ARGS]" in bare.output  # a bare command still shows its help


def test_target_that_is_a_drafter(models_dir):
    result = _run("generate", models_dir / "qwen3-dflash", "--target", models_dir / "llama-dflash", "-p", "hi")
    _one_error_line(result, "holds a DFlash drafter, not a target model")


def test_prompt_longer_than_the_model(models_dir):
    """The fixture target takes 4096 positions."""
    base = ["generate", models_dir / "qwen3-dflash", "--target", models_dir / "qwen3", "--no-chat-template"]
    _one_error_line(_run(*base, "-p", "a " * 5000, "-m", "4"), "at most 4096 positions")
    result = _run(*base, "-p", "a " * 4090, "-m", "20", "--json")
    out = json.loads(result.stdout)
    left = 4096 - out["prompt_tokens"]
    assert result.exit_code == 0 and f"leaves {left} of the model's 4096 positions" in result.stderr
    assert out["finish_reason"] == "length" and len(out["tokens"]) == left < 20  # stopped at the end of the context


@pytest.mark.parametrize("seed", ["-1", str(2**64)])
def test_a_seed_out_of_range_is_one_line(models_dir, seed):
    base = ["generate", models_dir / "qwen3-dflash", "--target", models_dir / "qwen3", "-p", "hi", "--temp", "1"]
    _one_error_line(_run(*base, "--seed", seed), "seed must be an integer from 0 to 2**64 - 1")


def test_generate_stops_before_a_stop_string(models_dir, pairs):
    """--stop: the text ends just before the first stop string, which is never printed."""
    target, drafter, tokenizer = pairs["qwen3"]
    base = ["generate", models_dir / "qwen3-dflash", "--target", models_dir / "qwen3", "-p", "import json", "-m", "40"]
    full = json.loads(_run(*base, "--json").stdout)["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    result = _run(*base, "--json", "--stop", stop, "--stop", "no such text")
    out = json.loads(result.stdout)
    assert out["text"] == full[: full.index(stop)] and out["finish_reason"] == "stop" and out["stop_sequence"] == stop
    printed = _run(*base, "--stop", stop)
    assert printed.stdout == full[: full.index(stop)] + "\n"


# -- downloads --------------------------------------------------------------------

def _hub_error(cls):
    import httpx2 as httpx

    response = httpx.Response(403, request=httpx.Request("GET", "https://huggingface.co/x"))
    return cls("Access to model z-lab/MiniMax-M2.5-DFlash is restricted", response=response)


def test_gated_repo_says_accept_and_log_in(monkeypatch):
    from huggingface_hub.errors import GatedRepoError

    def refuse(*args, **kwargs):
        raise _hub_error(GatedRepoError)

    monkeypatch.setattr("huggingface_hub.snapshot_download", refuse)
    result = _run("generate", "MiniMax-M2.5", "--target", "MiniMaxAI/MiniMax-M2.5", "-p", "hi")
    _one_error_line(result, "is gated", "https://huggingface.co/z-lab/MiniMax-M2.5-DFlash", "hf auth login")


def test_downloads_fetch_only_what_loading_reads(monkeypatch, models_dir):
    """The patterns passed to the Hub, applied to real repo layouts: no original/ or metal/ copies."""
    from huggingface_hub.utils import filter_repo_objects

    from dflash_mlx.models.loader import resolve

    seen = {}

    def snapshot(name, **kwargs):
        seen.update(kwargs)
        return str(models_dir / "qwen3")

    monkeypatch.setattr("huggingface_hub.snapshot_download", snapshot)
    resolve("meta-llama/Llama-3.1-8B-Instruct", "target")
    files = ["config.json", "generation_config.json", "model-00001-of-00004.safetensors", "model.safetensors.index.json",
             "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
             "original/consolidated.00.pth", "original/params.json", "original/tokenizer.model",
             "original/model.safetensors", "metal/model.bin", "LICENSE", "README.md", "USE_POLICY.md"]
    kept = set(filter_repo_objects(files, allow_patterns=seen["allow_patterns"], ignore_patterns=seen["ignore_patterns"]))
    assert {"config.json", "model-00001-of-00004.safetensors", "model.safetensors.index.json", "tokenizer.json",
            "tokenizer_config.json", "chat_template.jinja"} <= kept
    assert not any(f.startswith(("original/", "metal/")) for f in kept), kept
    assert "model.safetensors" in set(filter_repo_objects(["model.safetensors", "draft.safetensors"], **{
        k: seen[k] for k in ("allow_patterns", "ignore_patterns")}))


def test_registry_rows_of_every_architecture_resolve_to_their_download(monkeypatch):
    """Kimi K2.5's row (an MLA target) is no longer refused: offline, it is its download that fails, in one line."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = _run("generate", "Kimi-K2.5", "-p", "hi")
    _one_error_line(result, "cannot download", "z-lab/Kimi-K2.5-DFlash")


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
    (bundle / "dflash.json").write_text(json.dumps({"format": 1, "drafter": "z-lab/Qwen3-8B-DFlash-b16"}))
    rows = {r["drafter"]: r for r in json.loads(_run("models", "--json").stdout)}
    assert len(rows) == len(registry.pairs())
    assert rows["z-lab/Qwen3-4B-DFlash-b16"]["downloaded"]
    assert not rows["z-lab/Qwen3-8B-DFlash-b16"]["downloaded"]
    assert rows["z-lab/Qwen3-8B-DFlash-b16"]["converted"] == [str(bundle.resolve())]
    table = CliRunner(env={"COLUMNS": "80"}).invoke(app, ["models"])
    assert table.exit_code == 0
    row = next(line for line in table.stdout.splitlines() if line.split()[:1] == ["Qwen3-8B"])
    assert row.split()[1:] == ["Qwen/Qwen3-8B", "off", "18", "converted"]
    assert str(bundle.resolve()) in table.stdout and "z-lab/Qwen3-8B-DFlash-b16 -> " in table.stdout


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
    assert 4 < float(result.stdout.split("target at ")[1].split()[0]) < 8  # 4-bit codes + float32 scales, biases
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


def test_convert_into_new_folders_with_usual_permissions(models_dir, tmp_path, monkeypatch):
    """Parents are created, the bundle is not private, the manifest finds its sources from anywhere, the
    last line sums it up, and `models`/`doctor` list it from another folder."""
    monkeypatch.chdir(models_dir)
    old = os.umask(0o022)
    try:
        result = _run("convert", "qwen3-dflash", "--target", "qwen3", "-o", tmp_path / "a" / "b" / "bundle")
    finally:
        os.umask(old)
    assert result.exit_code == 0, result.output
    bundle = tmp_path / "a" / "b" / "bundle"
    assert stat.S_IMODE(bundle.stat().st_mode) == 0o755
    manifest = json.loads((bundle / "dflash.json").read_text())
    assert manifest["drafter"] == str(models_dir / "qwen3-dflash") and manifest["target"] == str(models_dir / "qwen3")
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith(str(bundle)) and "bits per weight" in last
    # a size people read, never "0.00 GB" for a small folder (issue 49, a new user's item 10)
    assert re.search(r": [1-9][0-9.]* (KB|MB|GB) on disk", last), last
    bits = float(last.split("target at ")[1].split()[0])
    assert 31.5 < bits < 33  # the fixture target is float32
    monkeypatch.chdir(tmp_path)
    assert bundle in registry.known_bundles()
    assert str(bundle) in _run("doctor").stdout


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
