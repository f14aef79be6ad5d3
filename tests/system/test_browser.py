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
    page = context.new_page()
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
    assert re.fullmatch(r"per lap \(\d+ laps\): head [\d.]+ ms · tail [\d.]+ ms · links [\d.]+ ms", laps), laps
    expect(answer.locator(".lap-bar .lap-part")).to_have_count(3)
    expect(page.locator("#mesh-nodes li")).to_have_count(2)
    assert "layers 15-29" in page.locator("#mesh-nodes").text_content()
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
    assert chats[-1]["messages"][1]["content"] == page.locator(".msg.assistant .text").first.text_content()
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


def test_stop_button_stops_the_answer_and_releases_the_session(page, mesh):
    answer = ask(page, "Write a very long story about a dragon who learns to fly.", max_tokens=500)
    expect(page.locator(".msg.assistant .text").first).to_have_text(re.compile(r"[\s\S]{21,}"), timeout=90_000)
    assert mesh.tail.health()["sessions"] == 1
    page.click("#stop")
    wait_answer(answer)
    assert answer.locator(".meta").text_content().startswith("stopped")
    page.click("#new-chat")  # stopped, the conversation may stay warm; a new chat releases it everywhere
    assert mesh.tail.wait_sessions(0)["sessions"] == 0 and mesh.head.wait_sessions(0)["sessions"] == 0
    assert page.is_visible("#send") and not page.is_visible("#stop")


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
        page.click("#toggle-side")
        assert page.is_visible("#side") and page.is_visible("#temperature")
        page.screenshot(path=str(SHOTS / "phone-settings.png"))
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
    # A new tail on the same port: the head re-dials, and the same page chats again without a reload.
    tail = NodeProcess("--role", "tail", "--layers", "15-29", "--dtype", "float32", "--wire-dtype", "float32",
                       name="tail again", port=tail_port).wait_started()
    mesh.nodes[-1] = tail
    mesh.head.wait_ready()
    answer = wait_answer(ask(page, "Say hello.", max_tokens=6))
    assert answer.locator(".text").text_content()


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
