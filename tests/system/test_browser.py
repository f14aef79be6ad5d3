"""The chat page in real headless Chromium against a real head + tail on the embedded model."""

import re
import time
from pathlib import Path

import pytest
from playwright.sync_api import expect

from helpers import ROOT
from meshws.tools.launch import Mesh, NodeProcess

pytestmark = [pytest.mark.real_model, pytest.mark.processes, pytest.mark.browser]

CHROMIUM = "/usr/bin/chromium"
SHOTS = ROOT / "artifacts" / "screenshots"
XSS = "<img src=x onerror=alert(1)>"


@pytest.fixture(scope="module")
def mesh(embedded_model):
    mesh = Mesh([("head", "0-14"), ("tail", "15-29")], common=("--dtype", "float32", "--wire-dtype", "float32"))
    yield mesh
    mesh.stop()


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail("Chromium is missing: apt-get install -y chromium (.ci/run does this)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--no-first-run", "--disable-sync"],
        )
        yield browser
        browser.close()


@pytest.fixture
def page(browser, mesh):
    context = browser.new_context(viewport={"width": 1280, "height": 820})
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=mesh.head.url)
    page = context.new_page()
    page.foreign = []  # requests to any host but the head
    own = (mesh.head.url, mesh.head.url.replace("http", "ws"))
    page.on("request", lambda request: None if request.url.startswith(own) else page.foreign.append(request.url))
    page.dialogs = []
    page.on("dialog", lambda dialog: (page.dialogs.append(dialog.message), dialog.dismiss()))
    page.sent = []
    page.on("websocket", lambda ws: ws.on("framesent", lambda payload: page.sent.append(payload)))
    page.goto(mesh.head.url + "/")
    page.wait_for_selector("#conn[data-state=open]")
    set_temperature(page, 0)
    yield page
    context.close()


def set_setting(page, selector, value):
    """Set a settings field as a person would (it may sit in the closed side panel on a phone)."""
    page.eval_on_selector(selector, "(el, v) => { el.value = v; el.dispatchEvent(new Event('input')); }", value)


def set_temperature(page, value):
    set_setting(page, "#temperature", value)


def ask(page, text, max_tokens=48):
    """Type a message and press Enter; returns the answer's element."""
    set_setting(page, "#max-tokens", max_tokens)
    index = page.locator(".msg.assistant").count()
    page.fill("#input", text)
    page.press("#input", "Enter")
    return page.locator(".msg.assistant").nth(index)


def wait_answer(answer, timeout=90_000):
    answer.locator(".meta").wait_for(timeout=timeout)
    return answer


def test_message_streams_an_answer_with_timing_and_route(page, mesh):
    answer = ask(page, "Explain in detail how a bicycle works.", max_tokens=60)
    seen = set()
    deadline = time.monotonic() + 90
    while "streaming" in (answer.get_attribute("class") or "") and time.monotonic() < deadline:
        seen.add(len(answer.locator(".text").text_content()))
        time.sleep(0.05)
    wait_answer(answer)
    text = answer.locator(".text").text_content()
    assert len(text) > 30
    assert len({n for n in seen if 0 < n < len(text)}) >= 2, "the answer should appear piece by piece"
    meta = answer.locator(".meta").text_content()
    assert "tok/s" in meta and "first token" in meta
    assert "[0-14]" in meta and "[15-29]" in meta  # the route: which node served which layers
    # Where each lap's time went: the head, the tail (as it reported), the link; one piece of the bar each.
    laps = answer.locator(".lap-meta").text_content()
    pattern = (r"per lap \(\d+ laps( · [\d.]+ tokens/lap)?\): "
               r"head [\d.]+ ms · link to tail [\d.]+ ms · tail [\d.]+ ms")
    assert re.fullmatch(pattern, laps), laps
    expect(answer.locator(".lap-bar .lap-part")).to_have_count(3)
    # The parts add up to the time the page itself measured for the answer (send to done), within 10 %.
    parts = sum(float(ms) for ms in answer.locator(".lap-part").evaluate_all("(parts) => parts.map(p => p.dataset.ms)"))
    elapsed = float(answer.get_attribute("data-elapsed-ms"))
    assert 0.9 * elapsed <= parts <= elapsed, (parts, elapsed)
    expect(page.locator("#mesh-nodes li")).to_have_count(2)
    assert "layers 15-29" in page.locator("#mesh-nodes").text_content()
    # The route diagram: every node of the route, with the link between them timed by the last answer.
    nodes = page.locator("#route .route-node")
    expect(nodes).to_have_count(2)
    assert nodes.nth(0).text_content().startswith("head@") and nodes.nth(1).text_content().startswith("tail@")
    assert "layers 15-29" in nodes.nth(1).text_content()
    expect(page.locator("#route .route-link")).to_have_text(re.compile(r"^[\d.]+ ms$"), timeout=10_000)
    # its load and busy share as the tail reported them with the answer; the head's busy share its own
    expect(nodes.nth(1)).to_contain_text(re.compile(r"load \d+ · busy \d+ %$"))
    expect(nodes.nth(0)).to_contain_text(re.compile(r"busy \d+ %"))
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / "desktop.png"), full_page=True)


def test_second_turn_sends_the_conversation_and_new_chat_clears_it(page):
    page.fill("#input", "line one")
    page.press("#input", "Shift+Enter")
    page.type("#input", "line two")
    assert page.input_value("#input") == "line one\nline two"
    assert page.locator(".msg").count() == 0  # Shift+Enter did not send
    page.fill("#input", "")
    wait_answer(ask(page, "My favourite colour is green. Say hello.", max_tokens=12))
    second = wait_answer(ask(page, "What is my favourite colour?", max_tokens=12))
    assert page.locator(".msg.user").count() == 2 and page.locator(".msg.assistant").count() == 2
    # the socket's session kept the first turn: the second prefilled only what is new
    assert re.search(r"\d+ of \d+ prompt tokens cached", second.locator(".meta").text_content())
    import json

    chats = [json.loads(frame) for frame in page.sent if '"chat"' in frame]
    assert [m["role"] for m in chats[-1]["messages"]] == ["user", "assistant", "user"]
    assert chats[-1]["messages"][1]["content"] == stored_chats(page)[0]["messages"][1]["content"]
    page.click("#new-chat")
    assert page.locator(".msg").count() == 0
    assert any('"reset"' in frame for frame in page.sent)
    first = wait_answer(ask(page, "Hi", max_tokens=4))
    assert "cached" not in first.locator(".meta").text_content()
    chats = [json.loads(frame) for frame in page.sent if '"chat"' in frame]
    assert [m["role"] for m in chats[-1]["messages"]] == ["user"]
    set_setting(page, "#system", "Answer in one word.")
    wait_answer(ask(page, "Hi again", max_tokens=4))
    chats = [json.loads(frame) for frame in page.sent if '"chat"' in frame]
    assert chats[-1]["messages"][0] == {"role": "system", "content": "Answer in one word."}
    set_setting(page, "#system", "")


def test_escape_stops_the_answer_and_new_chat_releases_the_session(page, mesh):
    answer = ask(page, "Write a very long story about a dragon who learns to fly.", max_tokens=500)
    expect(page.locator(".msg.assistant .text").first).to_have_text(re.compile(r"[\s\S]{21,}"), timeout=90_000)
    assert mesh.tail.health()["sessions"] == 1
    assert page.get_attribute("#log", "aria-busy") == "true"  # screen readers wait for the whole answer
    page.keyboard.press("Escape")
    wait_answer(answer)
    assert answer.locator(".meta").text_content().startswith("stopped")
    page.click("#new-chat")  # stopped, the conversation may stay warm; a new chat releases it everywhere
    assert mesh.tail.wait_sessions(0)["sessions"] == 0 and mesh.head.wait_sessions(0)["sessions"] == 0
    assert page.is_visible("#send") and not page.is_visible("#stop")
    assert page.get_attribute("#log", "aria-busy") == "false"


def test_markup_in_messages_and_model_output_is_shown_as_text(page):
    answer = wait_answer(ask(page, "Repeat exactly: " + XSS, max_tokens=40))
    assert XSS in page.locator(".msg.user").last.text_content()
    assert XSS in answer.locator(".text").text_content()  # the model repeated it; shown as characters
    page.wait_for_timeout(300)
    assert page.locator(".log img").count() == 0
    assert page.dialogs == []


def test_phone_sized_window(browser, mesh):
    context = browser.new_context(viewport={"width": 390, "height": 780}, is_mobile=True, has_touch=True)
    page = context.new_page()
    try:
        page.goto(mesh.head.url + "/")
        page.wait_for_selector("#conn[data-state=open]")
        set_temperature(page, 0)
        assert not page.is_visible("#side")
        wait_answer(ask(page, "Name three fruits.", max_tokens=24))
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= 390, "nothing should overflow sideways on a phone"
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / "phone.png"), full_page=True)
        assert page.is_visible(".msg.assistant [data-action=copy-answer]")  # the answer's actions, and editing
        assert page.is_visible(".msg.user [data-action=edit]")
        page.click("#toggle-side")
        assert page.is_visible("#side") and page.is_visible("#temperature") and page.is_visible("#route")
        page.screenshot(path=str(SHOTS / "phone-settings.png"))
        page.click("#toggle-side")
        page.click("#toggle-chats")  # the conversations, one tap away
        assert page.is_visible("#chat-list .chat-title") and not page.is_visible("#side")
        assert page.locator("#chat-list .chat-title").text_content() == "Name three fruits."
        page.screenshot(path=str(SHOTS / "phone-chats.png"))
    finally:
        context.close()


def test_killing_the_tail_shows_an_error_and_the_page_recovers(page, mesh):
    ask(page, "Write a very long story about a castle.", max_tokens=400)
    expect(page.locator(".msg.assistant .text").first).to_have_text(re.compile(r"[\s\S]{11,}"), timeout=90_000)
    tail_port = mesh.tail.port
    mesh.tail.kill()
    page.wait_for_selector(".msg.error", timeout=30_000)
    assert "pipeline error" in page.locator(".msg.error").last.text_content()
    expect(page.locator("#mesh-status")).to_have_text(re.compile("^Not ready"), timeout=10_000)
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / "tail-killed.png"), full_page=True)
    # A message while the tail is down gets a clear error too.
    ask(page, "Are you there?", max_tokens=4)
    expect(page.locator(".msg.error").nth(1)).to_be_attached(timeout=10_000)
    assert "no route" in page.locator(".msg.error").last.text_content()
    expect(page.locator(".msg.error").last.locator("[data-action=retry]")).to_be_visible()
    # A new tail on the same port: the head re-dials, and the same page chats again without a reload.
    tail = NodeProcess("--role", "tail", "--layers", "15-29", "--dtype", "float32", "--wire-dtype", "float32",
                       name="tail again", port=tail_port).wait_started()
    mesh.nodes[-1] = tail
    mesh.head.wait_ready()
    # Retry (in place, on the error) asks the unanswered question again.
    page.locator(".msg.error").last.locator("[data-action=retry]").click()
    expect(page.locator(".msg.error")).to_have_count(0)
    answer = wait_answer(page.locator(".msg.assistant").last)
    assert answer.locator(".text").text_content()
    assert page.locator(".msg.user").last.text_content().startswith("Are you there?")


def test_the_page_reconnects_when_the_head_restarts(page, mesh):
    head_port = mesh.head.port
    peer = f"ws://127.0.0.1:{mesh.tail.port}"
    mesh.head.stop()
    page.wait_for_selector("#conn[data-state=closed]", timeout=10_000)
    head = NodeProcess("--role", "head", "--layers", "0-14", "--peer", peer, "--dtype", "float32",
                       "--wire-dtype", "float32", name="head again", port=head_port).wait_started()
    mesh.nodes[0] = head
    head.wait_ready()
    page.wait_for_selector("#conn[data-state=open]", timeout=30_000)
    assert wait_answer(ask(page, "Say hello.", max_tokens=6)).locator(".text").text_content()


def stored_chats(page):
    """The conversations as the page keeps them in localStorage."""
    return page.evaluate("JSON.parse(localStorage.getItem('meshws.chats') || '[]')")


def sent_chats(page):
    import json

    return [json.loads(frame) for frame in page.sent if '"type":"chat"' in frame.replace(" ", "")]


def test_a_code_answer_is_highlighted_and_both_copy_buttons_work(page):
    # Greedy fp32, the embedded model answers this with a ```python block first, then a paragraph.
    answer = ask(page, "Write a Python function that adds two numbers.", max_tokens=60)
    # Rendered while it streams, without flicker: once text follows the closed block, the block's element stays.
    block = None
    while block is None and "streaming" in (answer.get_attribute("class") or ""):
        if answer.locator(".md .code + p").count():
            block = answer.locator(".md .code").element_handle()
        time.sleep(0.03)
    assert block is not None, "the code block and the text after it should show before the answer ends"
    wait_answer(answer)
    assert block.evaluate("(node) => node.isConnected")  # the same element: never replaced by a later render
    code = answer.locator(".md .code pre > code.language-python")
    expect(code).to_have_count(1)
    assert code.locator("span.k").first.text_content() == "def"  # Pygments' keyword class: highlighted
    assert answer.locator(".code-lang").text_content() == "python"
    assert page.evaluate("getComputedStyle(document.querySelector('.md pre .k')).color") != \
        page.evaluate("getComputedStyle(document.querySelector('.md pre .n')).color")
    answer.locator("[data-action=copy-code]").click()
    expect(answer.locator("[data-action=copy-code]")).to_have_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == code.text_content()
    assert code.text_content().startswith("def ") and "return" in code.text_content()
    answer.locator("[data-action=copy-answer]").click()
    markdown = page.evaluate("navigator.clipboard.readText()")
    assert markdown == stored_chats(page)[0]["messages"][1]["content"] and markdown.startswith("```python\ndef ")
    assert page.foreign == []  # the page, its styles and the rendered answer came from the head alone
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / "desktop-code.png"), full_page=True)


def test_a_table_answer_renders_as_a_table(page):
    answer = wait_answer(ask(page, "Make a Markdown table of three fruits and their colours.", max_tokens=40))
    table = answer.locator(".md table")
    expect(table).to_have_count(1)
    assert [th.strip() for th in table.locator("th").all_text_contents()] == ["Fruit", "Colour"]
    assert table.locator("tbody tr").count() >= 2


# Model output an attacker might steer a model to write: each must stay inert on the page.
PAYLOADS = "\n\n".join([
    "<script>alert('script')</script>",
    "<img src=x onerror=alert('img')>",
    "<svg onload=alert('svg')></svg> <iframe src=\"javascript:alert('iframe')\"></iframe>",
    "[plain](javascript:alert('link')) [cased](JaVaScRiPt:alert('cased')) [spaced](java\tscript:alert('tab'))",
    "[data](data:text/html;base64,PHNjcmlwdD5hbGVydCgxKTwvc2NyaXB0Pg==) <javascript:alert('autolink')>",
    "[ref][evil]\n\n[evil]: javascript:alert('ref')",
    "![remote](http://198.51.100.7/pixel.png) ![proto](//198.51.100.7/p.png)",
    "<a href=\"http://198.51.100.7/\" onclick=\"alert('raw')\">raw link</a> <style>body{display:none}</style>",
    "[fine](https://example.com/docs) and `<b>code</b>`",
])


def test_hostile_markdown_in_answers_is_inert(browser, mesh):
    """A stored conversation holding attack payloads as an answer, rendered by the head after a reload."""
    context = browser.new_context(viewport={"width": 1280, "height": 820})
    page = context.new_page()
    dialogs, foreign = [], []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    page.on("request", lambda request: None if "127.0.0.1" in request.url else foreign.append(request.url))
    try:
        page.goto(mesh.head.url + "/")
        chat = {"id": "x", "title": "payloads", "updated": 2,
                "messages": [{"role": "user", "content": PAYLOADS}, {"role": "assistant", "content": PAYLOADS}]}
        broken = {"id": "y", "title": 7, "messages": [None, {"role": "assistant", "content": "kept", "hops":
                  {"laps": 1, "hops": 5}}, {"role": "robot", "content": "dropped"}, {"role": "user", "content": 3}]}
        page.evaluate("(chats) => { localStorage.setItem('meshws.chats', JSON.stringify(chats));"
                      " localStorage.setItem('meshws.open', 'x'); }", [chat, broken])
        page.reload()
        page.wait_for_selector(".msg.assistant .md a[href^='https']")  # rendered by the head
        answer = page.locator(".msg.assistant .md")
        for tag in ("script", "img", "svg", "iframe", "style", "object", "embed"):
            assert page.locator(f".log {tag}").count() == 0, tag
        assert "<script>alert('script')</script>" in answer.text_content()  # shown as the characters it is
        hrefs = answer.locator("a[href]").evaluate_all("(links) => links.map(a => [a.href, a.rel, a.target])")
        assert ["https://example.com/docs", "noopener noreferrer", "_blank"] in hrefs
        # (an image's syntax is left a plain link: nothing is fetched unless the reader follows it)
        assert all(href.startswith(("https://", "http://")) and rel == "noopener noreferrer" for href, rel, _ in hrefs)
        assert answer.locator("a", has_text="raw link").count() == 0  # raw HTML stays text
        assert answer.locator("[onclick], [onerror], [onload]").count() == 0
        for link in answer.locator("a").all():  # the ones without href lead nowhere
            if link.get_attribute("href") is None:
                link.click()
        assert page.locator(".msg.user .text").text_content() == PAYLOADS  # questions are text
        page.wait_for_timeout(300)
        assert dialogs == [] and foreign == []
        assert page.evaluate("document.body.style.display") != "none" and page.is_visible("#input")
        # Storage holding shapes the page never wrote (edited by hand, an old version) does not break it.
        page.locator("#chat-list .chat-title", has_text="New chat").click()
        expect(page.locator(".msg")).to_have_count(1)
        expect(page.locator(".msg.assistant .text")).to_have_text("kept")
        assert page.locator(".lap-bar").count() == 0
    finally:
        context.close()


def test_conversations_last_and_can_be_switched_renamed_and_deleted(page):
    wait_answer(ask(page, "Say hi.", max_tokens=4))
    page.click("#new-chat")
    wait_answer(ask(page, "Name a colour.", max_tokens=4))
    expect(page.locator("#chat-list .chat-item")).to_have_count(2)
    second_answer = page.locator(".msg.assistant .text").text_content()
    page.reload()
    page.wait_for_selector("#conn[data-state=open]")
    titles = page.locator("#chat-list .chat-title").all_text_contents()
    assert titles == ["Name a colour.", "Say hi."]  # newest first; the open one restored
    assert page.locator(".msg.user .text").all_text_contents() == ["Name a colour."]
    expect(page.locator(".msg.assistant .text")).to_have_text(second_answer)
    page.locator("#chat-list .chat-title", has_text="Say hi.").click()
    assert page.locator(".msg.user .text").all_text_contents() == ["Say hi."]
    assert any('"reset"' in frame for frame in page.sent)  # the other conversation's session is released
    item = page.locator("#chat-list .chat-item.open")
    item.locator("[data-action=rename-chat]").click()
    page.fill("#chat-list .chat-rename", "Greetings")
    page.press("#chat-list .chat-rename", "Enter")
    expect(page.locator("#chat-list .chat-item.open .chat-title")).to_have_text("Greetings")
    page.locator("#chat-list .chat-item", has_text="Name a colour.").locator("[data-action=delete-chat]").click()
    expect(page.locator("#chat-list .chat-item")).to_have_count(1)
    page.reload()
    assert [chat["title"] for chat in stored_chats(page)] == ["Greetings"]
    assert page.locator(".msg.user .text").all_text_contents() == ["Say hi."]


def test_regenerate_replaces_the_last_answer_and_an_edit_drops_later_turns(page):
    wait_answer(ask(page, "My name is Ada. Say hello.", max_tokens=8))
    wait_answer(ask(page, "What is my name?", max_tokens=8))
    page.locator(".msg.assistant.last [data-action=regenerate]").click()
    expect(page.locator(".msg.assistant.streaming")).to_have_count(0, timeout=90_000)
    wait_answer(page.locator(".msg.assistant").last)
    assert page.locator(".msg.assistant").count() == 2 and page.locator(".msg.user").count() == 2
    assert [m["role"] for m in sent_chats(page)[-1]["messages"]] == ["user", "assistant", "user"]
    assert [m["role"] for m in stored_chats(page)[0]["messages"]] == ["user", "assistant", "user", "assistant"]
    # ↑ in the empty box edits the last question; here the first one is edited with its button.
    page.press("#input", "ArrowUp")
    expect(page.locator(".msg.user").last.locator(".edit-field")).to_be_focused()
    page.keyboard.press("Escape")
    expect(page.locator(".edit-field")).to_have_count(0)
    page.locator(".msg.user").first.locator("[data-action=edit]").click()
    page.fill(".edit-field", "My name is Grace. Say hello.")
    page.locator("[data-action=save-edit]").click()
    wait_answer(page.locator(".msg.assistant").last)
    assert page.locator(".msg.user .text").all_text_contents() == ["My name is Grace. Say hello."]
    assert page.locator(".msg.assistant").count() == 1
    assert sent_chats(page)[-1]["messages"] == [{"role": "user", "content": "My name is Grace. Say hello."}]
    assert len(stored_chats(page)[0]["messages"]) == 2


def test_dark_mode_follows_the_system(browser, mesh):
    context = browser.new_context(viewport={"width": 1280, "height": 820}, color_scheme="dark")
    page = context.new_page()
    try:
        page.goto(mesh.head.url + "/")
        page.wait_for_selector("#conn[data-state=open]")
        set_temperature(page, 0)
        wait_answer(ask(page, "Write a Python function that adds two numbers.", max_tokens=40))
        background = page.evaluate("getComputedStyle(document.body).backgroundColor")
        assert background == "rgb(21, 24, 30)", background
        assert page.evaluate("getComputedStyle(document.querySelector('.md pre')).backgroundColor") == "rgb(13, 17, 23)"
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / "dark.png"), full_page=True)
    finally:
        context.close()


def test_the_route_picture_shows_the_plan_with_each_nodes_measured_time(browser):
    """A head that places layers: the picture is its plan in force, each node with its span and times."""
    from meshws.tools.launch import free_port
    from meshws.tools.machines import wait_for_plan

    port = free_port()
    common = ("--layers", "auto", "--memory", "80M", "--dtype", "float32")  # no node holds the whole model
    head = NodeProcess("--role", "head", *common, name="head", port=port)
    nodes = [NodeProcess("--role", "auto", *common, "--join", f"http://127.0.0.1:{port}", name=f"auto {n}")
             for n in range(2)]
    context = None
    try:
        for node in (head, *nodes):
            node.wait_started()
        plan = wait_for_plan(head, lambda plan: len(plan["spans"]) == 3, 90)
        context = browser.new_context(viewport={"width": 1280, "height": 820})
        page = context.new_page()
        page.goto(head.url + "/")
        expect(page.locator("#route .route-plan").first).to_have_text(
            re.compile(rf"^plan {plan['version']} · [\d.]+ ms per token predicted$"), timeout=15_000)
        boxes = page.locator("#route .route-node")
        expect(boxes).to_have_count(3)
        for index, span in enumerate(plan["spans"]):
            expect(boxes.nth(index)).to_contain_text(f"layers {span['layers'][0]}-{span['layers'][1] - 1}")
            expect(boxes.nth(index)).to_contain_text(re.compile(r"[\d.]+ ms per token \([\d.]+ ms a layer, measured\)"))
            expect(boxes.nth(index)).to_contain_text(re.compile(r"busy \d+ %"))  # (heartbeats; the head: its own)
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / "plan.png"), full_page=True)
    finally:
        if context is not None:
            context.close()
        for node in (*nodes, head):
            node.stop()
