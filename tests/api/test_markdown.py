"""Answers rendered for the page (api/markdown.py), and the `render` message of /ws/chat on fake shards."""

import asyncio
from html.parser import HTMLParser

import aiohttp
import pytest

from fakes import CachedHeadBackend, LoopTailBackend, fake_mesh
from meshws.api.guards import SECURITY_HEADERS
from meshws.api.markdown import MAX_RENDER_CHARS, Renderer, RenderBusy, render_markdown

HOSTILE = [
    "<script>alert(1)</script>",
    "<img src=x onerror=alert(1)>",
    "<svg/onload=alert(1)>",
    "<iframe src=javascript:alert(1)></iframe>",
    "[a](javascript:alert(1))",
    "[a](JAVASCRIPT:alert(1))",
    "[a](java&#x09;script:alert(1))",
    "[a](data:text/html,<script>alert(1)</script>)",
    "[a](vbscript:msgbox(1))",
    "<javascript:alert(1)>",
    "[r][x]\n\n[x]: javascript:alert(1)",
    "![i](http://198.51.100.7/p.png)",
    '<a href="https://evil.example" onclick="alert(1)">x</a>',
    "<style>*{display:none}</style>",
    '<div style="background:url(http://198.51.100.7/)">x</div>',
    "```html\n<script>alert(1)</script>\n```",
    "| a |\n|---|\n| <img src=x onerror=alert(1)> |",
]


class Elements(HTMLParser):
    """Every element and attribute of a piece of HTML, as a browser's parser sees them."""

    def __init__(self, html):
        super().__init__()
        self.tags, self.attributes = set(), []
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        self.attributes.extend(attrs)


def test_hostile_markdown_renders_to_nothing_that_runs_or_loads():
    for text in HOSTILE:
        html = render_markdown(text)
        found = Elements(html)
        assert found.tags <= {"p", "a", "pre", "code", "span", "table", "thead", "tbody", "tr", "th", "td"}, html
        for name, value in found.attributes:
            assert name in ("href", "target", "rel", "class"), (text, html)
            if name == "href":
                assert value.startswith(("http://", "https://")), (text, html)


def test_markdown_renders_code_tables_lists_and_safe_links():
    html = render_markdown("Some **bold** and `x<y`.\n\n- one\n- two\n\n```python\ndef f():\n    return 1\n```\n\n"
                           "| a | b |\n|:-|-:|\n| 1 | 2 |\n\n[docs](https://example.com/a?b=1)")
    assert "<strong>bold</strong>" in html and "<code>x&lt;y</code>" in html
    assert "<ul>" in html and "<li>one</li>" in html
    assert '<pre><code class="language-python"><span class="k">def</span>' in html
    assert "<table>" in html and "<th>a</th>" in html and "<td>2</td>" in html
    assert '<a href="https://example.com/a?b=1" target="_blank" rel="noopener noreferrer">docs</a>' in html


def test_lexing_past_the_render_budget_leaves_the_rest_plain(monkeypatch):
    from meshws.api import markdown

    fences = "".join(f"```python\nx{i} = {i}\n" + "y = 1\n" * 400 + "```\n\n" for i in range(2))
    assert render_markdown(fences).count('<span class="n">x') == 2  # within the budget: both highlighted
    monkeypatch.setattr(markdown, "HIGHLIGHT_BUDGET", 0.0)
    markdown._highlighted.cache_clear()
    plain = render_markdown(fences)
    assert '<span class="n">x' not in plain and "x0 = 0" in plain and "x1 = 1" in plain


def test_a_fence_without_language_or_an_unknown_one_stays_code():
    plain = render_markdown("```\nimport os\nprint(os.name)\n```")
    assert plain == "<pre><code>import os\nprint(os.name)\n</code></pre>\n"
    for language in ("nosuchlanguage", "amdgpu", "autohotkey"):  # (not on the list: some lexers are slow)
        html = render_markdown(f"```{language}\na < b\n```")
        assert "a &lt; b" in html and "<span" not in html


def test_a_lexer_that_is_slow_on_crafted_code_is_cut_off_and_the_code_stays_plain():
    # Pygments' C lexer takes seconds on thousands of blank lines (quadratic); the render's lexing budget
    # stops it, the block is shown unhighlighted, and an ordinary block in the same answer still renders.
    html = render_markdown("```c\n" + "\n" * 8000 + "x\n```\n\nthen `ok`\n")
    assert "<pre><code class=\"language-c\">" in html and "<span" not in html and "<code>ok</code>" in html
    assert '<span class="kt">int</span>' in render_markdown("```c\nint x;\n```")  # (C on its own is fine)


async def test_renders_wait_in_a_bounded_line_on_their_own_thread():
    renderer = Renderer(waiting=1)
    try:
        first = asyncio.ensure_future(renderer.render("*a*"))
        await asyncio.sleep(0)
        with pytest.raises(RenderBusy):
            await renderer.render("*b*")
        assert await first == "<p><em>a</em></p>\n"
        assert await renderer.render("*c*") == "<p><em>c</em></p>\n"  # the line is free again
    finally:
        renderer.close()


def test_rendering_is_bounded():
    html = render_markdown("x" * (MAX_RENDER_CHARS + 1000))
    assert html.count("x") == MAX_RENDER_CHARS


async def test_render_over_the_chat_socket_and_bad_render_messages():
    async with fake_mesh(CachedHeadBackend(), LoopTailBackend()) as mesh:
        url = f"http://127.0.0.1:{mesh.head_port}"
        async with aiohttp.ClientSession() as client:
            async with client.get(url + "/") as page:
                assert page.headers["Content-Security-Policy"] == SECURITY_HEADERS["Content-Security-Policy"]
            async with client.ws_connect(url + "/ws/chat") as ws:
                await ws.send_json({"type": "render", "id": "r1", "text": "*hi* <script>x</script>"})
                assert await ws.receive_json() == {"type": "rendered", "id": "r1",
                                                   "html": "<p><em>hi</em> &lt;script&gt;x&lt;/script&gt;</p>\n"}
                for bad, words in (({"type": "render", "id": 3}, "needs 'text'"),
                                   ({"type": "render", "text": ["x"]}, "needs 'text'"),
                                   ({"type": "render", "text": "x" * (MAX_RENDER_CHARS + 1)}, "at most")):
                    await ws.send_json(bad)
                    reply = await ws.receive_json()
                    assert reply["type"] == "error" and words in reply["message"], reply
                await ws.send_json({"type": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
                kinds = []
                while not kinds or kinds[-1] not in ("done", "error"):
                    kinds.append((await ws.receive_json())["type"])
                assert kinds[-1] == "done"  # the socket still chats
