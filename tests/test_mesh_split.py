"""Where `meshws mesh` and the bench split a model between a head and a tail (`local_mesh.tail_start`)."""

from types import SimpleNamespace

from meshws.tools.local_mesh import tail_start


def _config(**overrides):
    smollm2 = dict(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                   head_dim=64, intermediate_size=1536, vocab_size=49152)
    return SimpleNamespace(**{**smollm2, **overrides})


def test_the_tail_gets_fewer_layers_as_its_lm_head_weighs_more():
    assert tail_start(_config()) == 19  # the LM head weighs 8 layers: head 0-18 (19 + 0), tail 19-29 (11 + 8)
    assert tail_start(_config(vocab_size=64)) == 15  # a negligible LM head: halves
    assert tail_start(_config(vocab_size=262144, num_hidden_layers=18)) == 17  # Gemma-like: one layer stays
    assert tail_start(_config(num_hidden_layers=2, vocab_size=64)) == 1
    no_head_dim = _config()
    del no_head_dim.head_dim, no_head_dim.num_key_value_heads  # older configs: hidden // heads, no grouped kv
    assert tail_start(no_head_dim) == 19  # (the layer weighs 4.0M here, the LM head 7.1 layers: 18.6)
