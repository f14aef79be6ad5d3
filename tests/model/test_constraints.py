"""The grammars structured output samples under: JSON schemas tightened so that small models finish."""

import pytest

from meshws.model.text.constraints import Grammars, GrammarError, json_grammar, tightened

pytestmark = pytest.mark.real_model  # the embedded model's tokenizer


@pytest.fixture(scope="module")
def grammars(embedded_model):
    from meshws.model.source import load_tokenizer

    tokenizer = load_tokenizer(embedded_model)
    return tokenizer, Grammars(lambda: tokenizer, 49152)


def allows(grammars, schema, text):
    """The grammar of `schema` takes `text` whole, fed one character's tokens at a time."""
    tokenizer, kept = grammars
    matcher = kept.matcher(json_grammar(schema), [])
    try:
        for character in text:
            for token in tokenizer.encode(character, add_special_tokens=False):
                matcher.advance(token)
    except GrammarError:
        return False
    return matcher._inner.is_accepting()


CITY = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "celsius": {"type": "number"}}, "required": ["city"]}


@pytest.mark.parametrize("text, allowed", [
    ('{"city": "Paris"}', True),
    ('{"city": "Paris", "days": 3, "celsius": -4.25}', True),
    ('{"city": "Paris", "properties": {}}', False),  # undeclared: refused unless additionalProperties says so
    ('{"city": "P", "days": 123456789012345}', True),  # 15 digits
    ('{"city": "P", "days": 1234567890123456}', False),
    ('{"city": "P", "celsius": 1.123456789}', True),  # 9 after the point
    ('{"city": "P", "celsius": 1.1234567891}', False),
    ('{"city": "P", "celsius": 1e5}', False),  # plain decimals
    ('{\n  "city": "Paris"\n}', True),
    ('{\n\n\n"city": "Paris"}', False),  # whitespace bounded between two tokens
    ('{"city":' + " " * 3 + '"Paris"}', False),
])
def test_objects_take_what_they_declare_and_numbers_and_whitespace_are_bounded(grammars, text, allowed):
    assert allows(grammars, CITY, text) is allowed


def test_what_a_schema_asks_for_explicitly_stands(grammars):
    open_object = dict(CITY, additionalProperties=True)
    assert allows(grammars, open_object, '{"city": "Paris", "extra": 1}')
    assert allows(grammars, {"type": "integer", "minimum": 10**16}, str(10**16 + 5))  # larger than the bound
    assert allows(grammars, {"type": "number", "multipleOf": 0.5}, "2.5")
    assert not allows(grammars, {"type": "number", "maximum": 10}, "11")
    assert tightened({"type": "object", "enum": [{"properties": {}}]})["enum"] == [{"properties": {}}]  # values


def test_any_json_object_bounds_its_numbers_at_every_depth(grammars):
    assert allows(grammars, None, '{"a": {"b": [1, 2.5, "x", null, true]}}')
    assert not allows(grammars, None, '{"a": [{"b": 1234567890123456789}]}')
    assert not allows(grammars, {"type": "object"}, '{"a": 0.1234567891234}')
