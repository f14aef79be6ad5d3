"""Model output as safe HTML for the chat page: Markdown in, sanitized markup out.

Rendering happens on the head, in Python, so the page needs no JavaScript library and
a machine without Node installs everything from PyPI. Three well-kept parts, each with
one job:

- markdown-it-py (CommonMark, plus GitHub's tables and strikethrough) turns Markdown
  into HTML with raw HTML *off*: a `<script>` in model output is escaped text, and its
  link validation already drops `javascript:`, `vbscript:`, `file:` and `data:` links.
  Images are off too: a model must not make the reader's browser fetch a remote URL.
- Pygments highlights fenced code (classes only; the colours live in `web/code.css`).
- nh3 (Rust's ammonia) sanitizes the result against an allowlist of tags, attributes and
  URL schemes, and gives every link `rel="noopener noreferrer"`: if a Markdown trick ever
  got past the first two, it still could not run script or load anything.

The page's Content-Security-Policy (`guards.SECURITY_HEADERS`) is a fourth wall: no inline
script or style, no foreign host. (So tables keep no column alignment: markdown-it sets it
with a style attribute, which the sanitizer drops.)

What a render may cost is bounded, because anyone who may chat may ask for one: at most
MAX_RENDER_CHARS of text, highlighting only for a list of common languages, blocks of at
most MAX_HIGHLIGHT_CHARS, and HIGHLIGHT_BUDGET seconds of lexing per render (several
Pygments lexers take quadratic time on crafted input: past the budget, code stays plain).
Renders run one at a time on their own thread (`Renderer`), never on the event loop or
the pool that prompt building uses; a full line of waiting renders refuses more.
"""

from __future__ import annotations

import asyncio
import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import nh3
from markdown_it import MarkdownIt
from pygments.formatters import HtmlFormatter
from pygments.lexers import get_lexer_by_name
from pygments.util import ClassNotFound

MAX_RENDER_CHARS = 32 * 1024  # an answer of 4096 tokens is about 20 KB of text
MAX_HIGHLIGHT_CHARS = 8 * 1024  # longer code blocks are shown plain
HIGHLIGHT_BUDGET = 0.1  # seconds of lexing one render may spend; the rest of its code stays plain
MAX_WAITING_RENDERS = 16  # across all sockets; beyond, a render is refused (the page shows text)
LANGUAGES = {  # fences highlighted by name (others, and fences without a name, stay plain)
    "python", "py", "pycon", "javascript", "js", "typescript", "ts", "json", "bash", "sh", "shell", "console",
    "c", "cpp", "c++", "rust", "go", "java", "kotlin", "csharp", "c#", "ruby", "php", "sql", "html", "xml", "css",
    "yaml", "toml", "ini", "diff", "markdown", "md", "lua", "swift", "r", "scala", "haskell", "dockerfile", "make",
}

TAGS = {
    "p", "br", "hr", "h1", "h2", "h3", "h4", "h5", "h6", "blockquote", "ul", "ol", "li", "pre", "code", "span",
    "em", "strong", "del", "s", "a", "table", "thead", "tbody", "tr", "th", "td",
}
ATTRIBUTES = {"a": {"href", "title"}, "code": {"class"}, "span": {"class"}, "ol": {"start"}}
SCHEMES = {"http", "https", "mailto"}

_FORMATTER = HtmlFormatter(nowrap=True)
_budget = threading.local()  # the current render's lexing seconds left (renders run on their own thread)


class _OverBudget(Exception):
    pass


def _highlight(code: str, language: str, _attrs: str) -> str:
    """A fence's code as Pygments spans; "" leaves it to markdown-it (escaped, unhighlighted)."""
    name = language.split()[0].lower() if language.strip() else ""
    if name not in LANGUAGES or len(code) > MAX_HIGHLIGHT_CHARS:
        return ""
    try:
        return _highlighted(code, name)
    except _OverBudget:
        return ""


@lru_cache(maxsize=64)  # while an answer streams, its finished code blocks are rendered again and again
def _highlighted(code: str, name: str) -> str:
    try:
        lexer = get_lexer_by_name(name, stripnl=False)
    except ClassNotFound:
        return ""
    left = getattr(_budget, "left", None)  # (the lexer's first import is not lexing: the clock starts here)
    start = time.perf_counter()
    deadline = None if left is None else start + left
    tokens = []
    try:
        for count, token in enumerate(lexer.get_tokens(code)):  # lexing token by token: a slow lexer is cut off
            tokens.append(token)
            if deadline is not None and count % 32 == 0 and time.perf_counter() > deadline:
                raise _OverBudget()  # (not cached: an exception)
    finally:
        if left is not None:
            _budget.left = left - (time.perf_counter() - start)
    out = io.StringIO()
    _FORMATTER.format(iter(tokens), out)
    return out.getvalue()


@lru_cache(maxsize=1)
def _parser() -> MarkdownIt:
    parser = MarkdownIt("commonmark", {"html": False, "highlight": _highlight, "breaks": True})
    return parser.enable(["table", "strikethrough"]).disable("image")


def render_markdown(text: str) -> str:
    """`text` (model output, untrusted) as sanitized HTML; at most MAX_RENDER_CHARS are rendered."""
    _budget.left = HIGHLIGHT_BUDGET
    try:
        html = _parser().render(text[:MAX_RENDER_CHARS])
    finally:
        _budget.left = None
    return nh3.clean(
        html, tags=TAGS, attributes=ATTRIBUTES, url_schemes=SCHEMES, url_relative="deny",
        link_rel="noopener noreferrer", set_tag_attribute_values={"a": {"target": "_blank"}},
    )


class RenderBusy(Exception):
    """Too many renders wait already."""


class Renderer:
    """Renders one at a time on a thread of their own; at most MAX_WAITING_RENDERS wait."""

    def __init__(self, waiting: int = MAX_WAITING_RENDERS) -> None:
        self.limit = waiting
        self.waiting = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="meshws-render")

    async def render(self, text: str) -> str:
        if self.waiting >= self.limit:
            raise RenderBusy(f"{self.waiting} renders are waiting; the answer is shown as text")
        self.waiting += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, render_markdown, text)
        finally:
            self.waiting -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
