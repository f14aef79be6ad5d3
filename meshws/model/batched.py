"""Batched decode: several sessions' one-token steps as one forward through a shard's layers.

The rows run through the decoder layers as one tensor `[rows, 1, hidden]`, so
projections, MLPs and norms read the weights once. Only attention differs per row:
`RowCaches.update` appends each row's new key and value to that session's cache and
hands back per-row lists, and the attention function registered under
`ROWS_ATTENTION` runs HF's own sdpa code row by row.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

ROWS_ATTENTION = "meshws_rows"


class RowCaches:
    """A cache stand-in for a batch of rows: each row updates its own session's cache."""

    def __init__(self, caches: list[Any]) -> None:
        self.caches = caches

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        keys, values = [], []
        for row, cache in enumerate(self.caches):
            key, value = cache.update(key_states[row : row + 1], value_states[row : row + 1], layer_idx)
            keys.append(key)
            values.append(value)
        return keys, values


def _rows_attention(module: Any, query: torch.Tensor, key: Any, value: Any, attention_mask: Any,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Each row's one query against its own keys, with the sdpa code HF uses."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kwargs.pop("sliding_window", None)  # the cache already holds only the window
    outputs = [
        sdpa_attention_forward(module, query[row : row + 1], key[row], value[row], None, **kwargs)[0]
        for row in range(query.shape[0])
    ]
    return torch.cat(outputs), None


def rows_attention_fits(model: Any) -> bool:
    """Batched decode needs plain sdpa-style attention (no logit soft-capping); registers it if so."""
    config = model.config
    if getattr(config, "attn_logit_softcapping", None) or config._attn_implementation not in ("sdpa", None):
        return False
    from transformers import AttentionInterface

    AttentionInterface.register(ROWS_ATTENTION, _rows_attention)
    return True


class RowRunner:
    """Runs a causal LM's decoder layers over a batch of one-token rows, each with its own cache."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.fits = rows_attention_fits(model)
        # Gemma-3 keeps one rotary table per layer type; Llama one for all layers.
        self._rotary_by_type = "layer_type" in inspect.signature(model.model.rotary_emb.forward).parameters

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, caches: list[Any]) -> torch.Tensor:
        base, config = self.model.model, self.model.config
        row_caches = RowCaches(caches)
        layer_types = getattr(config, "layer_types", None)
        if self._rotary_by_type:
            by_type = {kind: base.rotary_emb(hidden, positions, kind) for kind in set(layer_types)}
        else:
            shared = base.rotary_emb(hidden, position_ids=positions)
        previous = config._attn_implementation
        config._attn_implementation = ROWS_ATTENTION
        try:
            for index, layer in enumerate(base.layers):
                output = layer(
                    hidden,
                    attention_mask=None,
                    position_embeddings=by_type[layer_types[index]] if self._rotary_by_type else shared,
                    position_ids=positions,
                    cache=row_caches,
                    use_cache=True,
                )
                hidden = output[0] if isinstance(output, tuple) else output
        finally:
            config._attn_implementation = previous
        return base.norm(hidden)
