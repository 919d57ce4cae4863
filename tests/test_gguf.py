"""GGUF in: tiny GGUF files written with ggml's own writer, converted, and checked against an independent reading.

Each fixture starts from a random mlx-lm checkpoint in Hugging Face layout (``fixtures.write_target``) and
writes it the way llama.cpp's converter does: GGUF names, Llama's query/key rows permuted for its RoPE,
Gemma's norms stored as 1 + w, the tokenizer as metadata. The conversion must give back the original:
equal logits for float files, weights equal to ggml's own dequantization for quantized ones.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402
from mlx_lm.utils import load_model, load_tokenizer  # noqa: E402

from dflash_mlx.errors import DFlashError  # noqa: E402
from dflash_mlx.models import fixtures  # noqa: E402
from dflash_mlx.models.convert import convert  # noqa: E402

ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}
LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down"}
LLAMA_LAYER = dict(LAYER, post_attention_layernorm="ffn_norm")
GEMMA_LAYER = dict(LAYER, post_attention_layernorm="post_attention_norm", pre_feedforward_layernorm="ffn_norm",
                   post_feedforward_layernorm="post_ffw_norm")
TEXTS = ["Hello world, def f(x): return x + 1", "  two  spaces\tand a tab\n\nnew lines 12345",
         "<|im_start|>user\nhi<|im_end|>", "naïve café — ünïcode ✓"]


def gguf_name(model_type: str, name: str) -> str:
    """llama.cpp's name for an mlx-lm (= Hugging Face) parameter name."""
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    base, suffix = name.rsplit(".", 1)
    if base in top:
        return f"{top[base]}.{suffix}"
    _, _, i, rest = base.split(".", 3)
    layers = GEMMA_LAYER if model_type == "gemma3_text" else LLAMA_LAYER
    return f"blk.{i}.{layers[rest]}.{suffix}"


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama's q/k rows (its `permute`), written out here independently."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encoded(weight: np.ndarray, kind: Q) -> np.ndarray:
    """A 2-D float weight in ``kind``; K-quants (which gguf-py cannot quantize) as random blocks of finite scales."""
    if kind in (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0):
        return quantize(weight, kind)
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(weight.size)
    return rng.integers(0, 0x3C, size=(weight.shape[0], weight.shape[1] // block * size), dtype=np.uint8)


def write_gguf(source: Path, path: Path, kind: Q = Q.F32, tokenizer: str = "gpt2", pre: str = "gpt-2",
               extra: dict | None = None) -> dict[str, np.ndarray]:
    """``source`` (an HF-layout checkpoint) as llama.cpp writes it; returns the GGUF tensors by name."""
    config = json.loads((source / "config.json").read_text())
    model_type, arch = config["model_type"], ARCH[config["model_type"]]
    weights = {k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(source / "model.safetensors")).items()}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if model_type == "gemma3_text":
        writer.add_sliding_window(config["sliding_window"])
    if tokenizer == "gpt2":
        tok = json.loads((source / "tokenizer.json").read_text())
        vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
        tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
        specials = {t["content"] for t in tok["added_tokens"] if t["special"]}
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types([3 if t in specials else 1 for t in tokens])
        writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
        writer.add_eos_token_id(vocab["<|im_end|>"])
        writer.add_add_bos_token(False)
        writer.add_chat_template(fixtures.CHAT_TEMPLATE)
    for key, value in (extra or {}).items():
        value(writer) if callable(value) else writer.add_string(key, value)
    written = {}
    for name, w in weights.items():
        if model_type == "gemma3_text" and name.endswith("norm.weight"):
            w = w + 1
        if model_type == "llama" and (".q_proj." in name or ".k_proj." in name):
            w = llama_cpp_permute(w, config["num_attention_heads" if ".q_proj." in name else "num_key_value_heads"])
        wkind = kind if w.ndim == 2 and "embed" not in name else Q.F32
        data = encoded(w, wkind)
        written[gguf_name(model_type, name)] = data
        writer.add_tensor(gguf_name(model_type, name), data, raw_dtype=wkind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def make_source(root: Path, model_type: str, **extra) -> Path:
    config = fixtures.target_config(model_type, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                    intermediate_size=128, vocab_size=384, tie_word_embeddings=True, **extra)
    return fixtures.write_target(root / f"src-{model_type}", config, seed=3)


# Gemma 3: llama.cpp's layout of sliding and global layers (5 + 1) needs 6 layers; the others take 2.
GEMMA = dict(query_pre_attn_scalar=16, sliding_window=512, rope_local_base_freq=10000.0, num_hidden_layers=6)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    made = {t: make_source(root, t, **(GEMMA if t == "gemma3_text" else {"num_hidden_layers": 2})) for t in ARCH}
    # K-quant blocks span 256 values: rows that wide.
    made["wide"] = fixtures.write_target(root / "wide", fixtures.target_config(
        "qwen3", hidden_size=256, intermediate_size=256, num_hidden_layers=1, vocab_size=384), seed=4)
    return made


def logits(folder: Path, ids: list[int]) -> np.ndarray:
    model, _ = load_model(folder)
    return np.array(model(mx.array(ids)[None]).astype(mx.float32))


@pytest.mark.parametrize("model_type", list(ARCH))
def test_a_float_gguf_converts_back_to_the_model_it_came_from(sources, tmp_path, model_type):
    """Equal logits prove names, Llama's q/k permutation, Gemma's norms and the config all undone."""
    source = sources[model_type]
    write_gguf(source, tmp_path / "m.gguf", Q.F32)
    out = convert(str(tmp_path / "m.gguf"), str(tmp_path / "out"), dtype="float32")
    ids = [5, 17, 42, 99, 200, 3, 64, 128, 7, 300]
    np.testing.assert_allclose(logits(out, ids), logits(source, ids), rtol=1e-4, atol=1e-4)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == model_type and "quantization" not in config


@pytest.mark.parametrize("kind", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_mlx_quantizable_blocks_are_kept_quantized_and_read_as_ggml_reads_them(sources, tmp_path, kind):
    """Q8_0/Q4_0/Q4_1 stay MLX quantization at group 32 (8 or 4 bits): dequantized, each weight equals
    ggml's own dequantization of the written blocks (q/k rows un-permuted here, independently)."""
    written = write_gguf(sources["llama"], tmp_path / "m.gguf", kind)
    out = convert(str(tmp_path / "m.gguf"), str(tmp_path / "out"))
    model, config = load_model(out)
    bits = 8 if kind == Q.Q8_0 else 4
    assert config["quantization"]["model.layers.0.mlp.up_proj"] == {"group_size": 32, "bits": bits}
    layer = model.model.layers[1]
    for module, name, heads in ((layer.mlp.up_proj, "blk.1.ffn_up.weight", None),
                                (layer.self_attn.q_proj, "blk.1.attn_q.weight", 4),
                                (layer.self_attn.k_proj, "blk.1.attn_k.weight", 2)):
        assert module.bits == bits and module.group_size == 32
        mine = np.array(mx.dequantize(module.weight, module.scales, module.biases, 32, bits).astype(mx.float32))
        ggml = dequantize(written[name], kind)
        if heads:  # llama.cpp's permutation, undone: (heads, d/2, 2) rows back to (heads, 2, d/2)
            ggml = ggml.reshape(heads, -1, 2, ggml.shape[1]).swapaxes(1, 2).reshape(ggml.shape)
        np.testing.assert_allclose(mine, ggml, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("kind", [Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.F16, Q.BF16])
def test_other_types_are_dequantized_by_ggml_and_can_be_quantized_again(sources, tmp_path, kind):
    written = write_gguf(sources["wide"], tmp_path / "m.gguf", kind)
    out = convert(str(tmp_path / "m.gguf"), str(tmp_path / "out"), dtype="float32")
    model, config = load_model(out)
    assert "quantization" not in config
    np.testing.assert_allclose(np.array(model.model.layers[0].mlp.down_proj.weight),
                               dequantize(written["blk.0.ffn_down.weight"], kind), rtol=1e-6, atol=1e-6)
    again = convert(str(tmp_path / "m.gguf"), str(tmp_path / "q"), quantize="4bit", q_group_size=32)
    _, config = load_model(again)
    assert config["quantization"]["bits"] == 4


def test_the_tokenizer_is_rebuilt_from_the_metadata(sources, tmp_path):
    """Byte-level BPE from tokens, merges and token types: ids equal the original tokenizer's, specials
    are special, and the chat template and EOS come along."""
    source = sources["qwen3"]
    write_gguf(source, tmp_path / "m.gguf")
    out = convert(str(tmp_path / "m.gguf"), str(tmp_path / "out"))
    mine, theirs = load_tokenizer(out), load_tokenizer(source)
    for text in TEXTS:
        assert mine.encode(text) == theirs.encode(text), text
        assert mine.decode(mine.encode(text)) == text
    assert mine.eos_token_ids == theirs.eos_token_ids
    messages = [{"role": "user", "content": "hi"}]
    assert mine.apply_chat_template(messages, add_generation_prompt=True) == \
        theirs.apply_chat_template(messages, add_generation_prompt=True)


def test_a_sentencepiece_vocabulary_tokenizes_as_sentencepiece_does(sources, tmp_path):
    """llama/gemma-style: pieces and scores (no merges) from a SentencePiece BPE model trained here; the
    rebuilt tokenizer gives SentencePiece's own ids, and BOS first where the file says so."""
    sentencepiece = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(fixtures._corpus()))
    sentencepiece.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=700,
                                             model_type="bpe", byte_fallback=True, bos_id=1, eos_id=2, unk_id=0,
                                             pad_id=-1, minloglevel=2)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1
             for i in range(len(pieces))]

    def tokenizer(writer):
        writer.add_tokenizer_model("llama")
        writer.add_token_list(pieces)
        writer.add_token_scores([sp.get_score(i) for i in range(len(pieces))])
        writer.add_token_types(types)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(True)

    write_gguf(sources["llama"], tmp_path / "m.gguf", tokenizer="none", extra={"tok": tokenizer})
    mine = load_tokenizer(convert(str(tmp_path / "m.gguf"), str(tmp_path / "out")))
    for text in ["Hello world", "def f(x): return x + 1", "the quick brown fox", "zzq ünï 42"]:
        assert mine.encode(text) == [1] + sp.encode(text), text
        assert mine.decode(mine.encode(text), skip_special_tokens=True) == text


def test_a_truncated_or_foreign_file_is_one_line_and_nothing_is_written(sources, tmp_path):
    good = tmp_path / "m.gguf"
    write_gguf(sources["qwen3"], good)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size - 1000])
    with pytest.raises(DFlashError, match=r"is truncated: tensor \S+ ends past the end of the file$"):
        convert(str(cut), str(tmp_path / "out"))  # its own words, not numpy's about a view past the end
    header = tmp_path / "header.gguf"
    header.write_bytes(good.read_bytes()[:200])
    with pytest.raises(DFlashError, match="not a readable GGUF|truncated"):
        convert(str(header), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_an_unknown_architecture_or_tensor_type_is_refused(sources, tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(DFlashError, match="architecture 'mamba' is not supported"):
        convert(str(tmp_path / "mamba.gguf"), str(tmp_path / "out"))
    write_gguf(sources["qwen3"], tmp_path / "q81.gguf", Q.Q8_1)  # a type ggml's Python reader cannot dequantize
    with pytest.raises(DFlashError, match="Q8_1, which cannot be dequantized"):
        convert(str(tmp_path / "q81.gguf"), str(tmp_path / "out"))


def test_the_cli_converts_a_gguf_and_refuses_to_clobber(sources, tmp_path):
    write_gguf(sources["qwen3"], tmp_path / "m.gguf", Q.Q8_0)
    cli = [str(Path(sys.executable).parent / "dflash-mlx"), "convert", str(tmp_path / "m.gguf"), "-o",
           str(tmp_path / "out")]
    env = {"DFLASH_MLX_BLAS_WARNING": "0", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(cli, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert "an mlx-lm model" in done.stdout
    again = subprocess.run(cli, capture_output=True, text=True, env=env)
    assert again.returncode == 2 and "already exists; pass --force" in again.stderr
    assert "Traceback" not in again.stderr and len(again.stderr.strip().splitlines()) == 1
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    bad = subprocess.run(cli[:2] + [str(tmp_path / "junk.gguf"), "-o", str(tmp_path / "o2")], capture_output=True,
                         text=True, env=env)
    assert bad.returncode == 2 and "not a GGUF model" in bad.stderr and "Traceback" not in bad.stderr
