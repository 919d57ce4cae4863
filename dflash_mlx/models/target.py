"""Target adapter: an mlx-lm causal LM run through its own forward, which also hands over the drafter's features.

The logits are the model's own: its masks, embedding scale, per-layer inputs, KV-shared layers, MoE routing,
soft-capping and output multipliers are whatever its mlx-lm file does. The hidden states the drafter was
trained on are recorded on the way: each decoder layer and the final norm are *tapped*. A tap gives that one
module instance a subclass of its own class whose ``__call__`` calls the original and, while a ``Target``
call asks for it, keeps the output; its parameters, its other methods, other instances of the class and other
models are untouched. Nothing else of the model is replaced.

Caches come from the model's own ``make_cache`` (one ``KVCache`` a layer without it), each taken over by a
cache that can give back rejected drafts, chosen by its type (``_rollback``): full attention trims; a sliding
layer's ``RotatingKVCache`` becomes a ``WindowKVCache`` (mlx-lm's cannot trim once it wraps); a ``CacheList``
becomes a ``CacheGroup`` of its parts; a GatedDeltaNet layer's state (Qwen3.5/3.6, Qwen3-Next) a
``RecurrentCache`` whose layer keeps per-step states (one module run by hand: it costs no pass to roll back,
``bench/hybrid_rollback.py``); any other recurrent state (``ArraysCache``: LFM2, Mamba, Nemotron-H, Falcon-H1,
Granite hybrids) a ``ReplayCache``: saved before a verify, restored after it, the kept tokens run again
(``rewind``). A cache of any other type is refused before any weight runs, naming the layer and the type.
"""

from __future__ import annotations

import importlib.util
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream
from mlx_lm.models.base import gather_last_axis
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk
from mlx_lm.utils import MODEL_REMAPPING

from ..errors import DFlashError
from .caches import CacheGroup, RecurrentCache, ReplayCache, WindowKVCache, leaves, trim_to

# Architectures whose tiny checkpoints are tested lossless here, alone and batched (tests/test_architectures.py);
# any other mlx-lm causal LM runs if its caches are of the types above.
TESTED_MODEL_TYPES = (
    "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next", "gpt_oss",
    "gemma2", "gemma3", "gemma3_text", "gemma4", "gemma4_text", "kimi_k25", "deepseek_v3", "glm_moe_dsa",
    "minimax_m2", "laguna", "muse_glimmer", "ministral3", "phi3", "olmo2", "olmo3", "granite", "smollm3",
    "exaone4", "cohere2", "glm4", "deepseek_v2", "lfm2", "nemotron_h", "falcon_h1", "mamba2", "granitemoehybrid",
)
# Where a model keeps its final norm and its token embedding, by the names mlx-lm's model files use.
NORM_NAMES = ("norm", "final_layernorm", "norm_f", "ln_f", "final_norm", "final_layer_norm", "embedding_norm")
EMBEDDING_NAMES = ("embed_tokens", "embeddings", "wte", "word_embeddings", "tok_embeddings", "embedding")
HEAD_NAMES = ("lm_head", "output", "embed_out")
# Model types whose Hugging Face embedding module scales its output (Gemma's ``ScaledWordEmbedding``): drafters
# trained there take the embedding with that scale; mlx-lm applies it in the forward instead.
SCALED_EMBEDDINGS = ("gemma3", "gemma3_text", "gemma3n", "gemma4", "gemma4_text")
GATED_DELTA_MODULES = ("mlx_lm.models.qwen3_5", "mlx_lm.models.qwen3_next")  # layers run by hand, per step


def mlx_lm_model_type(model_type: Optional[str]) -> Optional[str]:
    """The mlx-lm model file a config's ``model_type`` loads (its remapping applied), or None if it has none."""
    if not isinstance(model_type, str) or not model_type:
        return None
    name = MODEL_REMAPPING.get(model_type, model_type)
    try:
        return name if importlib.util.find_spec(f"mlx_lm.models.{name}") is not None else None
    except (ImportError, ValueError):
        return None


def check_model_type(model_type: Optional[str]) -> None:
    """Refuse a config whose architecture mlx-lm has no model file for."""
    if mlx_lm_model_type(model_type) is None:
        raise DFlashError(f"target architecture {model_type!r} is not an mlx-lm model: this mlx-lm has no model file "
                          "for it (dflash-mlx runs any mlx-lm causal LM)")


def is_tested(model_type: Optional[str]) -> bool:
    return model_type in TESTED_MODEL_TYPES


# -- taps --------------------------------------------------------------------------------------------------


class _Recorder:
    """What a model's taps keep during one ``Target`` call: one per model, shared by its targets."""

    def __init__(self) -> None:
        self.active = False
        self.capture: frozenset[int] = frozenset()  # the layers whose outputs to keep
        self.last_only = False  # the final norm hands the head the last position only
        self.undoable = True  # a GatedDeltaNet layer keeps what it needs to roll back
        self.outputs: dict[int, mx.array] = {}
        self.normed: Optional[mx.array] = None
        self.final_norm: Optional[nn.Module] = None  # the norm the head reads (found by ``Target._final_norm``)
        self.norm_inputs: Optional[list[tuple[nn.Module, mx.array]]] = None  # while finding it: every norm's input

    def start(self, capture: frozenset[int], last_only: bool, undoable: bool) -> None:
        self.active, self.capture, self.last_only, self.undoable = True, capture, last_only, undoable
        self.outputs, self.normed = {}, None

    def stop(self) -> tuple[dict[int, mx.array], Optional[mx.array]]:
        outputs, normed = self.outputs, self.normed
        self.active, self.outputs, self.normed = False, {}, None
        return outputs, normed


def _layer_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    out = self._dflash_base.__call__(self, *args, **kwargs)
    recorder = self._dflash_recorder
    if recorder.active and self._dflash_index in recorder.capture:
        recorder.outputs[self._dflash_index] = out[0] if isinstance(out, tuple) else out
    return out


def _norm_call(self: nn.Module, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
    out = self._dflash_base.__call__(self, x, *args, **kwargs)
    recorder = self._dflash_recorder
    if recorder.norm_inputs is not None:
        recorder.norm_inputs.append((self, x))
    elif recorder.active and self is recorder.final_norm:
        recorder.normed = out
        if recorder.last_only:  # the head runs over the position whose logits are asked for, not all of them
            out = out[:, -1:]
    return out


def _gated_delta_call(self: nn.Module, inputs: mx.array, mask: Optional[mx.array] = None, cache: Any = None
                      ) -> mx.array:
    if cache is not None and hasattr(cache, "record") and mask is None:  # ours (alone or a batch's): undoable
        return _gated_delta_net(self, inputs, cache, self._dflash_recorder.undoable)
    return self._dflash_base.__call__(self, inputs, mask, cache)


_TAPPED: dict[tuple[type, str], type] = {}


def _tap(module: nn.Module, kind: str, call: Callable[..., Any], recorder: _Recorder, **fields: Any) -> None:
    """Give this one module a subclass of its class whose ``__call__`` is ``call`` (idempotent)."""
    base = type(module)
    if getattr(base, "_dflash_kind", None) != kind:
        key = (base, kind)
        if key not in _TAPPED:
            _TAPPED[key] = type(base.__name__, (base,), {"__call__": call, "_dflash_base": base, "_dflash_kind": kind,
                                                         "__module__": base.__module__})
        module.__class__ = _TAPPED[key]
    module._dflash_recorder = recorder
    for name, value in fields.items():
        setattr(module, name, value)


def _recorder(model: nn.Module) -> _Recorder:
    recorder = getattr(model, "_dflash_recorder", None)
    if recorder is None:
        recorder = _Recorder()
        model._dflash_recorder = recorder
    return recorder


# -- the GatedDeltaNet layer, by hand ------------------------------------------------------------------------


def _fused_recurrence() -> bool:
    """Whether gated_delta_update runs mlx-lm's fused Metal kernel here (GPU default device)."""
    return mx.default_device() == mx.gpu and mx.metal.is_available()


def _gated_delta_net(gdn: nn.Module, x: mx.array, cache: Any, undoable: bool) -> mx.array:
    """mlx-lm's GatedDeltaNet forward (Qwen3.5 and Qwen3-Next layouts), able to give back the tail of an update.

    With ``undoable`` it leaves a replay in the cache, which keeps this update's
    projections (and per-step states) alive until the next update: only a verify,
    which may be rolled back, asks for it; a prefill chunk does not.
    """
    B, S, _ = x.shape
    if hasattr(gdn, "in_proj_qkvz"):  # Qwen3-Next packs the projections
        q, k, v, z, b, a = gdn.fix_query_key_value_ordering(gdn.in_proj_qkvz(x), gdn.in_proj_ba(x))
        mixed = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
    else:
        mixed = gdn.in_proj_qkv(x)
        z = gdn.in_proj_z(x).reshape(B, S, gdn.num_v_heads, gdn.head_v_dim)
        b, a = gdn.in_proj_b(x), gdn.in_proj_a(x)
    n_keep = gdn.conv_kernel_size - 1
    conv_state = cache[0] if cache[0] is not None else mx.zeros((B, n_keep, gdn.conv_dim), dtype=x.dtype)
    conv_input = mx.concatenate([conv_state, mixed], axis=1)
    conv_out = nn.silu(gdn.conv1d(conv_input))
    q, k, v = [
        t.reshape(B, S, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [gdn.key_dim, 2 * gdn.key_dim], -1),
            [gdn.num_k_heads, gdn.num_k_heads, gdn.num_v_heads],
            [gdn.head_k_dim, gdn.head_k_dim, gdn.head_v_dim],
        )
    ]
    q, k = normalize_qk(q, k, inv_scale=gdn.head_k_dim**-0.5, eps=1e-6)
    old_state = cache[1]

    def recurrence(end: int, state: Optional[mx.array], start: int = 0) -> tuple[mx.array, mx.array]:
        s = slice(start, end)
        return gated_delta_update(
            q[:, s], k[:, s], v[:, s], a[:, s], b[:, s], gdn.A_log, gdn.dt_bias, state, None, use_kernel=not gdn.training
        )

    if undoable and cache.step_states and S <= cache.slack:
        # One token at a time: what mlx-lm's ops path does anyway, keeping each state.
        outs, steps, state = [], [], old_state
        for t in range(S):
            o, state = recurrence(t + 1, state, start=t)
            outs.append(o)
            steps.append(state)
        out = mx.concatenate(outs, axis=1)
    else:
        out, state = recurrence(S, old_state)
        steps = []

    def replay(keep: int) -> tuple[mx.array, mx.array]:
        if keep == 0:
            return conv_state, old_state
        kept = steps[keep - 1] if steps else recurrence(keep, old_state)[1]
        return mx.contiguous(conv_input[:, keep : keep + n_keep]), kept

    cache.record(mx.contiguous(conv_input[:, -n_keep:]), state, replay if undoable else None, S)
    out = gdn.out_proj(gdn.norm(out, z).reshape(B, S, -1))
    group = getattr(gdn, "sharding_group", None)  # sharded: this rank's heads (and state) only, summed here
    return out if group is None else mx.distributed.all_sum(out, group=group)


def _is_gated_delta(layer: nn.Module) -> bool:
    linear = getattr(layer, "linear_attn", None)
    return linear is not None and getattr(type(linear), "_dflash_base", type(linear)).__module__ in GATED_DELTA_MODULES


# -- the model's parts ---------------------------------------------------------------------------------------


def _child(module: nn.Module, names: Sequence[str], kind: type) -> Optional[nn.Module]:
    return next((m for name in names if isinstance(m := module.get(name), kind)), None)


def _body(lm: nn.Module, layers: list[nn.Module]) -> nn.Module:
    """The module that holds the decoder layers (and, beside them, the embedding and the final norm)."""
    for _, module in lm.named_modules():
        if any(isinstance(v, list) and v and v[0] is layers[0] for v in module.values()):
            return module
    return lm


class Target:
    """A loaded mlx-lm causal LM plus the layer ids whose outputs feed the drafter."""

    def __init__(self, model: nn.Module, layer_ids: Sequence[int], group: Optional[mx.distributed.Group] = None):
        self.group = group  # the ranks this model is sharded over (model.shard), None on one machine
        self.model = model
        self.lm = getattr(model, "language_model", model)  # a multimodal wrapper's text model
        self.args = getattr(self.lm, "args", None) or getattr(model, "args", None)
        self.model_type = getattr(model, "model_type", None) or getattr(getattr(model, "args", None), "model_type", None)
        self.layers = list(model.layers)
        self.body = _body(self.lm, self.layers)
        self.embedding = _child(self.body, EMBEDDING_NAMES, (nn.Embedding, nn.QuantizedEmbedding))
        if self.embedding is None:
            raise DFlashError(f"cannot find the token embedding of this {self.model_type} target")
        self.layer_ids = list(layer_ids)
        n = self.num_layers
        bad = [i for i in self.layer_ids if not 0 <= i < n]
        if bad:
            raise DFlashError(
                f"drafter target_layer_ids {self.layer_ids} out of range for a {n}-layer target (bad: {bad})"
            )
        self._capture = frozenset(self.layer_ids)  # a layer listed twice is captured once, used twice
        self._recorder = _recorder(model)
        for i, layer in enumerate(self.layers):
            _tap(layer, "layer", _layer_call, self._recorder, _dflash_index=i)
            if _is_gated_delta(layer):
                _tap(layer.linear_attn, "gated_delta", _gated_delta_call, self._recorder)
        self.norm = self._final_norm()
        if n - 1 in self.layer_ids and self.norm is None:
            raise DFlashError(f"the drafter reads the last layer after the final norm, which this {self.model_type} "
                              "target does not apply to its last layer's output")
        self.kinds = [self._kind(c) for c in self.make_cache()]  # refuses a cache type that cannot roll back
        self._quantized: dict[tuple[int, int], Optional[str]] = {}  # quantized_problem's answers
        self.source: Optional[Path] = None  # the folder it was loaded from (``load`` sets it)
        self.adapter: Optional[Path] = None  # the LoRA adapter folder applied to it, if any

    def _final_norm(self) -> Optional[nn.Module]:
        """The norm the head reads: of the body's norms by name, the one whose input is the last layer's output
        (found by building, not running, a one-token forward). None: the model has none such, and the head runs
        over every position."""
        recorder = self._recorder
        if recorder.final_norm is not None:
            return recorder.final_norm
        candidates = [m for name in NORM_NAMES if isinstance(m := self.body.get(name), nn.Module)]
        if not candidates:
            return None
        for norm in candidates:
            _tap(norm, "norm", _norm_call, recorder)
        recorder.norm_inputs = []
        try:
            with mx.stream(generation_stream):
                _, outputs, _ = self._forward(mx.array([[0]]), self.make_native_cache(), record=False,
                                              capture=frozenset([self.num_layers - 1]))
            last = outputs.get(self.num_layers - 1)
            recorder.final_norm = next((m for m, x in recorder.norm_inputs if x is last), None)
        finally:
            recorder.norm_inputs = None
        return recorder.final_norm

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @cached_property
    def hidden_size(self) -> int:
        return self.embedding(mx.array([0])).shape[-1]

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding: every id the model takes, added tokens included."""
        return self.embedding.weight.shape[0]

    @property
    def max_positions(self) -> Optional[int]:
        """The most positions the model was made for (its config's max_position_embeddings), if it says."""
        return getattr(self.args, "max_position_embeddings", None)

    @property
    def dtype(self) -> mx.Dtype:
        """The float dtype activations run in (scales dtype for quantized embeddings)."""
        emb = self.embedding
        return emb.scales.dtype if hasattr(emb, "scales") else emb.weight.dtype

    @property
    def embed_scale(self) -> float:
        """The scale a drafter's inputs take the embedding with: Gemma's embedding module applies sqrt(hidden)."""
        own = getattr(self.body, "embed_scale", None)
        if isinstance(own, (int, float)):
            return float(own)
        return self.hidden_size**0.5 if self.model_type in SCALED_EMBEDDINGS else 1.0

    @property
    def logit_transforms(self) -> dict[str, float]:
        """What the model does to its head's logits, as a drafter's config says it (``Drafter.compute_logits``):
        a drafter that borrows the head gives the target's distribution with these."""
        args, out = self.args, {}
        scale = getattr(args, "logit_scale", None) or (1 / args.logits_scaling if getattr(args, "logits_scaling", None)
                                                        else None)
        if scale:
            out["output_multiplier"] = float(scale)
        if softcap := getattr(args, "final_logit_softcapping", None):
            out["final_logit_softcapping"] = float(softcap)
        return out

    # -- caches -------------------------------------------------------------------------------------------

    def make_cache(self, window: Optional[int] = None, sinks: int = 0, slack: int = 16) -> list[Any]:
        """The model's own caches, each as one that can roll back ``slack`` tokens.

        Without ``window`` full-attention layers keep everything (exact full
        attention). With it they keep ``sinks`` + the last ``window`` positions.
        Layers with their own sliding window keep theirs, in a cache that can
        roll back. Recurrent layers hold a fixed-size state whatever the window.
        """
        native = self.make_native_cache()
        return [self._rollback(c, i, len(native), window, sinks, slack) for i, c in enumerate(native)]

    def make_native_cache(self) -> list[Any]:
        """The caches mlx-lm's own decoding makes for this model."""
        return make_prompt_cache(self.model)

    def _rollback(self, c: Any, i: int, count: int, window: Optional[int], sinks: int, slack: int) -> Any:
        """The cache that takes over the model's own cache ``c`` of layer ``i`` (of ``count`` caches)."""
        if type(c) is KVCache:
            return KVCache() if window is None else WindowKVCache(window, sinks, slack)
        if type(c) is RotatingKVCache and c.keep == 0:
            return WindowKVCache(c.max_size, 0, slack)
        if type(c) is CacheList:
            return CacheGroup(*(self._rollback(part, i, count, window, sinks, slack) for part in c.caches))
        if type(c) is ArraysCache:
            if count == self.num_layers and _is_gated_delta(self.layers[i]):
                return RecurrentCache(slack, step_states=not _fused_recurrence())
            return ReplayCache(len(c.cache))
        where = f"layer {i}" if count == self.num_layers else f"cache {i} of {count}"
        raise DFlashError(f"this {self.model_type} target keeps a {type(c).__name__} for its {where}, which cannot "
                          "take back rejected drafts: dflash-mlx cannot run it")

    def _one_token(self, caches: list[Any]) -> list[Any]:
        """``caches`` after the model ran one token through them (lazy)."""
        with mx.stream(generation_stream):
            self._forward(mx.array([[0]]), caches, record=False, undoable=False)
        return caches

    @cached_property
    def cache_bytes(self) -> tuple[int, int]:
        """(bytes one more position adds to the caches, bytes they hold whatever the length: recurrent states)."""
        per_token = fixed = 0
        for c in leaves(self._one_token(self.make_cache())):
            if isinstance(c, (KVCache, WindowKVCache)):
                per_token += sum(a.nbytes // a.shape[2] for a in (c.keys, c.values))
            else:
                fixed += c.nbytes
        return per_token, fixed

    @cached_property
    def attention_dims(self) -> set[int]:
        """The sizes of what the full-attention layers keep per head and position (keys and values; an MLA layer's
        latent and rotary parts): what ``--kv-bits`` quantizes in groups."""
        full = [c for c in self._one_token(self.make_cache()) if type(c) is KVCache]
        return {a.shape[-1] for c in full for a in (c.keys, c.values)}

    def quantized_problem(self, bits: int, group_size: int) -> Optional[str]:
        """Why this model does not run on mlx-lm's quantized KV cache (None: it does): a quantized cache is tried on
        two tokens, as ``--kv-bits`` makes it, before any request relies on it (once per setting)."""
        if (bits, group_size) not in self._quantized:
            self._quantized[bits, group_size] = self._try_quantized(bits, group_size)
        return self._quantized[bits, group_size]

    def _try_quantized(self, bits: int, group_size: int) -> Optional[str]:
        caches = self._one_token(self.make_cache())
        caches = [c.to_quantized(group_size=group_size, bits=bits) if type(c) is KVCache else c for c in caches]
        try:
            with mx.stream(generation_stream):
                logits, _, _ = self._forward(mx.array([[0, 1]]), caches, record=False, undoable=False)
            mx.eval(logits)
        except Exception as e:  # noqa: BLE001 (what a model file raises on a cache it does not handle varies)
            return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no message'}"
        return None

    @staticmethod
    def _kind(c: Any) -> str:
        """full, sliding (a window of its own), linear (a GatedDeltaNet state), recurrent (saved and replayed) or
        group (several caches of one layer)."""
        return {KVCache: "full", WindowKVCache: "sliding", RecurrentCache: "linear", ReplayCache: "recurrent",
                CacheGroup: "group"}[type(c)]

    def rewind(self, caches: list[Any], length: int) -> None:
        """The one way back for this target's caches: every layer to ``length`` tokens.

        Attention layers trim. Recurrent layers that save and replay go back to before
        their last update, and the part of it that is kept runs again through the model
        (every layer: trimmed layers take the kept tokens anew). RuntimeError or
        ValueError where a layer cannot go back that far.
        """
        replays = [c for c in leaves(caches) if isinstance(c, ReplayCache) and c.offset > length]
        if not replays:
            trim_to(caches, length)
            return
        start, tokens = replays[0].offset - replays[0].last_update, replays[0].tokens
        if tokens is None or length < start:
            raise RuntimeError(f"a recurrent layer holds {replays[0].offset} tokens, cannot return to {length}")
        trim_to(caches, start)
        if length > start:
            with mx.stream(generation_stream):
                self._forward(tokens[:, : length - start], caches, record=False, undoable=False)

    # -- the forward --------------------------------------------------------------------------------------

    def _forward(self, tokens: mx.array, cache: list[Any], record: bool, last_only: bool = False,
                 undoable: bool = True, capture: Optional[frozenset[int]] = None
                 ) -> tuple[mx.array, dict[int, mx.array], Optional[mx.array]]:
        """The model's own forward over ``tokens``: its logits, the captured layers' outputs and the final norm's."""
        replays = [c for c in leaves(cache) if isinstance(c, ReplayCache)]
        for c in replays:
            c.save(tokens if undoable else None)
        capture = (self._capture if record else frozenset()) if capture is None else capture
        self._recorder.start(capture, last_only and self._recorder.final_norm is not None, undoable)
        try:
            logits = self.model(tokens, cache=cache)
        finally:
            outputs, normed = self._recorder.stop()
        for c in replays:
            c.advanced(tokens.shape[1])
        if last_only and logits.shape[1] > 1:  # no final norm to cut at: the head ran over every position
            logits = logits[:, -1:]
        return logits, outputs, normed

    def __call__(
        self, tokens: mx.array, cache: list[Any], last_logits_only: bool = False, undoable: bool = True
    ) -> tuple[mx.array, mx.array]:
        """Logits and the concatenated features of ``layer_ids`` for ``tokens`` ([B, L]).

        A layer's feature is its output, except the last layer's: that one is taken
        after the final norm, as z-lab's code takes it (Transformers' last
        ``hidden_states`` entry is normed), so a drafter trained there drafts the same.
        ``last_logits_only`` runs the vocabulary projection over the last position
        only (prefill needs one next token, not L of them). ``undoable=False``
        (prefill) keeps nothing to roll back with: the update cannot be undone.
        """
        logits, outputs, normed = self._forward(tokens, cache, bool(self.layer_ids), last_logits_only, undoable)
        if not self.layer_ids:  # loaded alone: no drafter reads features
            return logits, mx.zeros((*tokens.shape, 0), dtype=self.dtype)
        last = self.num_layers - 1
        if last in self._capture:
            outputs[last] = normed
        missing = [i for i in self.layer_ids if i not in outputs]
        if missing:
            raise DFlashError(f"this {self.model_type} target's forward did not run layer(s) {missing} through its "
                              "layer list: dflash-mlx cannot read its hidden states")
        return logits, mx.concatenate([outputs[i] for i in self.layer_ids], axis=-1)

    def self_check(self) -> None:
        """Refuse a model whose caches, taken over, do not give its own logits back: a prefill of four tokens, a
        verify of four with two kept, the other two again, against the model on its own caches a token at a time.
        Run on load for an architecture not tested here (a few passes of at most four tokens): what its model
        file does beyond its caches' types would show here, not in a user's reply."""
        tokens = (mx.arange(8) * 31 + 5)[None] % self.vocab_size
        with mx.stream(generation_stream):
            native = self.make_native_cache()
            expected = [self.model(tokens[:, :4], cache=native)[:, -1]]
            expected += [self.model(tokens[:, t : t + 1], cache=native)[:, -1] for t in range(4, 8)]
            ours = self.make_cache(slack=8)
            prefill, _, _ = self._forward(tokens[:, :4], ours, record=False, undoable=False)
            verify, _, _ = self._forward(tokens[:, 4:], ours, record=False)
            self.rewind(ours, 6)
            again, _, _ = self._forward(tokens[:, 6:], ours, record=False)
            got = [prefill[:, -1], verify[:, 0], verify[:, 1], again[:, 0], again[:, 1]]
        for step, (a, b) in enumerate(zip(got, expected)):
            a, b = a.astype(mx.float32), b.astype(mx.float32)
            scale = mx.max(mx.abs(b)).item() + 1e-3
            if mx.max(mx.abs(a - b)).item() > 0.02 * scale or mx.argmax(a).item() != mx.argmax(b).item():
                raise DFlashError(f"this {self.model_type} target does not give its own logits back after a rolled-back "
                                  f"verify (step {step} of a self-check): dflash-mlx cannot run it losslessly")

    # -- what a drafter borrows ---------------------------------------------------------------------------

    def embed(self, tokens: mx.array) -> mx.array:
        """The embedding as a drafter takes it: the lookup, with the scale Gemma's embedding module applies."""
        h = self.embedding(tokens)
        scale = self.embed_scale
        return h if scale == 1.0 else h * mx.array(scale, dtype=h.dtype)

    @cached_property
    def head_module(self) -> nn.Module:
        """The module whose weight is the vocabulary projection: the model's own LM head, or its tied embedding."""
        module = _child(self.lm, HEAD_NAMES, nn.Module)
        return module if module is not None else self.embedding

    @property
    def head(self) -> Callable[[mx.array], mx.array]:
        """The vocabulary projection, as a function of the final hidden state."""
        module = self.head_module
        return module.as_linear if module is self.embedding else module

    @property
    def head_group(self) -> Optional[mx.distributed.Group]:
        """The ranks the vocabulary projection is split over (each holds a slice of it); None: one piece."""
        return getattr(self.lm, "sharding_group", None)

    def lm_head(self, h: mx.array) -> mx.array:
        logits = self.head(h)
        group = self.head_group
        return logits if group is None else gather_last_axis(logits, group)
