"""A GGUF file (llama.cpp, Ollama, LM Studio) as an mlx-lm model folder.

What llama.cpp's converter changed is undone here, per architecture:

- Names: ``blk.N.attn_q`` is ``model.layers.N.self_attn.q_proj`` and so on (``TENSORS``).
- Llama's query and key rows were permuted for llama.cpp's RoPE layout: per head, rows viewed
  as (2, d/2) were written as (d/2, 2). Only rows move, so a quantized weight's packed rows,
  scales and biases are put back alike.
- Gemma's RMSNorm weights were stored as 1 + w (mlx-lm's Gemma adds the 1 itself).
- The tokenizer is stored as metadata: the vocabulary, merges or scores, token types and the
  chat template. It is rebuilt with the ``tokenizers`` library as a ``tokenizer.json``.

Tensor types. Q4_0, Q4_1 and Q8_0 blocks (32 values, a float16 scale and an offset) are MLX's
affine quantization at group 32 exactly, so they are repacked, not dequantized: a file that
keeps its embedding at 8 bits beside 4-bit layers keeps those widths. Every other type
(K-quants, I-quants, Q5_0, ...) is dequantized by ggml's own ``gguf`` package. ``dtype``
dequantizes everything into one float type; ``quantize`` then quantizes again with mlx-lm.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..errors import DFlashError

# GGUF tensor name (after ``blk.N.``) -> mlx-lm name (after ``model.layers.N.``), per architecture family.
_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA_LAYER = dict(_LAYER, ffn_norm="pre_feedforward_layernorm", post_attention_norm="post_attention_layernorm",
                    post_ffw_norm="post_feedforward_layernorm")
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# Tensors llama.cpp adds that mlx-lm computes itself (llama 3's RoPE frequency factors: see _llama3_rope).
_DERIVED = {"rope_freqs"}

KEPT = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}  # GGML types that are MLX affine quantization at group 32
GROUP = 32


@dataclass(frozen=True)
class Arch:
    model_type: str  # mlx-lm's
    layer_names: dict[str, str]
    permute_qk: bool  # llama.cpp's RoPE row permutation to undo
    norm_plus_one: bool  # Gemma: norms stored as 1 + w


ARCHS = {
    "llama": Arch("llama", _LAYER, permute_qk=True, norm_plus_one=False),
    "qwen2": Arch("qwen2", _LAYER, permute_qk=False, norm_plus_one=False),
    "qwen3": Arch("qwen3", _LAYER, permute_qk=False, norm_plus_one=False),
    "gemma3": Arch("gemma3_text", _GEMMA_LAYER, permute_qk=False, norm_plus_one=True),
}


def is_gguf(path: Path) -> bool:
    """A file that starts with GGUF's magic (whatever its name)."""
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _reader(path: Path) -> Any:
    """gguf's reader of ``path``, its tensors' extents checked against the file before it views their data (a view
    past the end fails inside numpy, in numpy's words)."""
    from gguf import GGUFReader
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    class Checked(GGUFReader):
        def _build_tensors(self, start_offs: int, fields: list) -> None:
            for field in fields:
                _, name, _, dims, dtype, offset = field.parts
                block, size = GGML_QUANT_SIZES[GGMLQuantizationType(dtype[0])]
                if start_offs + int(offset[0]) + int(np.prod(dims)) * size // block > len(self.data):
                    raise DFlashError(f"{path} is truncated: tensor {bytes(name).decode(errors='replace')} ends past "
                                      "the end of the file")
            super()._build_tensors(start_offs, fields)

    return Checked(str(path))


class GGUF:
    """An open GGUF file: its metadata and tensors, checked whole before anything is converted."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.reader = _reader(path)
        except (ValueError, OSError, IndexError, KeyError, TypeError) as e:  # the reader's ways of saying "broken"
            raise DFlashError(f"{path} is not a readable GGUF file (truncated or corrupt: "
                              f"{str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
        self.arch_name = str(self.get("general.architecture", ""))
        if self.arch_name not in ARCHS:
            raise DFlashError(f"{path}: GGUF architecture {self.arch_name!r} is not supported "
                              f"(supported: {', '.join(ARCHS)})")
        self.arch = ARCHS[self.arch_name]
        self.tensors = {t.name: t for t in self.reader.tensors}

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def hparam(self, key: str, default: Any = None) -> Any:
        """An architecture key (``llama.block_count``), or ``default``; None default means required."""
        value = self.get(f"{self.arch_name}.{key}", default)
        if value is None:
            raise DFlashError(f"{self.path}: metadata {self.arch_name}.{key} is missing")
        return value


# --- config ---------------------------------------------------------------------------------------


def _llama3_rope(g: GGUF, head_dim: int, theta: float) -> Optional[dict[str, Any]]:
    """Llama 3.1+'s RoPE scaling, which llama.cpp stores as per-frequency factors (``rope_freqs``).

    The published settings are tried and the one whose factors match is returned; other factors are refused.
    """
    if "rope_freqs.weight" not in g.tensors:
        return None
    factors = _float(g, g.tensors["rope_freqs.weight"]).reshape(-1)
    freqs = theta ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * np.pi * freqs
    for factor in (8.0, 32.0, 16.0, 4.0):
        for original in (8192, 4096):
            low, high = 1.0, 4.0
            smooth = (original / wavelen - low) / (high - low)
            want = np.where(wavelen < original / high, 1.0,
                            np.where(wavelen > original / low, factor, 1 / ((1 - smooth) / factor + smooth)))
            if want.shape == factors.shape and np.allclose(want, factors, rtol=1e-3):
                return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                        "original_max_position_embeddings": original}
    raise DFlashError(f"{g.path}: its RoPE frequency factors (rope_freqs) match no Llama 3 setting known here")


def _rope_scaling(g: GGUF, head_dim: int, theta: float) -> Optional[dict[str, Any]]:
    kind = g.hparam("rope.scaling.type", "none")
    if kind in ("none", ""):
        return _llama3_rope(g, head_dim, theta)
    factor = float(g.hparam("rope.scaling.factor", 1.0))
    if kind == "linear":
        return {"type": "linear", "factor": factor}
    if kind == "yarn":
        original = int(g.hparam("rope.scaling.original_context_length"))
        return {"type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    raise DFlashError(f"{g.path}: RoPE scaling {kind!r} is not supported")


def model_config(g: GGUF) -> dict[str, Any]:
    """config.json for mlx-lm, from the architecture's metadata keys."""
    heads = int(g.hparam("attention.head_count"))
    hidden = int(g.hparam("embedding_length"))
    head_dim = int(g.hparam("attention.key_length", hidden // heads))
    theta = float(g.hparam("rope.freq_base", 10000.0))
    tokens = g.get("tokenizer.ggml.tokens") or []
    config: dict[str, Any] = {
        "model_type": g.arch.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": int(g.hparam("block_count")),
        "intermediate_size": int(g.hparam("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(g.hparam("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(g.hparam("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "max_position_embeddings": int(g.hparam("context_length", 4096)),
        "vocab_size": int(g.hparam("vocab_size", len(tokens) or None)),
        "tie_word_embeddings": "output.weight" not in g.tensors,
    }
    if g.arch_name == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in g.tensors
        config["mlp_bias"] = "blk.0.ffn_up.bias" in g.tensors
    if g.arch_name == "gemma3":
        # llama.cpp scales queries by 1/sqrt(head_dim), except Gemma 3 27B's hidden/heads (its converter's rule).
        config["query_pre_attn_scalar"] = hidden // heads if hidden == 5376 else head_dim
        config["sliding_window"] = int(g.hparam("attention.sliding_window", 512))
        config["rope_local_base_freq"] = 10000.0
    scaling = _rope_scaling(g, head_dim, theta)
    if scaling is not None:
        config["rope_scaling"] = scaling
    eos = [g.get("tokenizer.ggml.eos_token_id"), g.get("tokenizer.ggml.eot_token_id")]
    eos = sorted({int(e) for e in eos if e is not None})
    if eos:
        config["eos_token_id"] = eos if len(eos) > 1 else eos[0]
    if g.get("tokenizer.ggml.bos_token_id") is not None:
        config["bos_token_id"] = int(g.get("tokenizer.ggml.bos_token_id"))
    return config


# --- tensors --------------------------------------------------------------------------------------


def _type(t: Any) -> str:
    return t.tensor_type.name


def _rows(t: Any) -> tuple[int, int]:
    """(rows, columns) of a weight: GGUF lists dimensions fastest first."""
    shape = [int(d) for d in t.shape]
    return int(np.prod(shape[1:])) if len(shape) > 1 else 1, shape[0]


def _float(g: GGUF, t: Any) -> np.ndarray:
    """A tensor as float32 in its logical shape (slowest dimension first)."""
    from gguf.quants import dequantize

    try:
        values = dequantize(np.asarray(t.data), t.tensor_type)
    except NotImplementedError:
        raise DFlashError(f"{g.path}: tensor {t.name} has type {_type(t)}, which cannot be dequantized here") from None
    return np.asarray(values, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])


def _repack(t: Any) -> dict[str, np.ndarray]:
    """A Q4_0 / Q4_1 / Q8_0 weight as MLX affine quantization (weight uint32, scales, biases; group 32)."""
    rows, cols = _rows(t)
    kind = _type(t)
    blocks = np.asarray(t.data).reshape(rows, cols // GROUP, -1)
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    if kind == "Q8_0":  # d * q, q int8  ->  d * (q + 128) - 128 d
        q = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return {"weight": q.reshape(rows, cols).view(np.uint32), "scales": scale, "biases": -128 * scale}
    if kind == "Q4_0":  # d * (q - 8)
        bias, packed = -8 * scale, blocks[..., 2:]
    else:  # Q4_1: d * q + m
        bias, packed = blocks[..., 2:4].copy().view(np.float16)[..., 0], blocks[..., 4:]
    # ggml: byte j holds value j (low nibble) and value j + 16 (high); MLX: value i at bits 4 * (i % 8) of word i // 8.
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)
    pairs = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    return {"weight": pairs.reshape(rows, cols // 2).view(np.uint32), "scales": scale, "biases": bias}


def _unpermute(array: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head (2, d/2) -> (d/2, 2) row permutation (rows first; any trailing shape)."""
    shape = array.shape
    return array.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _name(g: GGUF, gguf_name: str) -> Optional[str]:
    """The mlx-lm parameter name of a GGUF tensor, None for one mlx-lm derives itself."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _DERIVED:
        return None
    match = re.fullmatch(r"blk\.(\d+)\.(.+)", base)
    if match and match.group(2) in g.arch.layer_names:
        return f"model.layers.{match.group(1)}.{g.arch.layer_names[match.group(2)]}.{suffix}"
    if base in _TOP:
        return f"{_TOP[base]}.{suffix}"
    raise DFlashError(f"{g.path}: tensor {gguf_name} has no place in an mlx-lm {g.arch.model_type} model")


def read_weights(g: GGUF, dtype: str, keep_quantized: bool,
                 log: Callable[[str], None]) -> tuple[dict[str, mx.array], dict]:
    """The model's weights by mlx-lm name, and the per-layer quantization of those kept quantized.

    With ``keep_quantized``, Q4_0/Q4_1/Q8_0 weights stay quantized; everything else is ``dtype``.
    """
    float_type = getattr(mx, dtype)
    heads, kv_heads = int(g.hparam("attention.head_count")), int(g.hparam("attention.head_count_kv", 0) or 0)
    kv_heads = kv_heads or heads
    weights: dict[str, mx.array] = {}
    quantized: dict[str, dict[str, int]] = {}
    for i, (gguf_name, t) in enumerate(g.tensors.items()):
        name = _name(g, gguf_name)
        if name is None:
            continue
        log(f"reading {gguf_name} ({_type(t)}, {i + 1}/{len(g.tensors)})")
        keep = keep_quantized and _type(t) in KEPT and name.endswith(".weight") and len(t.shape) == 2
        parts = _repack(t) if keep else {name.rpartition(".")[2]: _float(g, t)}
        if g.arch.permute_qk and re.search(r"self_attn\.[qk]_proj\.", name):
            n = heads if ".q_proj." in name else kv_heads
            parts = {k: _unpermute(v, n) for k, v in parts.items()}
        if g.arch.norm_plus_one and re.search(r"norm\.weight$", name):
            parts = {k: v - 1 for k, v in parts.items()}
        prefix = name.rpartition(".")[0]
        for key, value in parts.items():
            array = mx.array(value)
            weights[f"{prefix}.{key}"] = array.astype(float_type) if key in ("scales", "biases") or not keep \
                else array
        if keep:
            quantized[prefix] = {"group_size": GROUP, "bits": KEPT[_type(t)]}
    return weights, quantized


# --- tokenizer ------------------------------------------------------------------------------------

# llama.cpp's names for the pre-tokenizer's split rule (``tokenizer.ggml.pre``) -> the rule.
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {
    "default": [_GPT2_SPLIT], "gpt-2": [_GPT2_SPLIT], "gpt2": [_GPT2_SPLIT],
    "smollm": [r"\p{N}", _GPT2_SPLIT],  # digits one by one, then GPT-2's rule
    "llama-bpe": [_LLAMA3_SPLIT], "llama3": [_LLAMA3_SPLIT], "smaug-bpe": [_LLAMA3_SPLIT],
    "qwen2": [_QWEN2_SPLIT], "qwen35": [_QWEN2_SPLIT], "deepseek-r1-qwen": [_QWEN2_SPLIT],
}
CONTROL, USER_DEFINED, BYTE = 3, 4, 6  # llama.cpp token types


def _byte_level(g: GGUF, tokens: list[str], log: Callable[[str], None]) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    merges = [tuple(m.split(" ", 1)) for m in g.get("tokenizer.ggml.merges") or []]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
                               ignore_merges=False))
    pre = str(g.get("tokenizer.ggml.pre", "default"))
    if pre not in SPLITS:
        log(f"warning: pre-tokenizer {pre!r} is not known here; GPT-2's split rule is used")
    splits = [pre_tokenizers.Split(Regex(rule), behavior="isolated") for rule in SPLITS.get(pre, SPLITS["default"])]
    tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                   use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(g: GGUF, tokens: list[str]) -> Any:
    """Llama/Gemma-style SentencePiece BPE: merges from the file, or rebuilt from the scores as transformers does."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {t: i for i, t in enumerate(tokens)}
    if g.get("tokenizer.ggml.merges"):
        merges = [tuple(m.split(" ", 1)) for m in g.get("tokenizer.ggml.merges")]
    else:
        scores = g.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        found = []
        for token, i in vocab.items():
            for cut in range(1, len(token)):
                left, right = token[:cut], token[cut:]
                if left in vocab and right in vocab:
                    found.append((-scores[i], i, vocab[left], vocab[right], left, right))
        merges = [(left, right) for *_, left, right in sorted(found)]
    unk = g.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=tokens[unk] if unk is not None else None,
                               fuse_unk=True, byte_fallback=True, dropout=None))
    prefix = bool(g.get("tokenizer.ggml.add_space_prefix", g.arch_name == "llama"))
    tok.normalizer = normalizers.Sequence(([normalizers.Prepend("▁")] if prefix else [])
                                          + [normalizers.Replace(" ", "▁")])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


def write_tokenizer(g: GGUF, out: Path, log: Callable[[str], None]) -> None:
    """tokenizer.json and tokenizer_config.json (specials, BOS rule, chat template) from the metadata."""
    from tokenizers import AddedToken, processors

    tokens = [str(t) for t in g.get("tokenizer.ggml.tokens") or []]
    kind = g.get("tokenizer.ggml.model")
    if not tokens:
        raise DFlashError(f"{g.path} holds no tokenizer (tokenizer.ggml.tokens is missing)")
    if kind == "gpt2":
        tok = _byte_level(g, tokens, log)
    elif kind in ("llama", "gemma", "gemma3"):
        tok = _sentencepiece(g, tokens)
    else:
        raise DFlashError(f"{g.path}: tokenizer model {kind!r} is not supported (gpt2-style BPE and "
                          "llama/gemma-style SentencePiece are)")
    types = g.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED])

    def special(key: str) -> Optional[str]:
        i = g.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    bos = special("bos")
    add_bos = bool(g.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    if add_bos and bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tokens.index(bos))])
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos, "eos_token": special("eos"), "unk_token": special("unknown"),
        "pad_token": special("padding"), "add_bos_token": add_bos,
        "add_eos_token": bool(g.get("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": int(g.hparam("context_length", 4096)),
        "clean_up_tokenization_spaces": False,
    }
    template = g.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = str(template)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


# --- the folder -----------------------------------------------------------------------------------


def default_dtype() -> str:
    """Float16 on Metal; float32 on MLX's CPU backend, whose float16 quantized matmul is ~35x slower (measured:
    a 1536x576 4-bit product, 35 ms against 0.9 ms with float32 scales)."""
    return "float16" if mx.metal.is_available() else "float32"


def _save(out: Path, weights: dict[str, mx.array], config: dict[str, Any]) -> None:
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=1))


def write_model(g: GGUF, out: Path, quantize: Optional[str], bits: Optional[int], q_group_size: int,
                dtype: Optional[str], log: Callable[[str], None]) -> None:
    """config.json, model.safetensors and the tokenizer into the folder ``out``, loaded back by mlx-lm to check.

    ``quantize`` names the mlx-lm quantization (``bits`` wide, else a mixed recipe), None for none.
    """
    from mlx_lm.utils import load_model, quantize_model

    config = model_config(g)
    # Alone, the file's own Q4_0/Q4_1/Q8_0 stay; --dtype or --quantize make a float model first.
    weights, kept = read_weights(g, dtype or default_dtype(), dtype is None and quantize is None, log)
    if kept:
        config["quantization"] = {"group_size": GROUP, "bits": max(b["bits"] for b in kept.values()), **kept}
    out.mkdir(parents=True, exist_ok=True)
    log("writing the model")
    _save(out, weights, config)
    write_tokenizer(g, out, log)
    del weights
    try:
        model, config = load_model(out, lazy=True, strict=True)
    except ValueError as e:
        raise DFlashError(f"{g.path}: its tensors do not fit an mlx-lm {g.arch.model_type} model "
                          f"({str(e).splitlines()[0]})") from None
    if quantize is not None:
        from mlx_lm.convert import mixed_quant_predicate_builder

        log(f"quantizing ({quantize})")
        recipe = None if bits else mixed_quant_predicate_builder(quantize, model, q_group_size)
        model, config = quantize_model(model, config, q_group_size, bits, quant_predicate=recipe)
        _save(out, dict(tree_flatten(model.parameters())), config)
