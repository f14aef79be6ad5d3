"""A GGUF file: its tensor table, its blocks mapped as weights, the block types, and the small files built from
it into a cache folder (tokenizer, transformers config). Imports no other room of `model`."""
