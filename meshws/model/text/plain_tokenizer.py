"""A tokenizer folder (`tokenizer.json`, its config, `chat_template.jinja`) read without transformers.

Importing transformers costs a head about a second of its start (0.7-0.8 s on the Zen 3), and all a node
asks of its tokenizer is small: text to ids, ids to text, the special tokens and the chat template. The
`tokenizers` library is what transformers' fast tokenizer runs on, so this loads the same `tokenizer.json`
into it and does the rest as transformers 5 does (`TokenizersBackend`):

  * encoding and decoding are the backend's, with padding and truncation off and no clean-up of spaces;
  * the chat template renders in the same sandboxed Jinja environment (trim_blocks, lstrip_blocks, loop
    controls, the `generation` tag, its `tojson`, `raise_exception`, `strftime_now`, `dict` and a namespace
    that refuses underscore names), with the messages' None fields dropped, reasoning fields aliased, and
    the special tokens as variables.

A folder whose config asks for anything else (another tokenizer class, clean-up, added tokens beyond the
file's) is not guessed at: `load` returns None and the caller uses transformers. A test holds this to
`AutoTokenizer` on the same folders, text for text and id for id. The tokenizer is the one the GGUF's
`tokenizer.json` describes, on every start: a `config.json` beside it (written for the transformers path
only) would make AutoTokenizer pick some models' own class instead (Qwen2's adds NFC normalisation), which
before this module a node did on a restart but not on its first start.
"""

from __future__ import annotations

import json
import shutil
from copy import copy
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")
KNOWN = {*SPECIAL, "backend", "model_max_length", "tokenizer_class", "clean_up_tokenization_spaces",
         "add_bos_token", "add_eos_token", "chat_template"}  # (what a GGUF's tokenizer saves; more: transformers)
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # as transformers aliases them
TRANSFORMERS_ONLY = {"documents", "chat_template", "continue_final_message", "sanitize_control_tokens",
                     "return_assistant_tokens_mask", "padding", "truncation", "max_length", "return_tensors",
                     "tokenizer_kwargs"}  # apply_chat_template's options that are not template variables
MIN_JINJA = (3, 1, 6)  # older Jinja2 has known sandbox escapes (as transformers refuses it)


class PlainTokenizer:
    def __init__(self, folder: Path, backend: Any, config: dict[str, Any], template: str | None) -> None:
        self.folder = folder
        self.backend_tokenizer = backend
        self.chat_template = template
        self.special_tokens_map = {name: config[name] for name in SPECIAL if isinstance(config.get(name), str)}
        self.bos_token = self.special_tokens_map.get("bos_token")
        self.eos_token = self.special_tokens_map.get("eos_token")
        self.bos_token_id = self._id(self.bos_token)
        self.eos_token_id = self._id(self.eos_token)

    @classmethod
    def load(cls, folder: Path | str) -> PlainTokenizer | None:
        """The folder's tokenizer, or None when its files ask for what this does not do (transformers then)."""
        from tokenizers import Tokenizer

        folder = Path(folder)
        if any((folder / name).exists() for name in ("special_tokens_map.json", "added_tokens.json")):
            return None  # (older transformers' files: AutoTokenizer reads them too)
        try:
            config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
            backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
            template_file = folder / "chat_template.jinja"
            template = template_file.read_text(encoding="utf-8") if template_file.is_file() else None
        except Exception:  # (a file missing or unreadable: tokenizers raises a plain Exception for its own)
            return None
        if not isinstance(config, dict) or set(config) - KNOWN or config.get("clean_up_tokenization_spaces") \
                or config.get("tokenizer_class") not in (None, "TokenizersBackend", "PreTrainedTokenizerFast") \
                or backend.post_processor is None or backend.padding or backend.truncation:
            return None  # (add_bos_token and add_eos_token transformers drops beside a tokenizer.json, as here)
        added = {token.content: token for token in backend.get_added_tokens_decoder().values()}
        for name in SPECIAL:  # transformers (re)adds each as a special, unnormalized token: it must be one already
            token = added.get(config.get(name)) if isinstance(config.get(name), str) else None
            if isinstance(config.get(name), str) and (token is None or not token.special or token.normalized):
                return None
        template = config.get("chat_template") if template is None else template
        if template is not None and not isinstance(template, str):
            return None  # (named templates: transformers picks among them)
        return cls(folder, backend, config, template)

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    # -- text <-> ids -------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def decode(self, token_ids: list[int] | int, skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    # -- chat ---------------------------------------------------------------

    def apply_chat_template(self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = True, return_dict: bool | None = None,
                            **variables: Any) -> Any:
        """As transformers renders a chat (its other options are refused, not ignored: `TRANSFORMERS_ONLY`); with
        `tokenize`, the ids as a list (`return_dict=False`, as transformers' dict is not made here)."""
        if taken := sorted(set(variables) & TRANSFORMERS_ONLY):
            raise TypeError(f"apply_chat_template here does not take {', '.join(taken)} (transformers' tokenizer does)")
        if tokenize and return_dict is not False:
            raise TypeError("apply_chat_template here returns the ids as a list: pass return_dict=False")
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        if tools is not None and not all(isinstance(tool, dict) for tool in tools):
            raise ValueError("Tools should be JSON schemas (dicts) here.")
        messages = []
        for message in _plain(conversation):
            if not isinstance(message, dict):
                raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
            message = {key: value for key, value in message.items() if value is not None}
            reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
            messages.append(message)
        variables = _plain({**self.special_tokens_map, **variables})
        text = self._template.render(messages=messages, tools=_plain(tools), documents=None,
                                     add_generation_prompt=add_generation_prompt, **variables)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    @cached_property
    def _template(self) -> Any:
        return _environment().from_string(self.chat_template)

    def save_pretrained(self, folder: str | Path) -> None:
        """Copy the files this was loaded from (as transformers would write them back)."""
        Path(folder).mkdir(parents=True, exist_ok=True)
        for name in FILES:
            if (self.folder / name).is_file():
                shutil.copyfile(self.folder / name, Path(folder) / name)


def guidance_source(tokenizer: Any) -> str:
    """The backend's JSON, as llguidance reads a fast tokenizer (padding and truncation off)."""
    backend = copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


def _plain(value: Any) -> Any:
    """Only JSON's types reach the template (as transformers rebuilds its inputs: no methods to call)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    return f"<{type(value).__name__}>"


def _environment() -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if tuple(int(part) for part in jinja2.__version__.split(".")[:3] if part.isdigit()) < MIN_JINJA:
        raise ImportError(f"chat templates need jinja2>={'.'.join(map(str, MIN_JINJA))} (older versions have known "
                          f"sandbox escapes); this is {jinja2.__version__}")

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: its text as written (the assistant mask is not asked for)."""
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_text"), [], [], body).set_lineno(lineno)

        def _text(self, caller: Any) -> str:
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """A namespace that refuses underscore names (no reaching CPython's internals through it)."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace.check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace.check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot store {name!r} on a namespace")

    class Dicts:
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[Generation, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    def strftime_now(format: str) -> str:  # (the name transformers gives it: a template may pass format=...)
        return datetime.now().strftime(format)

    environment.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=Dicts(),
                               namespace=Namespace)
    return environment
