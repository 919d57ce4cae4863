"""`dflash-mlx generate` through Typer's CliRunner on tiny checkpoints."""

from __future__ import annotations

import json

from helpers import plain_greedy
from typer.testing import CliRunner

from dflash_mlx import __version__
from dflash_mlx.cli.main import app


def _args(models_dir, *extra):
    return ["generate", str(models_dir / "llama-dflash"), "--target", str(models_dir / "llama"), *extra]


def test_version():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout.strip() == f"dflash-mlx {__version__}"


def test_generate_json_equals_plain_greedy(pairs, models_dir):
    target, _, tokenizer = pairs["llama"]
    result = CliRunner().invoke(app, _args(models_dir, "-p", "Hello there", "-m", "40", "-b", "4", "--json"))
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    for key in ("text", "tokens", "tau", "prompt_tokens", "generation_tokens", "generation_tps", "prompt_tps"):
        assert key in out
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}], add_generation_prompt=True)
    ref = plain_greedy(target.model, ids, 40, eos=tokenizer.eos_token_ids)
    assert out["tokens"] == ref
    assert out["text"] == tokenizer.decode(ref)
    assert out["prompt_tokens"] == len(ids) and out["generation_tokens"] == len(ref)
    assert 1.0 <= out["tau"] <= 4.0


def test_generate_text_then_stats_line(models_dir):
    result = CliRunner().invoke(app, _args(models_dir, "-p", "Hello", "-m", "12", "--no-chat-template"))
    assert result.exit_code == 0, result.output
    assert result.stdout.strip()  # the generated text
    stats = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(stats) == 1 and "tok/s" in stats[0] and "tau" in stats[0]


def test_prompt_from_stdin(models_dir):
    a = CliRunner().invoke(app, _args(models_dir, "-p", "-", "-m", "8", "--json"), input="Hello")
    b = CliRunner().invoke(app, _args(models_dir, "-p", "Hello", "-m", "8", "--json"))
    assert json.loads(a.stdout)["tokens"] == json.loads(b.stdout)["tokens"]


def test_generate_with_penalties_and_bias_equals_mlx_lms(pairs, models_dir):
    """The processor flags build mlx-lm's processors: the reply is mlx-lm's greedy one with them."""
    from mlx_lm.sample_utils import make_logits_processors

    target, _, tokenizer = pairs["llama"]
    flags = ["--repetition-penalty", "1.5", "--repetition-context-size", "8", "--presence-penalty", "0.5",
             "--frequency-penalty", "0.25", "--logit-bias", '{"7": 3.5}']
    result = CliRunner().invoke(app, _args(models_dir, "-p", "Hello there", "-m", "30", "--json", *flags))
    assert result.exit_code == 0, result.output
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}], add_generation_prompt=True)
    processors = make_logits_processors(logit_bias={7: 3.5}, repetition_penalty=1.5, repetition_context_size=8,
                                        presence_penalty=0.5, frequency_penalty=0.25)
    ref = plain_greedy(target.model, ids, 30, eos=tokenizer.eos_token_ids, logits_processors=processors)
    assert json.loads(result.stdout)["tokens"] == ref != plain_greedy(target.model, ids, 30, eos=tokenizer.eos_token_ids)


def test_bad_processor_flags_are_one_line_errors(models_dir):
    for flags, message in ((["--repetition-penalty", "0"], "--repetition-penalty must be above 0"),
                           (["--logit-bias", "[1, 2]"], "--logit-bias takes a JSON object"),
                           (["--logit-bias", '{"999999": 1}'], "--logit-bias: token 999999 is outside the vocabulary")):
        result = CliRunner().invoke(app, _args(models_dir, "-p", "Hi", "-m", "4", *flags))
        assert result.exit_code != 0 and message in result.output and "Traceback" not in result.output, result.output


def test_a_lora_adapter_is_applied_to_the_target(pairs, models_dir, tmp_path):
    """--adapter-path: the reply is mlx-lm's greedy decoding of the target with the adapter loaded, which differs
    from the bare target's; a folder without the adapter's files is a one-line error."""
    from mlx_lm.utils import load as mlx_lm_load

    from dflash_mlx.models import fixtures

    adapter = fixtures.write_lora_adapter(tmp_path / "adapter", models_dir / "llama")
    target, _, tokenizer = pairs["llama"]
    result = CliRunner().invoke(app, _args(models_dir, "-p", "Hello there", "-m", "24", "--json", "--adapter-path",
                                           str(adapter)))
    assert result.exit_code == 0, result.output
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}], add_generation_prompt=True)
    adapted, _ = mlx_lm_load(str(models_dir / "llama"), adapter_path=str(adapter))
    ref = plain_greedy(adapted, ids, 24, eos=tokenizer.eos_token_ids)
    assert json.loads(result.stdout)["tokens"] == ref != plain_greedy(target.model, ids, 24, eos=tokenizer.eos_token_ids)
    bad = CliRunner().invoke(app, _args(models_dir, "-p", "Hi", "--adapter-path", str(tmp_path)))
    assert bad.exit_code != 0 and "has no adapter_config.json" in bad.output and "Traceback" not in bad.output
    a_file = CliRunner().invoke(app, _args(models_dir, "-p", "Hi", "--adapter-path", str(adapter / "adapters.safetensors")))
    assert a_file.exit_code == 2 and "is a file; expected the folder" in a_file.output


GREETING_TEMPLATE = "{{ greeting | default('') }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


def test_chat_template_args_reach_the_template(pairs, models_dir):
    """--chat-template-args: keyword arguments the template reads (here its greeting), as mlx-lm passes them."""
    _, _, tokenizer = pairs["llama"]
    result = CliRunner().invoke(app, _args(models_dir, "-p", "Hello there", "-m", "2", "--json", "--chat-template",
                                           GREETING_TEMPLATE, "--chat-template-args", '{"greeting": "Ahoy, "}'))
    assert result.exit_code == 0, result.output
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}], chat_template=GREETING_TEMPLATE,
                                             greeting="Ahoy, ", add_generation_prompt=True)
    assert json.loads(result.stdout)["prompt_tokens"] == len(expected) > len(tokenizer.encode("Hello there"))
    bad = CliRunner().invoke(app, _args(models_dir, "-p", "Hi", "--chat-template-args", "[1]"))
    assert bad.exit_code != 0 and "--chat-template-args takes a JSON object" in bad.output
