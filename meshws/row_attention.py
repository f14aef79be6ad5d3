"""Attention for batched decode: each row of a batch attends to its own session's cache.

A batch of one-token decode steps runs through a shard's decoder layers as one
tensor `[rows, 1, hidden]`, so projections, MLPs and norms read the weights once.
Only attention differs per row: `RowCaches.update` appends each row's new key and
value to that session's cache and hands back per-row lists, and the attention
function registered under `ROWS_ATTENTION` runs HF's own sdpa code row by row.
"""

from __future__ import annotations

from typing import Any

import torch


class RowCaches:
    """A cache stand-in for a batch of rows: each row updates its own session's cache.

    `update` returns per-row lists of keys and values, which only the rows
    attention below knows how to read.
    """

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
    """Attention for `_RowCaches`: each row's one query against its own keys, with the sdpa code HF uses."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kwargs.pop("sliding_window", None)  # the cache already holds only the window
    outputs = [
        sdpa_attention_forward(module, query[row : row + 1], key[row], value[row], None, **kwargs)[0]
        for row in range(query.shape[0])
    ]
    return torch.cat(outputs), None


ROWS_ATTENTION = "meshws_rows"


def register_rows_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ROWS_ATTENTION, _rows_attention)


def rows_attention_fits(model: Any) -> bool:
    """Batched decode needs plain sdpa-style attention (no logit soft-capping)."""
    config = model.config
    if getattr(config, "attn_logit_softcapping", None) or config._attn_implementation not in ("sdpa", None):
        return False
    register_rows_attention()
    return True
