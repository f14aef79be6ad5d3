"""Chat messages -> prompt: the model's template, or a plain transcript when it has none."""

from meshws.head.prompts import PromptBuilder


def test_default_template_for_a_model_without_one():
    class _Plain:
        chat_template = None

    builder = PromptBuilder(_Plain())
    assert not builder.has_template
    prompt = builder.chat_prompt([{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "Hi"},
                                  {"role": "assistant", "content": "Hello!"},
                                  {"role": "user", "content": "Name a colour."}])
    assert prompt == "Be brief.\n\nUser: Hi\nAssistant: Hello!\nUser: Name a colour.\nAssistant:"
