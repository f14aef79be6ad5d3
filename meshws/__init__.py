"""meshws: one causal language model split by decoder layers across machines, over websockets."""

__version__ = "0.1.0"
