"""DFlash2 drafters: loaded as published, drafting exactly as an independent numpy reference, lossless."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import PROMPTS
from helpers import plain_greedy
from mlx.utils import tree_flatten
from test_drafter import _rms, _rope

from dflash_mlx import DFlashError, generate, load
from dflash_mlx.models import fixtures
from dflash_mlx.models.caches import COPY_BLOCK
from dflash_mlx.models.dflash2 import DFlash2Drafter
from dflash_mlx.models.drafter import Drafter, DrafterArgs
from dflash_mlx.models.loader import cast_floats, load_drafter
from dflash_mlx.sampling import Sampling, verify_match, verify_rejection

BLOCK, WINDOW, TOP_K, RANK, GS = 5, 6, 8, 16, 16
# Muse-Glimmer-style output transforms, so that leaving one out changes the walk.
TRANSFORMS = {"output_multiplier": 0.5, "final_logit_softcapping": 6.0}
MAX_TOKENS = 60


def _config(target: dict, **extra) -> dict:
    config = fixtures.dflash2_config(target, 2, block_size=BLOCK, sliding_window=WINDOW, conv_group_size=GS,
                                     selector_rank=RANK, selector_top_k=TOP_K, target_layer_ids=[1, 3], **extra)
    config["dflash_config"].update(TRANSFORMS)
    return config


@pytest.fixture(scope="module")
def d2(tmp_path_factory, models_dir):
    """The Qwen3 target with a DFlash2 drafter, and a qwen3_5 (hybrid) target with its own."""
    root = tmp_path_factory.mktemp("dflash2")
    qwen = json.loads((models_dir / "qwen3" / "config.json").read_text())
    hybrid = fixtures.target_config("qwen3_5")
    fixtures.write_target(root / "qwen3_5", hybrid, seed=7)
    fixtures.write_dflash2_drafter(root / "qwen3-d2", _config(qwen))
    fixtures.write_dflash2_drafter(root / "qwen3_5-d2", _config(hybrid), seed=2)
    return {
        "root": root,
        "qwen": qwen,
        "qwen3": load(str(root / "qwen3-d2"), str(models_dir / "qwen3")),
        "qwen3_5": load(str(root / "qwen3_5-d2"), str(root / "qwen3_5")),
    }


# -- the independent reference ------------------------------------------------------------------


def _conv(y, base, D, gs):
    """Conv(y)_t[c] = sum_j (base[j, c] + D[t, j, c // gs]) * y[t - j, c], zero before the block."""
    out = np.zeros_like(y)
    for t in range(len(y)):
        for j in range(base.shape[0]):
            if t - j >= 0:
                out[t] += (base[j] + np.repeat(D[t, j], gs)) * y[t - j]
    return out


def _attention(w, args, x, ctx, C):
    """Queries from the block; keys/values of [context ; block]; row i sees context k iff C + i - k < W."""
    L, nh, nkv, hd = len(x), args.num_attention_heads, args.num_key_value_heads, args.head_dim
    kv_in = np.concatenate([ctx, x])
    q = _rms((x @ w["self_attn.q_proj.weight"].T).reshape(L, nh, hd), w["self_attn.q_norm.weight"])
    k = _rms((kv_in @ w["self_attn.k_proj.weight"].T).reshape(C + L, nkv, hd), w["self_attn.k_norm.weight"])
    v = (kv_in @ w["self_attn.v_proj.weight"].T).reshape(C + L, nkv, hd)
    theta = 10000.0  # the config's rope_parameters.rope_theta
    q, k = _rope(q, np.arange(C, C + L, dtype=np.float64), theta), _rope(k, np.arange(C + L, dtype=np.float64), theta)
    qpos, kpos = np.arange(C, C + L)[:, None], np.arange(C + L)[None]
    visible = (kpos >= C) | (qpos - kpos < WINDOW)
    out = np.zeros((L, nh, hd))
    for head in range(nh):
        s = np.where(visible, q[:, head] @ k[:, head // (nh // nkv)].T / np.sqrt(hd), -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        out[:, head] = s / s.sum(-1, keepdims=True) @ v[:, head // (nh // nkv)]
    return out.reshape(L, nh * hd) @ w["self_attn.o_proj.weight"].T


def reference_logits(p, args, feats, embeddings, lm_head):
    """Hidden states [L-1, H] and transformed logits [L-1, V] of the drafted positions (spec sections 2, 4)."""
    C, L = len(feats), len(embeddings)
    ctx = _rms(feats @ p["fc.weight"].T, p["hidden_norm.weight"])  # never convolved
    h = embeddings
    for i in range(args.num_hidden_layers):
        w = {k[len(f"layers.{i}.") :]: v for k, v in p.items() if k.startswith(f"layers.{i}.")}
        for part in ("attention_conv", "mlp_conv"):
            x = _rms(h, w["input_layernorm.weight" if part == "attention_conv" else "post_attention_layernorm.weight"])
            base = w[f"{part}.base_kernel"]
            D = (x @ w[f"{part}.kernel_projection.weight"].T).reshape(L, 2, base.shape[1], -1)
            x = _conv(x, base[0], D[:, 0], GS)
            if part == "attention_conv":
                y = _attention(w, args, x, ctx, C)
            else:
                gate = x @ w["mlp.gate_proj.weight"].T
                y = (gate / (1 + np.exp(-gate)) * (x @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
            h = h + _conv(y, base[1], D[:, 1], GS)
    h = _rms(h, p["norm.weight"])[1:]
    u = h @ lm_head * TRANSFORMS["output_multiplier"]
    c = TRANSFORMS["final_logit_softcapping"]
    return h, c * np.tanh(u / c)


def reference_walk(p, h, U, anchor, temperature=0.0, path=None):
    """Candidates (top-k by value, ties by id), and the walk: greedy path, or q_j along ``path``."""
    A, Bc = p["candidate_selector.predecessor_codebook"], p["candidate_selector.successor_codebook"]
    gate = h @ p["candidate_selector.hidden_projection.weight"].T
    a, drafts, qs, cands = anchor, [], [], []
    for j in range(len(U)):
        cand = np.array(sorted(range(U.shape[1]), key=lambda b: (-U[j, b], b))[:TOP_K])
        scores = U[j, cand] + (A[a] * gate[j]) @ Bc[cand].T
        if temperature:
            e = np.exp((scores - scores.max()) / temperature)
            qs.append(dict(zip(cand.tolist(), e / e.sum())))
        d = int(cand[np.argmax(scores)]) if path is None else int(path[j])
        cands.append(set(cand.tolist()))
        drafts.append(d)
        a = d
    return drafts, qs, cands


def _case(pair, n):
    """Everything a proposal needs, in MLX and as float64 numpy."""
    target, drafter, tokenizer = pair
    ids = tokenizer.encode(" ".join(PROMPTS))
    _, feats = target(mx.array(ids)[None], target.make_cache())
    assert feats.shape[1] - 1 > WINDOW + BLOCK  # the window cuts the context
    params = {k: np.array(v.astype(mx.float32), dtype=np.float64) for k, v in tree_flatten(drafter.parameters())}
    embeddings = np.array(target.embed(mx.array(ids[-1:] + [drafter.mask_token_id] * n)), dtype=np.float64)
    lm_head = np.array(target.lm_head(mx.eye(drafter.args.hidden_size)), dtype=np.float64)
    h, U = reference_logits(params, drafter.args, np.array(feats[0, :-1], dtype=np.float64), embeddings, lm_head)
    mlx_args = (target, mx.array(ids[-1:]), feats[:, :-1])
    return mlx_args, params, h, U, ids[-1]


@pytest.mark.parametrize("n", [1, 2, BLOCK - 1])  # runtime blocks shorter than the trained one, and the full one
def test_draft_logits_and_greedy_path_match_reference(d2, n):
    drafter = d2["qwen3"][1]
    (target, last, feats), params, h, U, anchor = _case(d2["qwen3"], n)
    logits = drafter.draft_logits(target, last, feats, drafter.make_cache(block_size=BLOCK), n)
    np.testing.assert_allclose(np.array(logits), U, rtol=1e-4, atol=1e-4)
    greedy, _, _ = reference_walk(params, h, U, anchor)
    proposal = drafter.propose(target, last, feats, drafter.make_cache(block_size=BLOCK), n, Sampling(), None)
    assert proposal.tokens.tolist() == greedy and proposal.logprobs is None
    if n == BLOCK - 1:  # the selector is at work: its path is not the per-position argmax
        assert greedy != np.argmax(U, -1).tolist()


@pytest.mark.parametrize("temperature", [0.6, 1.0])
def test_sampled_proposal_matches_reference(d2, temperature):
    drafter = d2["qwen3"][1]
    (target, last, feats), params, h, U, anchor = _case(d2["qwen3"], BLOCK - 1)
    for seed in range(3):
        proposal = drafter.propose(target, last, feats, drafter.make_cache(block_size=BLOCK), BLOCK - 1,
                                   Sampling(temperature=temperature), mx.random.key(seed))
        path = proposal.tokens.tolist()
        _, qs, cands = reference_walk(params, h, U, anchor, temperature, path)
        logq = np.array(proposal.logprobs)
        assert logq.dtype == np.float32
        for j in range(len(path)):
            support = set(np.flatnonzero(np.isfinite(logq[j])).tolist())
            assert support == cands[j] and path[j] in support
            np.testing.assert_allclose([np.exp(logq[j, b]) for b in sorted(support)],
                                       [qs[j][b] for b in sorted(support)], rtol=1e-4, atol=1e-6)


def test_selector_samples_from_the_q_it_reports(d2):
    """The drafts are drawn from the proposal's q (at T != 1: a q without the temperature would differ)."""
    drafter = d2["qwen3"][1]
    selector = drafter.candidate_selector
    rng = np.random.default_rng(0)
    h = mx.array(rng.standard_normal((2, drafter.args.hidden_size)), dtype=mx.float32)
    logits = mx.array(rng.standard_normal((2, drafter.args.vocab_size)), dtype=mx.float32)
    anchor, m = mx.array([5]), 3000
    first = [selector(h, logits, anchor, 0.5, mx.random.key(i)) for i in range(m)]
    freq = np.bincount(np.array(mx.stack([p.tokens[0] for p in first])), minlength=drafter.args.vocab_size) / m
    q = np.exp(np.array(first[0].logprobs[0]))
    assert 0.5 * np.abs(freq - q).sum() < 0.04


# -- invariants ----------------------------------------------------------------------------------


def _fresh(d2, name="qwen3") -> DFlash2Drafter:
    target = d2[name][0]
    drafter = load_drafter(d2["root"] / f"{name}-d2")
    drafter.update(cast_floats(drafter.parameters(), target.dtype))
    return drafter


def test_identity_convolution_equals_v1(d2):
    """base[:, 0] = 1, base[:, 1] = 0, projection 0: the layers are v1's, on the same weights."""
    drafter = _fresh(d2)
    (target, last, feats), *_ = _case(d2["qwen3"], BLOCK - 1)
    before = drafter.draft_logits(target, last, feats, drafter.make_cache(block_size=BLOCK), BLOCK - 1)
    for layer in drafter.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            base = mx.zeros_like(conv.base_kernel)
            base[:, 0] = 1
            conv.base_kernel = base
            conv.kernel_projection.weight = mx.zeros_like(conv.kernel_projection.weight)
    v1 = Drafter(DrafterArgs.from_dict(_config(d2["qwen"])))
    shared = [(k, v) for k, v in tree_flatten(drafter.parameters()) if "_conv." not in k and "selector" not in k]
    v1.load_weights(shared, strict=True)
    ours = drafter.draft_logits(target, last, feats, drafter.make_cache(block_size=BLOCK), BLOCK - 1)
    theirs = v1.draft_logits(target, last, feats, v1.make_cache(block_size=BLOCK), BLOCK - 1)
    np.testing.assert_allclose(np.array(ours), np.array(theirs), rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.array(before), np.array(ours), atol=1e-2)  # the fixture's conv is not the identity


def test_zero_successor_codebook_is_per_position_argmax(d2):
    drafter = _fresh(d2)
    (target, last, feats), *_ = _case(d2["qwen3"], BLOCK - 1)
    logits = drafter.draft_logits(target, last, feats, drafter.make_cache(block_size=BLOCK), BLOCK - 1)
    walked = drafter.propose(target, last, feats, drafter.make_cache(block_size=BLOCK), BLOCK - 1, Sampling(), None)
    assert walked.tokens.tolist() != mx.argmax(logits, -1).tolist()
    selector = drafter.candidate_selector
    selector.successor_codebook = mx.zeros_like(selector.successor_codebook)
    plain = drafter.propose(target, last, feats, drafter.make_cache(block_size=BLOCK), BLOCK - 1, Sampling(), None)
    assert plain.tokens.tolist() == mx.argmax(logits, -1).tolist()


def test_context_in_pieces_equals_one_shot(d2):
    """The conv never reaches the context: context arriving over cycles gives the same drafts."""
    drafter = d2["qwen3"][1]
    (target, last, feats), *_ = _case(d2["qwen3"], BLOCK - 1)
    one = drafter.draft_logits(target, last, feats, drafter.make_cache(block_size=BLOCK), BLOCK - 1)
    cache = drafter.make_cache(block_size=BLOCK)
    drafter.add_context(feats[:, :7], cache)
    drafter.draft_logits(target, last, feats[:, 7:9], cache, 2)
    pieces = drafter.draft_logits(target, last, feats[:, 9:], cache, BLOCK - 1)
    np.testing.assert_allclose(np.array(pieces), np.array(one), rtol=1e-4, atol=1e-4)


# -- loading -------------------------------------------------------------------------------------


def _write(d2, name, edit_config=None, edit_weights=None, **kwargs):
    """A copy of the Qwen3 DFlash2 drafter with its config.json or safetensors edited after writing."""
    path = fixtures.write_dflash2_drafter(d2["root"] / name, _config(d2["qwen"]), **kwargs)
    if edit_config:
        config = json.loads((path / "config.json").read_text())
        edit_config(config)
        (path / "config.json").write_text(json.dumps(config))
    if edit_weights:
        weights = mx.load(str(path / "model.safetensors"))
        edit_weights(weights)
        mx.save_safetensors(str(path / "model.safetensors"), weights)
    return path


def _load_error(path, match) -> str:
    with pytest.raises(DFlashError, match=match) as err:
        load_drafter(path)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_published_layout_loads(d2):
    drafter = d2["qwen3"][1]
    config = json.loads((d2["root"] / "qwen3-d2" / "config.json").read_text())
    assert "block_size" not in config and "rope_theta" not in config and config["is_causal"] is False
    assert isinstance(drafter, DFlash2Drafter) and drafter.block_size == BLOCK
    assert [layer.self_attn.window for layer in drafter.layers] == [WINDOW, WINDOW]
    weights = mx.load(str(d2["root"] / "qwen3-d2" / "model.safetensors"))
    assert weights["layers.0.attention_conv.base_kernel"].shape == (2, 2, 64)
    assert weights["layers.1.mlp_conv.kernel_projection.weight"].shape == (2 * 2 * 64 // GS, 64)
    assert weights["candidate_selector.predecessor_codebook"].shape == (384, RANK)
    assert all(v.dtype == mx.bfloat16 for v in weights.values())


def test_codebooks_with_weight_suffix(d2):
    suffixed = load_drafter(_write(d2, "suffixed", codebook_suffix=True))
    bare = load_drafter(d2["root"] / "qwen3-d2")
    for name, value in tree_flatten(bare.parameters()):
        assert mx.array_equal(value, dict(tree_flatten(suffixed.parameters()))[name]), name

    def both(weights):
        weights["candidate_selector.successor_codebook.weight"] = weights["candidate_selector.successor_codebook"]

    _load_error(_write(d2, "both", edit_weights=both), "both candidate_selector.successor_codebook and .*weight")


def test_block_size_only_from_dflash_config(d2):
    path = _write(d2, "top-level-block", lambda c: c.update(block_size=16))
    assert load_drafter(path).block_size == BLOCK
    path = _write(d2, "no-block", lambda c: (c.update(block_size=16), c["dflash_config"].pop("block_size")))
    _load_error(path, "DFlash2 drafter config has no dflash_config.block_size")


def test_rope_forms(d2):
    flat = _write(d2, "flat-rope", lambda c: (c.pop("rope_parameters"), c.update(rope_theta=5e5)))
    assert load_drafter(flat).args.rope_theta == 5e5
    nested = _write(d2, "nested-rope", lambda c: c["rope_parameters"].update(rope_theta=7e5))
    assert load_drafter(nested).args.rope_theta == 7e5


@pytest.mark.parametrize(
    "name,edit_config,edit_weights,match",
    [
        ("causal", lambda c: c.update(is_causal=True), None, "is_causal: true"),
        ("missing", None, lambda w: w.pop("layers.1.mlp_conv.kernel_projection.weight"),
         r"layers.1.mlp_conv.kernel_projection.weight is missing \(expected shape \[16, 64\]\)"),
        ("misshaped", None, lambda w: w.update({"layers.0.attention_conv.base_kernel": mx.zeros((2, 3, 64))}),
         r"layers.0.attention_conv.base_kernel has shape \[2, 3, 64\], expected \[2, 2, 64\]"),
        ("codebook", None, lambda w: w.update({"candidate_selector.predecessor_codebook": mx.zeros((384, 8))}),
         r"candidate_selector.predecessor_codebook has shape \[384, 8\], expected \[384, 16\]"),
        ("nemo-name", lambda c: c.update(architectures=["Qwen3DFlash2DraftModel"]), None,
         "Qwen3DFlash2DraftModel is not supported yet; supported: DFlashDraftModel, DFlash2DraftModel"),
        ("claims-v1", lambda c: c.update(architectures=["DFlashDraftModel"]), None,
         r"is a DFlash2 drafter .* set architectures to \[\"DFlash2DraftModel\"\]"),
        ("claims-v1-tensors", lambda c: (c.update(architectures=["DFlashDraftModel"], block_size=BLOCK),
                                         c.update(dflash_config={"mask_token_id": 3, "target_layer_ids": [1, 3]})),
         None, "is a DFlash2 drafter"),
    ],
)
def test_load_errors(d2, name, edit_config, edit_weights, match):
    _load_error(_write(d2, name, edit_config, edit_weights), match)


# -- lossless ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("block_size", [2, 3, 4, BLOCK, None])  # None: the adaptive policy
def test_greedy_lossless(d2, name, window, block_size):
    target, drafter, tokenizer = d2[name]
    ids = tokenizer.encode(" ".join(PROMPTS))
    cache = None if window is None else target.make_cache(window, 0, slack=1)
    ref = plain_greedy(target.model, ids, MAX_TOKENS, prompt_cache=cache, prefill_step_size=24)
    out = generate(target, drafter, tokenizer, ids, max_tokens=MAX_TOKENS, block_size=block_size,
                   eos_token_ids=[], window=window, prefill_step_size=24)
    assert out.tokens == ref


def test_long_accepted_runs_are_lossless(d2, tmp_path):
    """A drafter whose unary logits favour the target's loop token: accepted runs end mid-block."""
    config = fixtures.target_config("qwen3")
    fixtures.write_target(tmp_path / "loop", config, seed=0, init_scale=1.0)
    draft_config = _config(config)
    target, _, tokenizer = load(str(d2["root"] / "qwen3-d2"), str(tmp_path / "loop"))
    ids = tokenizer.encode("hello world")
    ref = plain_greedy(target.model, ids, 120)
    token = max(set(ref), key=ref.count)
    fixtures.write_dflash2_drafter(tmp_path / "d2", draft_config)
    fixtures.write_constant_drafter(tmp_path / "v1", draft_config, tmp_path / "loop", token)
    merged = mx.load(str(tmp_path / "d2" / "model.safetensors")) | mx.load(str(tmp_path / "v1" / "model.safetensors"))
    mx.save_safetensors(str(tmp_path / "d2" / "model.safetensors"), merged)
    target, drafter, tokenizer = load(str(tmp_path / "d2"), str(tmp_path / "loop"))
    for block_size in (3, BLOCK):
        out = generate(target, drafter, tokenizer, ids, max_tokens=120, block_size=block_size, eos_token_ids=[])
        assert out.tokens == ref
        assert max(out.acceptance) >= 2 and 0 < sum(out.acceptance) < len(out.acceptance) * (block_size - 1)


def test_sampled_generation_is_seeded(d2):
    target, drafter, tokenizer = d2["qwen3_5"]
    runs = [generate(target, drafter, tokenizer, PROMPTS[1], max_tokens=30, eos_token_ids=[], temperature=1.0,
                     seed=s).tokens for s in (3, 3, 4)]
    assert runs[0] == runs[1] != runs[2]


# -- sampling with a sparse q --------------------------------------------------------------------


def _selector_q(d2, temperature=1.0):
    """The target's p after the prompt and the selector's q at the first draft position (log-probs)."""
    target, drafter, tokenizer = d2["qwen3"]
    ids = tokenizer.encode(PROMPTS[0])
    logits, feats = target(mx.array(ids)[None], target.make_cache())
    sampling = Sampling(temperature=temperature)
    proposal = drafter.propose(target, mx.array(ids[-1:]), feats[:, :-1], drafter.make_cache(block_size=BLOCK),
                               BLOCK - 1, sampling, mx.random.key(0))
    return sampling.logprobs(logits[0, -1]), proposal.logprobs[0], (target, ids, proposal, sampling)


def test_rejection_with_sparse_q_emits_exactly_p(d2):
    """60k independent trials per q with support on k tokens only: the emitted token is distributed as p.

    Covers q from the selector, a q missing p's mode (the residual must carry it) and q == p on a
    sparse p (an empty residual: the fallback to p).
    """
    rng = np.random.default_rng(1)
    V, m, k = 384, 60000, TOP_K
    p_sel, q_sel, _ = _selector_q(d2, temperature=0.5)  # at T=1 this tiny target's p is too flat to resolve
    p_syn = mx.log(mx.softmax(mx.array(3.0 * rng.standard_normal(V), dtype=mx.float32)))
    order = np.argsort(-np.array(p_syn))

    def sparse(ids, probs):
        x = np.full(V, -np.inf, np.float32)
        x[ids] = np.log(np.asarray(probs) / np.sum(probs))
        return mx.array(x)

    p_sparse = sparse(order[:k], np.exp(np.array(p_syn))[order[:k]])
    cases = {
        "selector q": (p_sel, q_sel),
        "flattened top-k": (p_syn, sparse(order[:k], np.ones(k))),
        "misses p's mode": (p_syn, sparse(order[1 : k + 1], rng.random(k))),
        "q == sparse p": (p_sparse, p_sparse),
    }
    for i, (name, (p, q)) in enumerate(cases.items()):
        assert int(mx.isfinite(q).sum()) == k
        Q, P = mx.broadcast_to(q, (m, V)), mx.broadcast_to(p, (m + 1, V))
        drafted = mx.random.categorical(Q, key=mx.random.key(i))
        accept, stops = verify_rejection(drafted, Q, P, mx.random.key(50 + i))
        emitted = np.array(mx.where(accept, drafted, stops[:-1]))
        pn, qn = np.exp(np.array(p, dtype=np.float64)), np.exp(np.array(q, dtype=np.float64))
        tv = 0.5 * np.abs(np.bincount(emitted, minlength=V) / m - pn).sum()
        tolerance = 0.6 * np.sqrt(pn).sum() / np.sqrt(m)  # 1.5x the expected sampling noise of a TV estimate
        assert tv < tolerance, f"{name}: total variation {tv:.3f} >= {tolerance:.3f}"
        if name in ("flattened top-k", "misses p's mode"):  # a residual of p, not max(p - q, 0), would emit
            # min(p, q) + (1 - sum min(p, q)) p: far enough from p for this test to see it
            wrong = np.minimum(pn, qn) + (1 - np.minimum(pn, qn).sum()) * pn
            assert 0.5 * np.abs(wrong - pn).sum() > 2 * tolerance, name


def test_rejection_accepts_at_least_as_much_as_match_with_selector_q(d2):
    """Along a sampled path, per position: sum min(p, q) >= sum p q, and the verifiers realise both rates."""
    _, _, (target, ids, proposal, sampling) = _selector_q(d2)
    drafts = proposal.tokens.tolist()
    logits, _ = target(mx.array(ids + drafts)[None], target.make_cache())
    ps = sampling.logprobs(logits[0, len(ids) - 1 :])  # p_j for draft position j, given the drafted prefix
    rej, match, m = [], [], 20000
    for j, q in enumerate(proposal.logprobs):
        p = ps[j]
        e_rej = mx.minimum(mx.exp(p), mx.exp(q)).sum().item()
        e_match = (mx.exp(p) * mx.exp(q)).sum().item()
        Q, P = mx.broadcast_to(q, (m, q.shape[0])), mx.broadcast_to(p, (m + 1, p.shape[0]))
        drafted = mx.random.categorical(Q, key=mx.random.key(j))
        accept, _ = verify_rejection(drafted, Q, P, mx.random.key(100 + j))
        assert abs(accept.astype(mx.float32).mean().item() - e_rej) < 0.02
        accept, _ = verify_match(drafted, P, mx.random.key(200 + j))
        assert abs(accept.astype(mx.float32).mean().item() - e_match) < 0.02
        rej.append(e_rej)
        match.append(e_match)
    assert all(r >= x - 1e-6 for r, x in zip(rej, match))
    assert sum(rej) > sum(match)


@pytest.mark.parametrize("draft_quantize", ["none", "8bit"])
def test_convert_bundle_keeps_conv_and_selector_in_float(d2, models_dir, tmp_path, draft_quantize):
    """A bundle of a DFlash2 pair loads as DFlash2 and stays lossless; with --draft-quantize the attention
    and MLP layers are quantized, the convolution kernels and the selector are not."""
    from dflash_mlx.models.convert import convert

    out = convert(str(d2["root"] / "qwen3-d2"), str(tmp_path / "bundle"), target=str(models_dir / "qwen3"),
                  draft_quantize=draft_quantize, q_group_size=32)
    target, drafter, tokenizer = load(str(out))
    assert isinstance(drafter, DFlash2Drafter)
    layer = drafter.layers[0]
    assert hasattr(layer.self_attn.q_proj, "scales") == (draft_quantize == "8bit")
    assert not hasattr(layer.attention_conv.kernel_projection, "scales")
    assert not hasattr(drafter.candidate_selector.hidden_projection, "scales")
    ids = tokenizer.encode(PROMPTS[0])
    out_tokens = generate(target, drafter, tokenizer, ids, max_tokens=60, block_size=BLOCK, eos_token_ids=[]).tokens
    assert out_tokens == plain_greedy(target.model, ids, 60)


# -- the registry's DFlash2 entries --------------------------------------------------------------


def test_registry_resolves_the_published_dflash2_drafters():
    """Qwen3.8-27B and Muse Glimmer resolve to their pairs under every name."""
    from dflash_mlx.models import registry

    qwen = registry.find("z-lab/Qwen3.8-27B-DFlash2")
    assert qwen is not None and qwen.model_type == "qwen3_5" and qwen.supported
    for name in ("z-lab/Qwen3.8-27B-DFlash2", "incoai/Qwen3.8-27B-DFlash2", "Qwen3.8-27B-DFlash2", "qwen3.8-27b-dflash2"):
        assert registry.resolve(name) == ("z-lab/Qwen3.8-27B-DFlash2", "Qwen/Qwen3.8-27B", qwen), name
    assert "DFlash2" in qwen.notes and "block 8" in qwen.notes
    muse = registry.find("incoai/Muse-Glimmer-30B-DFlash2")
    assert muse is not None and muse.drafter == "z-lab/Muse-Glimmer-30B-DFlash2" and muse.supported and muse.tested
    for name in ("z-lab/Muse-Glimmer-30B-DFlash2", "incoai/Muse-Glimmer-30B-DFlash2", "Muse-Glimmer-30B-DFlash2"):
        assert registry.resolve(name) == ("z-lab/Muse-Glimmer-30B-DFlash2", "meta-models/Muse-Glimmer-30B", muse)
    names = [n for p in registry.pairs() for n in {n.lower() for n in p.names}]
    assert len(names) == len(set(names)), "a name denotes two registry entries"


def test_models_lists_the_dflash2_drafters_at_80_columns():
    from typer.testing import CliRunner

    from dflash_mlx.cli.main import app
    from dflash_mlx.models import registry

    rows = {r["drafter"]: r for r in json.loads(CliRunner().invoke(app, ["models", "--json"]).stdout)}
    assert rows["z-lab/Qwen3.8-27B-DFlash2"]["supported"] and rows["z-lab/Muse-Glimmer-30B-DFlash2"]["tested"]
    table = CliRunner(env={"COLUMNS": "80"}).invoke(app, ["models"])
    assert table.exit_code == 0 and "…" not in table.stdout
    lines = table.stdout.splitlines()
    assert max(map(len, lines)) <= 80
    # Each entry is one line, its name and target whole; only the status may continue on the next line.
    cells = {}
    for line in lines:
        parts = line.split()
        if parts and any(parts[0] in p.names for p in registry.pairs()):
            cells[parts[0]] = parts[1:]
    assert set(cells) == {min(p.names, key=len) for p in registry.pairs()}
    assert cells["Qwen3.8-27B"] == ["Qwen/Qwen3.8-27B", "unknown", "58"]
    assert cells["Muse-Glimmer-30B"] == ["meta-models/Muse-Glimmer-30B", "unknown", "66"]


# -- everywhere the v1 drafter goes: chat, bench, serve, doctor --selftest ------------------------


@pytest.fixture(scope="module")
def d2_dir(d2, models_dir, tmp_path_factory):
    """``models_dir``'s layout with the Qwen3 DFlash2 drafter as "qwen3-dflash": the v1 tests' helpers drive it."""
    root = tmp_path_factory.mktemp("d2-models")
    (root / "qwen3").symlink_to(models_dir / "qwen3", target_is_directory=True)
    (root / "qwen3-dflash").symlink_to(d2["root"] / "qwen3-d2", target_is_directory=True)
    return root


@pytest.fixture
def count_proposals(monkeypatch):
    """How many blocks the DFlash2 selector proposed in this process (0: the drafter never drafted)."""
    calls = []
    propose = DFlash2Drafter.propose

    def counted(self, *args, **kwargs):
        calls.append(1)
        return propose(self, *args, **kwargs)

    monkeypatch.setattr(DFlash2Drafter, "propose", counted)
    return calls


def _text(tokenizer, tokens: list[int]) -> str:
    """The text ``generate`` streams for ``tokens``."""
    detokenizer = tokenizer.detokenizer
    for t in tokens:
        detokenizer.add_token(t)
    detokenizer.finalize()
    return detokenizer.text


def test_chat_with_a_dflash2_drafter_equals_plain_greedy(d2, d2_dir, tmp_path):
    """Two piped turns through the installed ``dflash-mlx chat``, full blocks every cycle: each reply is the
    target's greedy reply to the conversation so far (turn 2 after turn 1's own tokens)."""
    import subprocess

    pytest.importorskip("pexpect")
    from test_chat import CLI, ENV, TIMEOUT, chat_args

    if not CLI.exists():
        pytest.skip(f"console script {CLI} not installed")
    run = subprocess.run([str(CLI), *chat_args(d2_dir), "--block-size", str(BLOCK)], input="hello\nhow are you\n",
                         capture_output=True, text=True, encoding="utf-8", env=ENV, timeout=TIMEOUT, cwd=tmp_path)
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    target, _, tokenizer = d2["qwen3"]
    eos = tokenizer.eos_token_ids
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True)
    first = plain_greedy(target.model, ids, 40, eos)
    turn = "<|im_end|>\n<|im_start|>user\nhow are you<|im_end|>\n<|im_start|>assistant\n"  # the ChatML template
    second = plain_greedy(target.model, ids + first + tokenizer.encode(turn, add_special_tokens=False), 40, eos)
    assert first and second
    assert run.stdout == _text(tokenizer, first) + "\n" + _text(tokenizer, second) + "\n"


@pytest.mark.parametrize("block", [None, BLOCK])
def test_bench_with_a_dflash2_drafter(d2, d2_dir, tmp_path, count_proposals, block):
    """`bench` runs the DFlash2 pair: exit 0, tau and depth histograms, dflash tokens equal plain greedy's."""
    from test_bench_cli import _bench

    from dflash_mlx.eval.prompts import builtin

    extra = [] if block is None else ["--block-size", block]
    report, result = _bench(d2_dir, tmp_path, "--num-prompts", "2", *extra)
    assert report["block_size"] == (COPY_BLOCK if block is None else BLOCK)  # the verify: copies fill 16 beyond 5
    assert report["policy"] == ("adaptive" if block is None else "fixed")
    target, _, tokenizer = d2["qwen3"]
    for r, conv in zip(report["records"], builtin("all")):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": conv.turns[0]}], add_generation_prompt=True)
        assert r["dflash"]["tokens"] == plain_greedy(target.model, ids, 24) == r["plain"]["tokens"]
        assert r["identical"] is True
        hist, depths = r["acceptance_histogram"], r["depth_histogram"]
        assert r["tau"] == pytest.approx(sum((k + 1) * c for k, c in enumerate(hist)) / sum(hist))
        assert sum(depths) == sum(hist) == r["dflash"]["cycles"]
        assert len(depths) <= (BLOCK if block is not None else max(BLOCK, 16))  # copies may fill a verify of 16
        if block is not None:  # full blocks, but for the last cycles, which the token budget cuts short
            assert depths[BLOCK - 1] >= r["dflash"]["cycles"] - (BLOCK - 1)
    assert "tau median" in result.stdout
    if block is not None:
        assert count_proposals


def test_serve_with_a_dflash2_drafter_equals_generate(d2, d2_dir):
    """One /v1/completions request at temperature 0 to `serve` with a DFlash2 drafter (full blocks)."""
    pytest.importorskip("openai")
    import httpx2 as httpx
    from test_server import _ctrl_c, _start

    target, drafter, tokenizer = d2["qwen3"]
    ids = tokenizer.encode(PROMPTS[2])
    ref = generate(target, drafter, tokenizer, ids, max_tokens=30, block_size=BLOCK)
    assert ref.tokens == plain_greedy(target.model, ids, 30, tokenizer.eos_token_ids)
    proc, url = _start(d2_dir, "--block-size", str(BLOCK))
    try:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": ids, "max_tokens": 30, "temperature": 0}, timeout=120)
    finally:
        _ctrl_c(proc, url)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["choices"][0]["text"] == ref.text and out["usage"]["completion_tokens"] == len(ref.tokens)
    assert out["usage"]["dflash"]["cycles"] == ref.cycles


def test_selftest_with_a_dflash2_drafter(d2_dir, tmp_path, monkeypatch, count_proposals):
    """`doctor --selftest` on the DFlash2 pair, drafting full blocks every cycle: identical, exit 0."""
    import importlib

    from test_selftest import _doctor, _prompt_lines

    from dflash_mlx.decode.policy import FixedBlock

    module = importlib.import_module("dflash_mlx.decode.generate")  # the package's `generate` is the function
    monkeypatch.setattr(module, "adaptive_policy", lambda target, drafter, window, block, **_: FixedBlock(block))
    monkeypatch.chdir(tmp_path)
    result = _doctor(d2_dir, "qwen3")
    assert result.exit_code == 0, result.output
    lines = _prompt_lines(result.stdout)
    assert sorted(lines) == ["chat-0", "code-0", "math-0"]
    assert all(line.endswith("identical") for line in lines.values()), lines
    assert len(count_proposals) >= 3 * 4  # 23 tokens after the first, at most 5 a cycle, per prompt


# -- the walk is one lazy graph --------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_proposal_is_one_lazy_graph(d2, temperature):
    """No read-back to the host per position: the whole proposal (drafter pass and selector walk) traces
    under mx.compile, which refuses any evaluation (.item(), .tolist(), a Python branch on a value) inside,
    and the traced graph gives the eager drafts and q."""
    drafter = d2["qwen3"][1]
    (target, last, feats), *_ = _case(d2["qwen3"], BLOCK - 1)
    sampling = Sampling(temperature=temperature)

    def propose(feats, key):
        proposal = drafter.propose(target, last, feats, drafter.make_cache(block_size=BLOCK), BLOCK - 1, sampling, key)
        return proposal.tokens if proposal.logprobs is None else (proposal.tokens, proposal.logprobs)

    key = mx.random.key(4)
    eager, traced = propose(feats, key), mx.compile(propose)(feats, key)
    for a, b in zip(*(x if isinstance(x, tuple) else (x,) for x in (eager, traced))):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    selector = drafter.candidate_selector

    def host_read(h, logits, anchor, temperature, key):  # what the test must catch: a walk reading each pick
        proposal = selector(h, logits, anchor, temperature, key)
        return mx.array([int(t) for t in proposal.tokens.tolist()])

    h = drafter.draft_hidden(target, last, feats, drafter.make_cache(block_size=BLOCK), BLOCK - 1)
    with pytest.raises(ValueError, match="eval"):
        mx.compile(lambda h, logits, key: host_read(h, logits, last, temperature, key))(h, target.lm_head(h), key)
