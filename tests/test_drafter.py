"""The drafter against an independent dense computation of the published formula."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from dflash_mlx import DFlashError
from dflash_mlx.models import fixtures
from dflash_mlx.models.drafter import Drafter, DrafterArgs, default_target_layer_ids


def _rms(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, positions, base):
    """Non-interleaved RoPE (halves rotated), x: [T, heads, d]."""
    d = x.shape[-1]
    inv = base ** (-np.arange(0, d, 2) / d)
    ang = positions[:, None] * inv[None]  # [T, d/2]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


def dense_reference(p: dict, args: DrafterArgs, feats: np.ndarray, block: np.ndarray) -> np.ndarray:
    """[context ; block] concatenated explicitly, softmax attention over all of it.

    Full layers use no mask. Sliding layers use the public training recipe's rule:
    block row i (absolute position q = C + i) sees context key k when q - k < window,
    and every block position (the block is bidirectional in every layer).
    """
    C, L = len(feats), len(block)
    nh, nkv, hd = args.num_attention_heads, args.num_key_value_heads, args.head_dim
    ctx = _rms(feats @ p["fc.weight"].T, p["hidden_norm.weight"])
    h = block
    for i in range(args.num_hidden_layers):
        w = {k[len(f"layers.{i}.") :]: v for k, v in p.items() if k.startswith(f"layers.{i}.")}
        x = _rms(h, w["input_layernorm.weight"])
        kv_in = np.concatenate([ctx, x])
        q = _rms((x @ w["self_attn.q_proj.weight"].T).reshape(L, nh, hd), w["self_attn.q_norm.weight"])
        k = _rms((kv_in @ w["self_attn.k_proj.weight"].T).reshape(C + L, nkv, hd), w["self_attn.k_norm.weight"])
        v = (kv_in @ w["self_attn.v_proj.weight"].T).reshape(C + L, nkv, hd)
        q = _rope(q, np.arange(C, C + L, dtype=np.float64), args.rope_theta)
        k = _rope(k, np.arange(0, C + L, dtype=np.float64), args.rope_theta)
        rep = nh // nkv
        out = np.zeros((L, nh, hd))
        window = args.layer_window(i)
        qpos, kpos = np.arange(C, C + L)[:, None], np.arange(C + L)[None]
        visible = (kpos >= C) | (qpos - kpos < window) if window else np.ones((L, C + L), bool)
        for head in range(nh):
            s = q[:, head] @ k[:, head // rep].T / np.sqrt(hd)
            s = np.where(visible, s, -np.inf)
            s = np.exp(s - s.max(-1, keepdims=True))
            out[:, head] = (s / s.sum(-1, keepdims=True)) @ v[:, head // rep]
        h = h + out.reshape(L, nh * hd) @ w["self_attn.o_proj.weight"].T
        m = _rms(h, w["post_attention_layernorm.weight"])
        gate = m @ w["mlp.gate_proj.weight"].T
        h = h + ((gate / (1 + np.exp(-gate))) * (m @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
    return _rms(h, p["norm.weight"])


@pytest.fixture(scope="module")
def drafter() -> Drafter:
    config = fixtures.drafter_config(fixtures.target_config(hidden_size=64, num_hidden_layers=6), 2, target_layer_ids=[1, 4])
    mx.random.seed(3)
    model = Drafter(DrafterArgs.from_dict(config))
    # Non-trivial norm weights, so a swapped norm would show.
    for name, value in tree_flatten(model.parameters()):
        if "norm" in name:
            model.load_weights([(name, 0.5 + mx.random.uniform(shape=value.shape))], strict=False)
    return model


def _inputs(seed: int, C: int, L: int, H: int = 64, n: int = 2):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((C, n * H)).astype(np.float32), rng.standard_normal((L, H)).astype(np.float32)


def test_matches_dense_reference(drafter):
    feats, block = _inputs(0, C=7, L=5)
    params = {k: np.array(v, dtype=np.float64) for k, v in tree_flatten(drafter.parameters())}
    ref = dense_reference(params, drafter.args, feats.astype(np.float64), block.astype(np.float64))
    cache = drafter.make_cache()
    out = drafter(mx.array(block)[None], mx.array(feats)[None], cache)
    np.testing.assert_allclose(np.array(out[0]), ref, rtol=2e-4, atol=2e-4)
    # Only the committed context stays in the cache; the block's K/V are dropped.
    assert all(c.offset == 7 for c in cache)


def test_context_fed_in_pieces_equals_one_shot(drafter):
    """Context arriving over several cycles (as accepted tokens do) gives the same drafts."""
    feats, block = _inputs(1, C=9, L=4)
    one = drafter(mx.array(block)[None], mx.array(feats)[None], drafter.make_cache())
    cache = drafter.make_cache()
    for lo, hi in [(0, 3), (3, 4), (4, 9)]:
        out = drafter(mx.array(block)[None], mx.array(feats[lo:hi])[None], cache)
    np.testing.assert_allclose(np.array(out), np.array(one), rtol=1e-4, atol=1e-4)
    assert all(c.offset == 9 for c in cache)


def test_block_attention_is_not_causal(drafter):
    """Changing the last block position changes the first one's output (it attends forward)."""
    feats, block = _inputs(2, C=3, L=4)
    a = drafter(mx.array(block)[None], mx.array(feats)[None], drafter.make_cache())
    block[-1] += 1.0
    b = drafter(mx.array(block)[None], mx.array(feats)[None], drafter.make_cache())
    assert not np.allclose(np.array(a[0, 0]), np.array(b[0, 0]))


def _sliding_drafter(window: int = 4) -> Drafter:
    config = fixtures.drafter_config(
        fixtures.target_config(hidden_size=64, num_hidden_layers=6), 2, target_layer_ids=[1, 4],
        layer_types=["sliding_attention", "full_attention"], sliding_window=window,
    )
    mx.random.seed(5)
    return Drafter(DrafterArgs.from_dict(config))


@pytest.mark.parametrize("C", [2, 9, 40])
def test_sliding_layers_match_dense_reference_with_window_mask(C):
    """Newer drafters: a sliding_attention layer's row i sees the last window-1-i context positions."""
    model = _sliding_drafter()
    assert [layer.self_attn.window for layer in model.layers] == [4, None]
    feats, block = _inputs(4, C=C, L=5)
    params = {k: np.array(v, dtype=np.float64) for k, v in tree_flatten(model.parameters())}
    ref = dense_reference(params, model.args, feats.astype(np.float64), block.astype(np.float64))
    out = model(mx.array(block)[None], mx.array(feats)[None], model.make_cache())
    np.testing.assert_allclose(np.array(out[0]), ref, rtol=2e-4, atol=2e-4)
    if C > 4:  # the window changes the result: a full-attention reading of the same weights differs
        full = dense_reference(params, DrafterArgs.from_dict(dict(model.args.__dict__, layer_types=["full_attention"] * 2)),
                               feats.astype(np.float64), block.astype(np.float64))
        assert not np.allclose(full, ref, atol=1e-3)


def test_sliding_context_fed_in_pieces_equals_dense_reference():
    """Context arriving cycle by cycle through the ring (wrapping many times) still gives the reference."""
    model = _sliding_drafter()
    feats, block = _inputs(6, C=61, L=5)
    params = {k: np.array(v, dtype=np.float64) for k, v in tree_flatten(model.parameters())}
    cache = model.make_cache(block_size=5)
    lo = 0
    for hi in [3, 4, 9, 10, 17, 30, 31, 45, 61]:
        out = model(mx.array(block)[None], mx.array(feats[lo:hi])[None], cache)
        ref = dense_reference(params, model.args, feats[:hi].astype(np.float64), block.astype(np.float64))
        np.testing.assert_allclose(np.array(out[0]), ref, rtol=2e-4, atol=2e-4, err_msg=f"context {hi}")
        lo = hi


def test_sliding_layers_attend_bidirectionally_in_the_block():
    """z-lab drafts every layer non-causally: a later block position changes the first one's output."""
    model = _sliding_drafter()
    feats, block = _inputs(2, C=3, L=4)
    a = model(mx.array(block)[None], mx.array(feats)[None], model.make_cache())
    block[-1] += 1.0
    b = model(mx.array(block)[None], mx.array(feats)[None], model.make_cache())
    assert not np.allclose(np.array(a[0, 0]), np.array(b[0, 0]))


def test_is_causal_true_is_refused():
    config = fixtures.drafter_config(fixtures.target_config(), 1, is_causal=True)
    with pytest.raises(DFlashError, match="is_causal: true"):
        DrafterArgs.from_dict(config)


@pytest.mark.parametrize(
    "L,n,expected",
    [(36, 5, [1, 9, 17, 25, 33]), (32, 5, [1, 8, 15, 22, 29]), (36, 1, [18]), (28, 3, [1, 13, 25])],
)
def test_default_target_layer_ids(L, n, expected):
    """The documented rule; the first two rows are the published Qwen3-8B and Qwen3.5-4B configs."""
    assert default_target_layer_ids(L, n) == expected


def test_missing_target_layer_ids_uses_rule():
    config = fixtures.drafter_config(fixtures.target_config(num_hidden_layers=36), 5)
    assert "target_layer_ids" not in config["dflash_config"]
    assert DrafterArgs.from_dict(config).target_layer_ids == [1, 9, 17, 25, 33]


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 1024},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
        {"rope_type": "linear", "factor": 2.0},
    ],
)
def test_rope_scaling_matches_target(scaling):
    """The drafter builds RoPE exactly as mlx-lm builds it for a target with the same config."""
    from mlx_lm.models import llama

    tconf = fixtures.target_config("llama", rope_scaling=scaling, max_position_embeddings=8192)
    target = llama.Model(llama.ModelArgs.from_dict(tconf))
    drafter = Drafter(DrafterArgs.from_dict(fixtures.drafter_config(tconf, 1)))
    x = mx.random.normal((1, 4, 3, 16))
    for offset in (0, 5000):
        ours = drafter.layers[0].self_attn.rope(x, offset=offset)
        theirs = target.layers[0].self_attn.rope(x, offset=offset)
        np.testing.assert_allclose(np.array(ours), np.array(theirs), rtol=1e-5, atol=1e-5)
    assert type(drafter.layers[0].self_attn.rope) is type(target.layers[0].self_attn.rope)
