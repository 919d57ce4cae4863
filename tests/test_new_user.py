"""What a new user meets: the offline path, chat templates given by hand, limits said in one line, Ctrl-C, the
BLAS warning, the Makefile's chat. Through the real console script or the CLI, as a user runs them."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import default_sigint, finish
from typer.testing import CliRunner

from dflash_mlx import generate, load
from dflash_mlx.chat_template import render, user
from dflash_mlx.cli.main import app
from dflash_mlx.system import blas_check, find_openblas

ROOT = Path(__file__).resolve().parent.parent
CLI = Path(sys.executable).parent / "dflash-mlx"
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _one_error(result, *fragments):
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture(scope="module")
def base_model(models_dir, tmp_path_factory):
    """The Qwen3 fixture target as a base model: its tokenizer has no chat template."""
    target = tmp_path_factory.mktemp("base") / "target"
    shutil.copytree(models_dir / "qwen3", target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


def test_a_chat_template_given_by_hand(models_dir, base_model, tmp_path):
    """--chat-template (a file or the text) makes a base model chat, as its own template would."""
    draft = str(models_dir / "qwen3-dflash")
    template_file = tmp_path / "template.jinja"
    template_file.write_text(TEMPLATE)
    _, _, tokenizer = load(draft, str(models_dir / "qwen3"))
    expected = json.loads(CliRunner().invoke(app, ["generate", draft, "-t", str(models_dir / "qwen3"), "-p", "hi",
                                                   "-m", "12", "--json"]).stdout)
    for given in (str(template_file), TEMPLATE):
        run = CliRunner().invoke(app, ["generate", draft, "-t", str(base_model), "-p", "hi", "-m", "12", "--json",
                                       "--chat-template", given])
        assert run.exit_code == 0, run.output
        assert json.loads(run.stdout)["tokens"] == expected["tokens"]  # the same prompt as the model's own template
    chat = CliRunner().invoke(app, ["chat", draft, "-t", str(base_model), "-m", "8", "--chat-template", str(template_file)],
                              input="hello\n")
    assert chat.exit_code == 0 and "tok/s" in chat.stderr, chat.output
    _one_error(CliRunner().invoke(app, ["generate", draft, "-t", str(base_model), "-p", "hi", "--chat-template",
                                        str(tmp_path / "nope.jinja")]), "--chat-template", "no such file")
    _one_error(CliRunner().invoke(app, ["chat", draft, "-t", str(base_model)], input="hello\n"),
               "no chat template", "--chat-template FILE")


def test_chat_refuses_a_message_longer_than_the_model_and_goes_on(models_dir):
    """One check for generate, chat and serve: chat says so in one line and answers the next message."""
    args = [str(CLI), "chat", str(models_dir / "qwen3-dflash"), "--target", str(models_dir / "qwen3"), "-m", "8"]
    run = subprocess.run(args, input="a " * 5000 + "\nhello\n", capture_output=True, text=True, timeout=120,
                         env={**os.environ, "COLUMNS": "300"})
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert lines[0].startswith("error: the prompt has") and "at most 4096 positions" in lines[0]
    assert len(lines) == 2 and "tok/s" in lines[1]  # the next message was answered


def test_block_size_beyond_the_trained_block_is_refused(models_dir):
    result = CliRunner().invoke(app, ["generate", str(models_dir / "qwen3-dflash"), "-t", str(models_dir / "qwen3"),
                                      "-p", "hi", "--block-size", "99"])
    _one_error(result, "block size 99 is larger than the block this drafter was trained for (16)")


def test_a_target_without_tokenizer_files_says_so_whole(models_dir, tmp_path):
    target = tmp_path / "target"
    shutil.copytree(models_dir / "qwen3", target)
    (target / "tokenizer.json").unlink()
    result = CliRunner().invoke(app, ["generate", str(models_dir / "qwen3-dflash"), "-t", str(target), "-p", "hi"])
    _one_error(result, "has no tokenizer", "tokenizer.json", "copy the tokenizer files")


@pytest.mark.parametrize("sent,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_during_generate_json_keeps_what_was_generated(models_dir, sent, code):
    """The JSON of the tokens so far, marked interrupted, and a statistics line; exit 130 after Ctrl-C, 143 after
    SIGTERM (a supervisor or `timeout` stopping it: the figures used to be lost with it)."""
    args = [str(CLI), "generate", str(models_dir / "qwen3-dflash"), "--target", str(models_dir / "qwen3"), "-p", "hi",
            "-m", "100000", "--json"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_sigint)
    # Decoding starts as the note on the model's positions is printed; the whole reply takes a few seconds here, so a
    # fixed sleep from the start could land after it (on OpenBLAS the load and 4k tokens fit in 8 s).
    started = ""
    while "positions" not in started and proc.poll() is None:
        started += proc.stderr.readline()
    time.sleep(1)
    proc.send_signal(sent)
    out, err = finish(proc, 60)
    err = started + err
    assert proc.returncode == code and "Traceback" not in err, err
    result = json.loads(out)
    assert result["interrupted"] and result["finish_reason"] == "interrupted" and len(result["tokens"]) > 10
    assert "interrupted" in err.splitlines()[-1] and f"generated {len(result['tokens'])} tok" in err


@pytest.mark.skipif(blas_check() is None or blas_check()[0] != "reference", reason="needs MLX on the reference BLAS")
def test_every_decoding_command_runs_on_openblas_or_says_it_cannot(models_dir):
    """Where OpenBLAS is installed the command restarts on it (issue 49, a new user's item 4); where it is not,
    every decoding command warns. DFLASH_MLX_BLAS_WARNING=0 leaves the BLAS alone and says nothing."""
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_MLX_BLAS_WARNING"}
    args = [str(models_dir / "qwen3-dflash"), "--target", str(models_dir / "qwen3")]
    for command in (["generate", *args, "-p", "hi", "-m", "4"], ["chat", *args, "-m", "4"]):
        run = subprocess.run([str(CLI), *command], input="hi\n", capture_output=True, text=True, timeout=120,
                             env={**env, "COLUMNS": "400"})
        assert run.returncode == 0, run.stderr
        warned = "warning: MLX runs on the reference BLAS" in run.stderr
        assert warned == (find_openblas() is None), run.stderr
    doctor = subprocess.run([str(CLI), "doctor"], capture_output=True, text=True, timeout=120, env={**env, "COLUMNS": "400"})
    blas = next(line for line in doctor.stdout.splitlines() if line.startswith("BLAS"))
    assert ("reference BLAS" in blas) == (find_openblas() is None) and ("openblas" in blas) == (find_openblas() is not None)
    quiet = subprocess.run([str(CLI), "generate", *args, "-p", "hi", "-m", "4"], capture_output=True, text=True,
                           timeout=120, env={**env, "DFLASH_MLX_BLAS_WARNING": "0"})
    assert quiet.returncode == 0 and "reference BLAS" not in quiet.stderr


def test_offline_the_default_pair_says_how_to_build_a_local_one():
    result = CliRunner(env={"HF_HUB_OFFLINE": "1"}).invoke(app, ["chat"], input="hi\n")
    assert result.exit_code == 2 and "Traceback" not in result.output
    error = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "cannot download" in error[0] and "make pair" in error[0] and "make chat MODEL=" in error[0]


def test_make_chat_passes_the_model_and_its_target():
    run = subprocess.run(["make", "-n", "-C", str(ROOT), "chat", "MODEL=some/bundle", "TARGET=some/target"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "dflash-mlx chat some/bundle --target some/target" in run.stdout, run.stdout
    def make(*args: str) -> str:
        return subprocess.run(["make", "-n", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=60).stdout

    assert "bench/real_pair.py --time 60m" in make("pair") and "bench/build_pair.py --quick" in make("pair-quick")
    assert "bench/real_pair.py --time 240m" in make("pair", "PAIR_MINUTES=240")


def test_the_library_renders_and_refuses_the_same_as_the_commands(models_dir, base_model):
    """The library raises what the CLI prints: no template, and a prompt that fills the positions."""
    from dflash_mlx import DFlashError

    target, drafter, tokenizer = load(str(models_dir / "qwen3-dflash"), str(base_model))
    with pytest.raises(DFlashError, match="no chat template"):
        render(tokenizer, user("hi"))
    with pytest.raises(DFlashError, match="at most 4096 positions"):
        generate(target, drafter, tokenizer, "a " * 5000, max_tokens=4)
    own = load(str(models_dir / "qwen3-dflash"), str(base_model), chat_template=TEMPLATE)[2]
    assert render(own, user("hi")) == render(load(str(models_dir / "qwen3-dflash"), str(models_dir / "qwen3"))[2],
                                             user("hi"))
