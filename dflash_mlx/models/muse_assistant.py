"""Meta's Muse Glimmer assistant: a DFlash drafter for Muse Glimmer in a layout of its own.

It drafts as v1 does (``drafter.py``: target features fused and injected as keys and values
of every layer, the block drafted in one bidirectional pass), so it runs as a v1 ``Drafter``
once its checkpoint is read:

- the config (``model_type: muse_glimmer_assistant``) keeps ``block_size``, ``mask_token_id``
  and ``target_layer_ids`` at the top level (a ``dflash_config``, where present, wins);
- the fusion is named ``encoder.fc`` and ``encoder.output_norm_enc`` (v1's ``fc`` and
  ``hidden_norm``);
- every layer slides, and a block row at q sees the positions k with ``|q - k| <= window``:
  v1's sliding rule (``q - k < window``) over ``window + 1``.

It takes the target's raw embedding and raw head logits (not Muse's normed embedding, nor its
output multiplier and soft-cap), as Transformers' candidate generator does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx

from ..errors import DFlashError
from .drafter import Drafter, DrafterArgs

MUSE_TARGET_LAYERS = 52  # Muse Glimmer 30B's layers: what the published config's reader assumes when it is left out
RENAMED = {"encoder.fc.weight": "fc.weight", "encoder.output_norm_enc.weight": "hidden_norm.weight"}


@dataclass
class MuseAssistantArgs(DrafterArgs):
    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> MuseAssistantArgs:
        flat = dict(params)
        dflash = {**{k: flat[k] for k in ("block_size", "mask_token_id", "target_layer_ids") if k in flat},
                  **(flat.get("dflash_config") or {})}
        layers = flat.get("num_hidden_layers")
        flat.update(dflash_config=dflash, num_target_layers=flat.get("num_target_layers", MUSE_TARGET_LAYERS))
        flat.setdefault("layer_types", ["sliding_attention"] * layers if isinstance(layers, int) else None)
        flat.setdefault("sliding_window", 2048)
        return super().from_dict(flat)

    def __post_init__(self) -> None:
        super().__post_init__()
        if set(self.layer_types) != {"sliding_attention"}:
            raise DFlashError("a Muse Glimmer assistant's layers are all sliding_attention")
        if len(self.target_layer_ids) != self.num_hidden_layers:
            raise DFlashError(f"a Muse Glimmer assistant reads one target layer per layer: {len(self.target_layer_ids)} "
                              f"target_layer_ids for {self.num_hidden_layers} layers")

    def layer_window(self, i: int) -> Optional[int]:
        return self.sliding_window + 1  # |q - k| <= window


class MuseAssistant(Drafter):
    """A Muse Glimmer assistant, run as the v1 drafter it is."""

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = {k.removeprefix("model."): v for k, v in weights.items()}
        return {RENAMED.get(k, k): v for k, v in weights.items()}
