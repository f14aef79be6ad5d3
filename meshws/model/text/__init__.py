"""Tokens and choices: a tokenizer folder read without transformers, sampling and its settings (plain data the
wire carries), and structured output's masks. Imports no other room of `model`."""
