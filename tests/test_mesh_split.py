"""Where `meshws mesh` and the bench split a model between a head and a tail (`local_mesh.tail_start`)."""

from meshws.tools.local_mesh import tail_start

SMOLLM2 = dict(layers=30, hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab=49152)


def test_the_tail_gets_fewer_layers_as_its_lm_head_weighs_more():
    assert tail_start(SMOLLM2) == 19  # the LM head weighs 8 layers: head 0-18 (19 + 0), tail 19-29 (11 + 8)
    assert tail_start({**SMOLLM2, "vocab": 64}) == 15  # a negligible LM head: halves
    assert tail_start({**SMOLLM2, "vocab": 262144, "layers": 18}) == 17  # Gemma-like: one layer stays
    assert tail_start({**SMOLLM2, "layers": 2, "vocab": 64}) == 1
    ungrouped = {**SMOLLM2, "kv_heads": 9}  # no grouped kv: the layer weighs 4.0M, the LM head 7.1 layers: 18.6
    assert tail_start(ungrouped) == 19


def test_the_split_reads_the_models_shape_from_its_gguf(embedded_model):
    from meshws.model.source import model_shape

    assert model_shape(embedded_model) == SMOLLM2
