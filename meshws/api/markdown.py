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
"""

from __future__ import annotations

from functools import lru_cache

import nh3
from markdown_it import MarkdownIt
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import get_lexer_by_name, guess_lexer
from pygments.util import ClassNotFound

MAX_RENDER_CHARS = 64 * 1024  # an answer of 4096 tokens is about 20 KB of text
MAX_HIGHLIGHT_CHARS = 16 * 1024  # longer code blocks are shown plain: highlighting is the costly part
MAX_GUESS_CHARS = 2 * 1024  # a block without a language is guessed only when short

TAGS = {
    "p", "br", "hr", "h1", "h2", "h3", "h4", "h5", "h6", "blockquote", "ul", "ol", "li", "pre", "code", "span",
    "em", "strong", "del", "s", "a", "table", "thead", "tbody", "tr", "th", "td",
}
ATTRIBUTES = {"a": {"href", "title"}, "code": {"class"}, "span": {"class"}, "ol": {"start"}}
SCHEMES = {"http", "https", "mailto"}

_FORMATTER = HtmlFormatter(nowrap=True)


def _highlight(code: str, language: str, _attrs: str) -> str:
    """A fence's code as Pygments spans; "" leaves it to markdown-it (escaped, unhighlighted)."""
    return _highlighted(code, language)


@lru_cache(maxsize=256)  # while an answer streams, its finished code blocks are rendered again and again
def _highlighted(code: str, language: str) -> str:
    if len(code) > MAX_HIGHLIGHT_CHARS:
        return ""
    try:
        if language:
            lexer = get_lexer_by_name(language.split()[0], stripnl=False)
        elif len(code) <= MAX_GUESS_CHARS:
            lexer = guess_lexer(code, stripnl=False)
        else:
            return ""
    except ClassNotFound:
        return ""
    return highlight(code, lexer, _FORMATTER)


@lru_cache(maxsize=1)
def _parser() -> MarkdownIt:
    parser = MarkdownIt("commonmark", {"html": False, "highlight": _highlight, "breaks": True})
    return parser.enable(["table", "strikethrough"]).disable("image")


def render_markdown(text: str) -> str:
    """`text` (model output, untrusted) as sanitized HTML; at most MAX_RENDER_CHARS are rendered."""
    html = _parser().render(text[:MAX_RENDER_CHARS])
    return nh3.clean(
        html, tags=TAGS, attributes=ATTRIBUTES, url_schemes=SCHEMES, url_relative="deny",
        link_rel="noopener noreferrer", set_tag_attribute_values={"a": {"target": "_blank"}},
    )
