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
`AutoTokenizer` on the same folders, text for text and id for id.
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
         "add_bos_token", "add_eos_token", "chat_template"}
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # as transformers aliases them


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
        try:
            config = json.loads((folder / "tokenizer_config.json").read_text())
            backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception:  # (a file missing or unreadable: tokenizers raises a plain Exception for its own)
            return None
        if not isinstance(config, dict) or set(config) - KNOWN or config.get("clean_up_tokenization_spaces") \
                or config.get("tokenizer_class") not in (None, "TokenizersBackend", "PreTrainedTokenizerFast") \
                or backend.post_processor is None or backend.padding or backend.truncation:
            return None
        if ("add_bos_token" in config or "add_eos_token" in config) and not _post_processor_agrees(backend, config):
            return None
        added = {token.content: token for token in backend.get_added_tokens_decoder().values()}
        for name in SPECIAL:  # transformers (re)adds each as a special, unnormalized token: it must be one already
            token = added.get(config.get(name)) if isinstance(config.get(name), str) else None
            if isinstance(config.get(name), str) and (token is None or not token.special or token.normalized):
                return None
        template = config.get("chat_template")
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
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
                            add_generation_prompt: bool = False, tokenize: bool = True, **kwargs: Any) -> Any:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        messages = []
        for message in _plain(conversation):
            if not isinstance(message, dict):
                raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
            message = {key: value for key, value in message.items() if value is not None}
            reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
            messages.append(message)
        variables = _plain({**self.special_tokens_map, **kwargs})
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


def _post_processor_agrees(backend: Any, config: dict[str, Any]) -> bool:
    """transformers rebuilds the post-processor from add_bos_token/add_eos_token: only load a file whose
    post-processor already adds exactly those (a single text: [bos] A [eos])."""
    state = json.loads(backend.to_str()).get("post_processor") or {}
    if state.get("type") != "TemplateProcessing":
        return False
    wanted = [config["bos_token"]] * bool(config.get("add_bos_token")) + ["$A"] + \
        [config["eos_token"]] * bool(config.get("add_eos_token"))
    pieces = ["$A" if "Sequence" in piece else piece.get("SpecialToken", {}).get("id") for piece in state["single"]]
    return pieces == wanted


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
    environment.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                               dict=Dicts(), namespace=Namespace)
    return environment
