"""Small random checkpoints in the published on-disk layouts, for tests and CPU benchmarks.

Targets are written the way a Hugging Face download looks (config.json, safetensors
with HF parameter names, a trained BPE tokenizer with a chat template); drafters the
way z-lab publishes them (unprefixed names, bf16, optionally sharded with an index).
They load through exactly the code path a downloaded model takes.
"""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path
from typing import Any, Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .drafter import Drafter, DrafterArgs

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus(large: bool = False) -> list[str]:
    """Offline training text: the sources of a few standard-library modules, or of all its top-level ones.

    The large corpus (4.7 MB of code, docstrings and comments) trains a tokenizer that
    compresses prose and JSON about as a real one does (~3 characters a token), so an
    agent's 80k-character request is ~25k tokens rather than 80k.
    """
    if large:
        import sysconfig

        files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
        return [f.read_text(encoding="utf-8", errors="ignore") for f in files]
    import json as m1
    import string as m3
    import textwrap as m2

    return [inspect.getsource(m) for m in (m1, m2, m3, inspect)]


def write_tokenizer(path: Path, vocab_size: int = 384, added: Sequence[str] = (),
                    chat_template: str = CHAT_TEMPLATE, large_corpus: bool = False) -> int:
    """Train a byte-level BPE tokenizer offline and save it as HF files. Returns its size.

    ``added`` pieces become tokens of their own after the trained vocabulary (ids from
    ``vocab_size - len(added)`` on), as Qwen's ``<tool_call>`` and ``<think>`` are: the
    tokenizer's ``vocab_size`` leaves them out, ``len(tokenizer)`` counts them.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(added),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(large_corpus), trainer)
    tok.add_tokens([AddedToken(piece, normalized=False, special=False) for piece in added])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "chat_template": chat_template,
            }
        )
    )
    return tok.get_vocab_size()


def _save(path: Path, weights: dict[str, mx.array], shards: int = 1) -> None:
    names = sorted(weights)
    if shards == 1:
        mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
        return
    weight_map = {}
    per = -(-len(names) // shards)
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: weights[k] for k in names[s * per : (s + 1) * per]}
        mx.save_safetensors(str(path / fname), part, metadata={"format": "mlx"})
        weight_map.update({k: fname for k in part})
    total = sum(v.nbytes for v in weights.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )


_ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "qwen3_next": "Qwen3NextForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
S, F = "sliding_attention", "full_attention"
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "norm_topk_prob": True}
_HYBRID = {"linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 32,
           "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "full_attention_interval": 2,
           "partial_rotary_factor": 0.25}
# The text settings ``target_config`` puts at the top level, for the wrappers that read only their text_config.
_TEXT = {"hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
         "vocab_size": 384}
# Gemma 3: layers 2 and 5 global, the rest sliding over 8 positions.
_GEMMA3 = {"num_hidden_layers": 6, "sliding_window": 8, "sliding_window_pattern": 3, "query_pre_attn_scalar": 16,
           "rope_local_base_freq": 10000.0, "rope_scaling": None}
# Gemma 4: sliding and global layers with different head sizes, the last 3 layers sharing the KV of earlier ones,
# per-layer input embeddings, final soft-capping.
_GEMMA4 = {"num_hidden_layers": 6, "layer_types": [S, S, F, S, S, F], "sliding_window": 8, "sliding_window_pattern": 3,
           "global_head_dim": 32, "num_kv_shared_layers": 3, "hidden_size_per_layer_input": 8,
           "vocab_size_per_layer_input": 384, "use_double_wide_mlp": True, "attention_k_eq_v": False,
           "enable_moe_block": False, "final_logit_softcapping": 30.0, "tie_word_embeddings": False,
           "rope_parameters": {F: {"partial_rotary_factor": 0.25, "rope_theta": 1e6, "rope_type": "proportional"},
                               S: {"partial_rotary_factor": 1.0, "rope_theta": 1e4, "rope_type": "default"}}}
# DeepSeek-V3 (Kimi K2.x inside): MLA latents in the cache, layer 0 dense then MoE with a shared expert.
_DSV3 = {"kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
         "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
         "first_k_dense_replace": 1, "moe_layer_freq": 1, "routed_scaling_factor": 2.5, "topk_method": "noaux_tc",
         "scoring_func": "sigmoid", "norm_topk_prob": True, "n_group": 2, "topk_group": 1, "attention_bias": False,
         "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32,
                          "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}
# Tiny but complete settings each architecture's ModelArgs (and transformers' config check, which mlx-lm's loader
# runs) needs beyond the common ones.
ARCH_EXTRAS: dict[str, dict[str, Any]] = {
    "qwen3_moe": _MOE,
    "qwen3_5": dict(_HYBRID, rope_parameters={"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}),
    "qwen3_5_moe": dict(_HYBRID, **_MOE, shared_expert_intermediate_size=64,
                        rope_parameters={"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}),
    "qwen3_next": dict(_HYBRID, **_MOE, shared_expert_intermediate_size=64),
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8, "layer_types": [S, F] * 2},
    "gemma3_text": _GEMMA3,
    "gemma3": {"text_config": dict(_TEXT, model_type="gemma3_text", **_GEMMA3)},
    "gemma4_text": _GEMMA4,
    "gemma4": {"text_config": dict(_TEXT, model_type="gemma4_text", **_GEMMA4)},
    "gemma2": {"num_hidden_layers": 6, "intermediate_size": 256, "rope_theta": 1000.0, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 16},
    "kimi_k25": {"text_config": dict(_TEXT, model_type="kimi_k2", rope_theta=10000.0, rms_norm_eps=1e-6,
                                     **dict(_DSV3, n_group=1))},
    "deepseek_v3": _DSV3,
    "deepseek_v2": {"kv_lora_rank": 32, "q_lora_rank": None, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
                    "v_head_dim": 16, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 64, "first_k_dense_replace": 1, "moe_layer_freq": 1,
                    "routed_scaling_factor": 1.0, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
                    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                                     "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}},
    # GLM-5.1: DeepSeek sparse attention, whose indexer picks 8 keys (so it selects past 8 tokens).
    "glm_moe_dsa": dict({k: v for k, v in _DSV3.items() if k != "rope_scaling"}, n_group=1, index_head_dim=16,
                        index_n_heads=4, index_topk=8, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
    "minimax_m2": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64,
                   "shared_intermediate_size": 0, "rotary_dim": 8, "use_qk_norm": True, "scoring_func": "sigmoid"},
    "laguna": {"sliding_window": 8, "layer_types": [S, S, S, F], "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
               "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
               "shared_expert_intermediate_size": 64, "gating": True,
               "rope_parameters": {F: {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0,
                                       "original_max_position_embeddings": 1024, "partial_rotary_factor": 0.5},
                                   S: {"rope_type": "default", "rope_theta": 10000.0}}},
    "muse_glimmer": {"sliding_window": 8, "layer_types": [S, S, S, F], "post_norm_eps": 1e-8, "qk_scale_factor": 3.87,
                     "final_logit_softcapping": 20.0, "output_multiplier": 0.19611613513818404},
    "mistral": {"sliding_window": None},
    "ministral3": {"layer_types": [S, F] * 2, "sliding_window": 8,
                   "rope_parameters": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4,
                                       "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                       "llama_4_scaling_beta": 0.1, "rope_theta": 1e6}},
    "phi3": {"pad_token_id": 0},
    "olmo3": {"sliding_window": 8, "layer_types": [S, S, S, F]},
    "granite": {"attention_multiplier": 0.0625, "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                "logits_scaling": 8.0, "attention_bias": False, "mlp_bias": False},
    "smollm3": {"pad_token_id": 0, "bos_token_id": None, "no_rope_layer_interval": 4, "no_rope_layers": [1, 1, 1, 0]},
    "exaone4": {"sliding_window": 8, "sliding_window_pattern": "LLLG", "layer_types": [S, S, S, F], "rope_scaling": None},
    "cohere2": {"layer_norm_eps": 1e-5, "logit_scale": 0.0625, "sliding_window": 8, "num_hidden_layers": 6,
                "sliding_window_pattern": 4, "attention_bias": False, "layer_norm_bias": False},
    "glm4": {"attention_bias": True, "partial_rotary_factor": 0.5},
    "lfm2": {"norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3, "block_dim": 64, "block_ff_dim": 192,
             "block_multiple_of": 32, "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": True,
             "layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    # Mamba-2 mixers (M), attention without RoPE (*), MLP (-) and MoE (E) blocks: 3 caches for 6 layers.
    "nemotron_h": {"num_hidden_layers": 6, "hybrid_override_pattern": "M-*-ME", "attention_bias": False,
                   "mamba_num_heads": 4, "mamba_head_dim": 16, "mamba_proj_bias": False, "ssm_state_size": 16,
                   "conv_kernel": 4, "n_groups": 2, "mlp_bias": False, "layer_norm_epsilon": 1e-5, "use_bias": False,
                   "use_conv_bias": True, "moe_intermediate_size": 64, "moe_shared_expert_intermediate_size": 64,
                   "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1,
                   "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0},
    # A Mamba-2 mixer and attention side by side in every layer: one CacheList(ArraysCache, KVCache) each.
    "falcon_h1": {"mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_d_conv": 4,
                  "mamba_n_groups": 1, "mamba_chunk_size": 16, "mamba_expand": 1, "mamba_conv_bias": True,
                  "mamba_proj_bias": False, "mamba_rms_norm": False, "mamba_norm_before_gate": False,
                  "projectors_bias": False, "attention_bias": False, "mlp_bias": False, "rms_norm_eps": 1e-5},
    "mamba2": {"num_heads": 8, "head_dim": 16, "state_size": 16, "layer_norm_epsilon": 1e-5, "conv_kernel": 4,
               "n_groups": 2, "use_bias": False, "use_conv_bias": True, "time_step_limit": [0.0, float("inf")],
               "time_step_rank": "auto"},
    "starcoder2": {"norm_epsilon": 1e-5},  # not among the tested ones: a target that runs after its self-check
    "granitemoehybrid": {"layer_types": ["mamba", "attention", "mamba", "attention"], "attention_bias": False,
                         "embedding_multiplier": 12.0, "attention_multiplier": 0.0625, "logits_scaling": 4.0,
                         "residual_multiplier": 0.22, "position_embedding_type": "nope", "mamba_n_heads": 4,
                         "mamba_d_head": 32, "mamba_expand": 2, "mamba_proj_bias": False, "mamba_d_state": 16,
                         "mamba_d_conv": 4, "mamba_n_groups": 1, "mamba_conv_bias": True, "num_local_experts": 4,
                         "num_experts_per_tok": 2, "shared_intermediate_size": 64},
}


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's settings of a config (a multimodal wrapper's ``text_config``)."""
    return config.get("text_config") or config


def target_config(
    model_type: str = "qwen3",
    hidden_size: int = 64,
    num_hidden_layers: int = 4,
    intermediate_size: int = 128,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    vocab_size: int = 384,
    tie_word_embeddings: bool = False,
    **extra: Any,
) -> dict[str, Any]:
    config = {
        "architectures": [_ARCHITECTURES.get(model_type, "CausalLM")],
        "model_type": model_type,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "intermediate_size": intermediate_size,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": hidden_size // num_attention_heads,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "vocab_size": vocab_size,
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": "float32",
    }
    config.update(ARCH_EXTRAS.get(model_type, {}))
    config.update(extra)
    return config


def write_target(
    path: Path,
    config: dict[str, Any],
    seed: int = 0,
    init_scale: float = 2.0,
    tokenizer_vocab: Optional[int] = None,
) -> Path:
    """A random target checkpoint of ``config`` with a tokenizer, in HF layout.

    ``init_scale`` multiplies the default initialisation of every non-norm weight:
    at 1.0 tiny random models fall into short greedy loops, at 2.0 their output
    is varied, which makes token-for-token comparisons more searching.
    """
    path.mkdir(parents=True, exist_ok=True)
    model = _model(config, seed)
    weights = {}
    for k, v in tree_flatten(model.parameters()):
        if v.ndim >= 2 and not mx.any(v != 0).item():  # an MoE router starts at zero: random, so tokens route apart
            v = 0.5 * mx.random.normal(v.shape).astype(v.dtype)
        elif "norm" not in k and not k.endswith(("A_log", "dt_bias")):  # a state's decay stays as initialised
            v = v * init_scale
        weights[k] = v
    _save(path, weights)
    size = write_tokenizer(path, tokenizer_vocab or config["vocab_size"])
    assert size <= config["vocab_size"], "tokenizer larger than the model vocabulary"
    config = dict(config, eos_token_id=vocab_id(path, "<|im_end|>"))
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def _model(config: dict[str, Any], seed: int) -> Any:
    """A random mlx-lm model of ``config`` (the model file mlx-lm's loader takes for its type)."""
    from mlx_lm.utils import MODEL_REMAPPING

    arch = importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(config['model_type'], config['model_type'])}")
    mx.random.seed(seed)
    return arch.Model(arch.ModelArgs.from_dict(config))


def drafter_config(
    target: dict[str, Any],
    num_hidden_layers: int = 1,
    block_size: int = 16,
    target_layer_ids: Optional[list[int]] = None,
    mask_token_id: Optional[int] = None,
    **extra: Any,
) -> dict[str, Any]:
    """A z-lab style drafter config for ``target``'s shapes."""
    target = dict(text_config(target), vocab_size=target.get("vocab_size", text_config(target)["vocab_size"]))
    if mask_token_id is None:
        mask_token_id = SPECIAL_TOKENS.index("<|mask|>")
    dflash: dict[str, Any] = {"mask_token_id": mask_token_id}
    if target_layer_ids is not None:
        dflash["target_layer_ids"] = target_layer_ids
    config = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "block_size": block_size,
        "dflash_config": dflash,
        "num_target_layers": target["num_hidden_layers"],
        "num_hidden_layers": num_hidden_layers,
        "hidden_size": target["hidden_size"],
        "intermediate_size": target["intermediate_size"],
        "num_attention_heads": target["num_attention_heads"],
        "num_key_value_heads": target["num_key_value_heads"],
        "head_dim": target["hidden_size"] // target["num_attention_heads"],
        "rms_norm_eps": 1e-6,
        "rope_theta": target.get("rope_theta", 10000.0),
        "rope_scaling": target.get("rope_scaling"),
        "max_position_embeddings": target.get("max_position_embeddings", 4096),
        "layer_types": ["full_attention"] * num_hidden_layers,
        "sliding_window": None,
        "use_sliding_window": False,
        "attention_bias": False,
        "vocab_size": target["vocab_size"],
        "tie_word_embeddings": target.get("tie_word_embeddings", False),
        "dtype": "bfloat16",
    }
    config.update(extra)
    return config


def write_drafter(
    path: Path,
    config: dict[str, Any],
    seed: int = 1,
    dtype: mx.Dtype = mx.bfloat16,
    shards: int = 1,
    init_scale: float = 3.0,
) -> Path:
    """A random drafter checkpoint in its family's published layout (z-lab's DFlash, poolside's Laguna DFlash,
    Meta's Muse Glimmer assistant: ``config``'s kind).

    ``init_scale`` (on non-norm weights) makes the drafts depend visibly on the
    context, so tests can tell a drafter fed the wrong context from a right one.
    """
    from .loader import DRAFTER_KINDS, drafter_kind
    from .muse_assistant import RENAMED

    path.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    args_class, model_class = DRAFTER_KINDS[drafter_kind(config)]
    model = model_class(args_class.from_dict(config))
    published = {v: k for k, v in RENAMED.items()} if model_class.__name__ == "MuseAssistant" else {}
    weights = {
        published.get(k, k): (v if "norm" in k else v * init_scale).astype(dtype)
        for k, v in tree_flatten(model.parameters())
    }
    _save(path, weights, shards=shards)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def laguna_drafter_config(target: dict[str, Any], num_hidden_layers: int = 2, block_size: int = 8,
                          sliding_window: int = 12, target_layer_ids: Optional[list[int]] = None) -> dict[str, Any]:
    """A poolside Laguna DFlash config for ``target``'s shapes: every field its published readers require."""
    config = drafter_config(target, num_hidden_layers, block_size=block_size, target_layer_ids=target_layer_ids)
    ids = config["dflash_config"].setdefault("target_layer_ids", list(range(num_hidden_layers)))
    config["dflash_config"].update(block_size=block_size, num_target_layers=config["num_target_layers"], causal=True)
    for key in ("auto_map", "block_size", "use_sliding_window"):
        config.pop(key)
    config.update(architectures=["LagunaDFlashDraftModel"], model_type="laguna", gating="per-head", qkv_bias=False,
                  draft_vocab_size=config["vocab_size"], layer_types=["sliding_attention"] * num_hidden_layers,
                  sliding_window=sliding_window, sliding_windows=[sliding_window] * num_hidden_layers,
                  eagle_aux_hidden_state_layer_ids=[i + 1 for i in ids])
    return config


def muse_assistant_config(target: dict[str, Any], num_hidden_layers: int = 2, block_size: int = 8,
                          sliding_window: int = 12, target_layer_ids: Optional[list[int]] = None) -> dict[str, Any]:
    """A Muse Glimmer assistant config for ``target``'s shapes, as Meta publishes it: its DFlash settings at the top
    level, no ``dflash_config``, RoPE in ``rope_parameters``."""
    config = drafter_config(target, num_hidden_layers, block_size=block_size, target_layer_ids=target_layer_ids)
    dflash = config.pop("dflash_config")
    for key in ("auto_map", "rope_theta", "rope_scaling", "use_sliding_window", "architectures"):
        config.pop(key)
    config.update(model_type="muse_glimmer_assistant", mask_token_id=dflash["mask_token_id"],
                  target_layer_ids=dflash.get("target_layer_ids", list(range(num_hidden_layers))),
                  layer_types=["sliding_attention"] * num_hidden_layers, sliding_window=sliding_window,
                  rope_parameters={"rope_theta": target.get("rope_theta", 10000.0), "rope_type": "default"})
    return config


def dflash2_config(
    target: dict[str, Any],
    num_hidden_layers: int = 1,
    block_size: int = 8,
    sliding_window: int = 2048,
    conv_group_size: int = 16,
    selector_rank: int = 16,
    selector_top_k: int = 8,
    target_layer_ids: Optional[list[int]] = None,
    **extra: Any,
) -> dict[str, Any]:
    """A DFlash2 config as published: all layers sliding and explicitly non-causal, RoPE in the
    transformers-5 ``rope_parameters`` form, ``block_size`` only inside ``dflash_config``."""
    config = drafter_config(target, num_hidden_layers, target_layer_ids=target_layer_ids)
    for key in ("auto_map", "block_size", "rope_theta", "rope_scaling"):
        config.pop(key)
    config["dflash_config"].update(
        block_size=block_size, conv_kernel_size=2, conv_group_size=conv_group_size,
        selector_rank=selector_rank, selector_top_k=selector_top_k,
    )
    config.update(
        architectures=["DFlash2DraftModel"],
        is_causal=False,
        layer_types=["sliding_attention"] * num_hidden_layers,
        sliding_window=sliding_window,
        use_sliding_window=True,
        max_window_layers=num_hidden_layers,
        hidden_act="silu",
        rope_parameters={"rope_theta": target.get("rope_theta", 10000.0), "rope_type": "default"},
    )
    config.update(extra)
    return config


def write_dflash2_drafter(
    path: Path, config: dict[str, Any], seed: int = 1, init_scale: float = 3.0, codebook_suffix: bool = False
) -> Path:
    """A random DFlash2 checkpoint (bf16, unprefixed names, bare codebook names unless ``codebook_suffix``).

    The convolutions are far from their identity start and the codebooks large
    enough that the selector reorders candidates, so tests see both at work.
    """
    from .dflash2 import CODEBOOKS, DFlash2Args, DFlash2Drafter

    path.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    model = DFlash2Drafter(DFlash2Args.from_dict(config))
    weights = {}
    for k, v in tree_flatten(model.parameters()):
        if k.endswith("base_kernel"):
            v = v + 0.4 * mx.random.normal(v.shape)
        elif k.endswith("kernel_projection.weight"):
            v = 0.3 * mx.random.normal(v.shape) / v.shape[1] ** 0.5
        elif k in CODEBOOKS:
            v = mx.random.normal(v.shape)
            k = f"{k}.weight" if codebook_suffix else k
        elif "norm" not in k:
            v = v * init_scale
        weights[k] = v.astype(mx.bfloat16)
    _save(path, weights)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def write_constant_drafter(path: Path, config: dict[str, Any], target_path: Path, token: int) -> Path:
    """A drafter whose every draft is ``token``, for runs where the target repeats it.

    Its attention and MLP outputs are zero, so the block's hidden state is the
    (normalised) mask embedding, and its final norm weight turns that into the
    target's LM-head row of ``token``. Real weights, real loader: it gives tests
    long accepted runs without a trained drafter.
    """
    path.mkdir(parents=True, exist_ok=True)
    model = Drafter(DrafterArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    for k in weights:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            weights[k] = mx.zeros_like(weights[k])
    target = mx.load(str(target_path / "model.safetensors"))
    embed = next(v for k, v in target.items() if k.endswith(("embed_tokens.weight", "embeddings.weight")))
    head = next((v for k, v in target.items() if k.endswith("lm_head.weight")), embed)[token]
    e = embed[config["dflash_config"]["mask_token_id"]]
    e = e * mx.rsqrt(mx.mean(e * e) + config["rms_norm_eps"])
    weights["norm.weight"] = 4.0 * head / mx.where(mx.abs(e) < 1e-3, 1e-3, e)
    _save(path, {k: v.astype(mx.bfloat16) for k, v in weights.items()})
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def write_draft_vocabulary(path: Path, ids: Sequence[int]) -> Path:
    """Give the drafter in ``path`` its own vocabulary (``models.vocabulary``), in one file as ``train`` exports it."""
    from .vocabulary import CONFIG_KEY, TENSOR

    weights = {}
    for f in path.glob("model*.safetensors"):
        weights.update(mx.load(str(f)))
        f.unlink()
    (path / "model.safetensors.index.json").unlink(missing_ok=True)
    weights[TENSOR] = mx.array(sorted(ids), dtype=mx.int32)
    _save(path, weights)
    config = json.loads((path / "config.json").read_text())
    config["dflash_config"][CONFIG_KEY] = len(ids)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def write_lora_adapter(path: Path, target_path: Path, rank: int = 4, layers: int = 2, seed: int = 0) -> Path:
    """An mlx-lm LoRA adapter for the target in ``target_path``, as ``mlx_lm.lora`` writes one (adapter_config.json,
    adapters.safetensors), with random low-rank updates large enough to change the target's greedy output."""
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load as mlx_lm_load

    path.mkdir(parents=True, exist_ok=True)
    model, _ = mlx_lm_load(str(target_path))
    parameters = {"rank": rank, "scale": 20.0, "dropout": 0.0}
    linear_to_lora_layers(model, layers, parameters)
    rng = np.random.default_rng(seed)
    weights = {k: mx.array(rng.normal(0, 0.05, v.shape).astype(np.float32))
               for k, v in tree_flatten(model.parameters()) if k.rsplit(".", 1)[-1] in ("lora_a", "lora_b")}
    mx.save_safetensors(str(path / "adapters.safetensors"), weights)
    (path / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": layers, "lora_parameters": parameters}, indent=1))
    return path


# Qwen3's tool format (tools listed in the system turn, calls as <tool_call> JSON, results as <tool_response>
# in a user turn, <think> reasoning, a later system message rendered as a system turn), for scripted targets. A
# scripted target sees only its last token, so the generation prompt says which turn this is:
# "assistant[tools]" when get_weather is offered; "assistant[tool result]" after a tool's result ("[echo result]"
# when it holds the marker dflash-ok); "assistant[Bash]" (exec_command for Codex, run_shell_command for Qwen
# Code) when the user asks to run "echo dflash-ok" and that tool is offered; and Qwen3's empty think block when
# thinking is switched off.
TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.reasoning_content %}{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- message.content or '' }}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}"
    "{%- endif %}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant' }}"
    "{%- set ns = namespace(result=false, echoed=false, run=false) %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}{%- set ns.result = true %}{%- set ns.echoed = 'dflash-ok' in m.content %}"
    "{%- elif m.role == 'assistant' %}{%- set ns.result = false %}"
    "{%- elif m.role == 'user' and 'echo dflash-ok' in m.content %}{%- set ns.run = true %}{%- endif %}"
    "{%- endfor %}"
    "{%- set names = (tools or []) | map(attribute='function') | map(attribute='name') | list %}"
    "{%- if ns.result %}{{- '[echo result]' if ns.echoed else '[tool result]' }}"
    "{%- elif ns.run and names | select('in', ['Bash', 'exec_command', 'run_shell_command']) | list %}"
    "{{- '[' + (names | select('in', ['Bash', 'exec_command', 'run_shell_command']) | first) + ']' }}"
    "{%- elif 'get_weather' in names %}{{- '[tools]' }}{%- endif %}"
    "{{- '\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

# What the scripted agent target answers (``write_scripted_target``), by the last token of the prompt.
AGENT_SCRIPTS = {
    "assistant\n": ["<think>", "\nThe user greets me; I greet back.\n", "</think>", "\n\nHello! I am a scripted model.",
                    "<|im_end|>"],
    "<think>\n\n</think>\n\n": ["Hello without thinking.", "<|im_end|>"],
    "assistant[tools]\n": ["<tool_call>", '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', "</tool_call>",
                           "<|im_end|>"],
    "assistant[tool result]\n": ["It is 22 degrees in Paris.", "<|im_end|>"],
    # The agents' shell tools, each call one token (a piece has one successor, and "<tool_call>" has get_weather's).
    "assistant[Bash]\n": ['<tool_call>\n{"name": "Bash", "arguments": {"command": "echo dflash-ok", '
                          '"description": "Print the marker"}}\n</tool_call>', "<|im_end|>"],
    "assistant[exec_command]\n": ['<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "echo dflash-ok"}}'
                                  '\n</tool_call>', "<|im_end|>"],
    "assistant[run_shell_command]\n": ['<tool_call>\n{"name": "run_shell_command", "arguments": {"command": '
                                       '"echo dflash-ok"}}\n</tool_call>', "<|im_end|>"],
    "assistant[echo result]\n": ["The command printed dflash-ok.", "<|im_end|>"],
}


def write_scripted_target(
    path: Path, scripts: dict[str, list[str]], chat_template: str = CHAT_TEMPLATE, config: Optional[dict] = None,
    seed: int = 0, large_corpus: bool = False,
) -> Path:
    """A target that answers by script: its greedy next token is a fixed function of the current one.

    ``scripts`` maps the last piece of a prompt (the end of the generation prompt) to
    the pieces the model answers with, each a token of its own (an added token of the
    tokenizer, as Qwen's ``<tool_call>`` is), ending with an EOS piece. Every layer
    adds nothing to the residual (zero output projections), so the final state is the
    current token's embedding; the script's tokens have orthogonal embeddings and the
    LM head maps each one to its successor (logit 12 against ~0 for the rest, with a
    little noise so that no two logits tie). Real weights, real loader: a chat
    template in Qwen3's tool format (``TOOLS_TEMPLATE``) then exercises tool calls and
    reasoning end to end.
    """
    config = dict(config or target_config("qwen3"))
    chain = {}
    for start, pieces in scripts.items():
        for current, following in zip([start, *pieces], pieces):
            if chain.setdefault(current, following) != following:
                raise ValueError(f"piece {current!r} is followed by two different pieces")
    special = set(SPECIAL_TOKENS)
    added = list(dict.fromkeys(p for p in [*chain, *chain.values()] if p not in special))
    path.mkdir(parents=True, exist_ok=True)
    write_tokenizer(path, config["vocab_size"], added=added, chat_template=chat_template, large_corpus=large_corpus)
    vocab = json.loads((path / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in vocab["added_tokens"]}
    hidden = config["hidden_size"]
    if len(chain) > hidden:
        raise ValueError(f"{len(chain)} scripted tokens need a hidden size of at least that, got {hidden}")
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    embed = np.array(weights["model.embed_tokens.weight"])
    head = np.random.default_rng(seed).normal(0.0, 0.01, (config["vocab_size"], hidden)).astype(np.float32)
    for k, current in enumerate(chain):  # one axis per scripted token: its state points there and nowhere else
        embed[ids[current]] = 0.0
        embed[ids[current], k] = hidden**0.5  # RMS 1, so the final norm keeps it
        head[ids[chain[current]], k] = 12.0 / hidden**0.5
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = mx.zeros_like(weights[name])
    weights["model.embed_tokens.weight"] = mx.array(embed)
    weights["lm_head.weight"] = mx.array(head)
    _save(path, weights)
    (path / "config.json").write_text(json.dumps(dict(config, eos_token_id=ids["<|im_end|>"]), indent=1))
    return path


def vocab_id(path: Path, piece: str) -> int:
    """The id of a special or added token in the tokenizer written to ``path``."""
    return next(t["id"] for t in json.loads((path / "tokenizer.json").read_text())["added_tokens"] if t["content"] == piece)
