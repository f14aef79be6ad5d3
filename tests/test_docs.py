"""The docs say what the code does: docs/flags.md is the parser's own, every command line in a shell block parses
with the real parser, the README stays short, no heading carries a date, and every relative link lands.

Command lines are read from fenced blocks marked bash, sh, shell, console or nothing: a `\\` continues a line, `#`
starts a comment, a `$ ` prompt and `VAR=value` prefixes are taken off (the variables reach the node's parser as its
environment), `...` stands for "more flags" and is dropped, and `$VAR` becomes the variable's name in lowercase.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import re
import shlex
from pathlib import Path
from typing import Callable
from unittest import mock

import pytest

from meshws import config
from meshws.tools import flags_doc

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_FENCES = {"", "bash", "sh", "shell", "console"}
FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
SEPARATORS = {"&&", "||", ";", "|", "&"}
REDIRECTS = {">", ">>", "<", "2>", "&>"}
DEV_COMMANDS = set(re.findall(r"^\s+([a-z]+)\)", (ROOT / "dev").read_text(), re.M))  # ./dev's `case` arms


def _split(text: str) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """The lines outside fenced blocks, and (info string, lines) of each fenced block."""
    prose: list[str] = []
    blocks: list[tuple[str, list[str]]] = []
    fence = ""
    for line in text.splitlines():
        match = FENCE.match(line)
        if not fence and match:
            fence = match.group(1)
            blocks.append((match.group(2).lower(), []))
        elif fence and line.strip().startswith(fence) and not line.strip().strip(fence[0]):
            fence = ""
        elif fence:
            blocks[-1][1].append(line)
        else:
            prose.append(line)
    return prose, blocks


def command_lines(text: str) -> list[str]:
    """Each logical line of the shell blocks, continuations joined and prompts taken off."""
    found = []
    for info, lines in _split(text)[1]:
        if info not in SHELL_FENCES:
            continue
        pending = ""
        for line in lines:
            line = line.strip()
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            line, pending = (pending + line).strip(), ""
            found.append(line[2:] if line.startswith("$ ") else line)
    return found


def simple_commands(line: str) -> list[tuple[dict[str, str], list[str]]]:
    """(environment, argv) of each command of a shell line; [] for a line shlex cannot read."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, ""
    try:
        tokens = list(lexer)
    except ValueError:
        return []
    if any(token.startswith("#") for token in tokens):
        tokens = tokens[: next(i for i, token in enumerate(tokens) if token.startswith("#"))]
    commands, current = [], []
    for token in tokens + [";"]:
        if token in SEPARATORS:
            commands.append(current)
            current = []
        else:
            current.append(token)
    result = []
    for argv in commands:
        words = []
        for index, token in enumerate(argv):
            if token in REDIRECTS or (index and argv[index - 1] in REDIRECTS):
                continue
            if token != "...":
                words.append(re.sub(r"\$\{?(\w+)\}?", lambda m: m.group(1).lower(), token))
        env = {}
        while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
            name, _, value = words.pop(0).partition("=")
            env[name] = value
        if words:
            result.append((env, words))
    return result


class _Parsed(Exception):
    """Raised from a tool's `parse_args` once it has parsed: nothing of the tool runs."""


def _parse_only(main: Callable[..., object], argv: list[str]) -> None:
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self: argparse.ArgumentParser, args: object = None, namespace: object = None) -> None:
        original(self, args, namespace)
        raise _Parsed

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop):
        try:
            main(argv)
        except _Parsed:
            return
    raise AssertionError(f"{main.__module__}.main did not parse its arguments")


def _node(argv: list[str], env: dict[str, str]) -> None:
    """The node's parser and its checks of the settings together; files named by flags need not exist."""

    def stand_in(settings: config.NodeSettings) -> None:
        if settings.secret_file:
            settings.secret = "s" * config.MIN_SECRET_BYTES
        if settings.api_key_file:
            settings.api_key = "key"

    with mock.patch.object(config, "read_secret_files", stand_in):
        config.parse_settings(argv, environ=env)


def _tool(module: str) -> Callable[[list[str], dict[str, str]], None]:
    def parse(argv: list[str], env: dict[str, str]) -> None:
        _parse_only(importlib.import_module(module).main, argv)

    return parse


def _cli(argv: list[str], env: dict[str, str]) -> None:
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command in ("--version", "-V", "-h", "--help"):
        return
    parsers = {"node": _node, "mesh": _tool("meshws.tools.local_mesh"), "bench": _tool("meshws.tools.bench")}
    if command not in parsers:
        raise ValueError(f"meshws has no command {command!r}")
    parsers[command](rest, env)


def _dev(argv: list[str], env: dict[str, str]) -> None:
    command = argv[0] if argv else ""
    if command not in DEV_COMMANDS:
        raise ValueError(f"./dev has no command {command!r} (it has {', '.join(sorted(DEV_COMMANDS))})")
    if command in ("mesh", "bench"):
        _cli(argv, env)


def _module(argv: list[str], env: dict[str, str]) -> None:
    module, rest = argv[0], argv[1:]
    if module == "meshws":
        _cli(rest, env)
    elif module == "meshws.node":
        _node(rest, env)
    elif module == "meshws.bench":
        _tool("meshws.tools.bench")(rest, env)
    elif importlib.util.find_spec(module) is None:
        raise ValueError(f"there is no module {module}")
    elif hasattr(importlib.import_module(module), "main"):
        _tool(module)(rest, env)


def command_problem(env: dict[str, str], argv: list[str]) -> str | None:
    """What the real parser says of one meshws command (None when it parses, or when it is not meshws's)."""
    if argv[0] in ("python", "python3") and argv[1:2] == ["-m"] and argv[2:3] and argv[2].split(".")[0] == "meshws":
        parse, rest = _module, argv[2:]
    elif argv[0] == "meshws":
        parse, rest = _cli, argv[1:]
    elif argv[0] == "./dev":
        parse, rest = _dev, argv[1:]
    else:
        return None
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            parse(rest, env)
    except SystemExit as exc:
        if exc.code not in (0, None):
            return errors.getvalue().strip().splitlines()[-1] if errors.getvalue().strip() else f"exit {exc.code}"
    except ValueError as exc:
        return str(exc)
    return None


def command_problems(text: str) -> list[str]:
    problems = []
    for line in command_lines(text):
        for env, argv in simple_commands(line):
            problem = command_problem(env, argv)
            if problem:
                problems.append(f"{line}\n    -> {problem}")
    return problems


def headings(text: str) -> list[str]:
    return [line.lstrip("#").strip() for line in _split(text)[0] if re.match(r"^#{1,6}\s", line)]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def link_problems(page: Path) -> list[str]:
    problems = []
    for line in _split(page.read_text())[0]:
        for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue  # http:, https:, mailto:
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                problems.append(f"{page.name}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in {slug(h) for h in headings(file.read_text())}:
                problems.append(f"{page.name}: {target} (no such heading)")
    return problems


# -- the docs ---------------------------------------------------------------------


def test_flags_page_is_what_the_parser_says():
    assert (ROOT / "docs" / "flags.md").read_text() == flags_doc.render(), \
        "docs/flags.md is out of date: python -m meshws.tools.flags_doc > docs/flags.md"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_every_command_line_parses_with_the_real_parser(page):
    assert command_problems(page.read_text()) == []


def test_the_readme_reads_in_ten_minutes():
    assert len((ROOT / "README.md").read_text().splitlines()) < 400


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_no_heading_is_dated_and_every_relative_link_lands(page):
    assert [h for h in headings(page.read_text()) if re.search(r"20\d\d-\d\d-\d\d", h)] == []
    assert link_problems(page) == []


def test_the_readme_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    pages = ["CHANGELOG.md", *(f"docs/{page.name}" for page in PAGES if page.parent.name == "docs")]
    assert [page for page in pages if f"]({page})" not in readme] == []


# -- the checks themselves ------------------------------------------------------------


@pytest.mark.parametrize("line, needle", [
    ("python -m meshws.node --role full --prot 8700", "--prot"),
    ("meshws node --role tail --layers 19-29 --host 0.0.0.0", "refusing to listen"),
    ("MESHWS_ROLE=middle python -m meshws.node --layers 10-19", "needs --peer"),
    ("./dev mesh --modle x", "--modle"),
    ("./dev serve", "no command 'serve'"),
    ("python -m meshws.bench --sesions 1 16", "--sesions"),
    ("meshws bench --dtype float64", "float64"),
    ("python -m meshws.tools.synth_gguf --preset 2b --out x.gguf", "2b"),
    ("python -m meshws.tools.nothing_here", "no module"),
])
def test_the_command_check_catches_a_wrong_command(line, needle):
    problems = command_problems(f"```bash\n{line}\n```\n")
    assert len(problems) == 1 and needle in problems[0]


def test_the_command_check_reads_lines_as_a_shell_does():
    text = ("```bash\n$ MESHWS_API_KEY_FILE=api.key python -m meshws.node --role head --layers 0-14 \\\n"
            "    --host 0.0.0.0 --secret-file mesh.secret ...   # the head\n"
            "python -m meshws.tools.flags_doc > docs/flags.md && ./dev test -q\n```\n"
            "```text\nmeshws local mesh ready: not a command\n```\n")
    assert command_lines(text)[0].startswith("MESHWS_API_KEY_FILE=api.key python -m meshws.node")
    assert command_problems(text) == []
    assert simple_commands("a=1 meshws node --port $PORT # note") == \
        [({"a": "1"}, ["meshws", "node", "--port", "port"])]


def test_the_link_and_date_checks_catch_drift(tmp_path):
    (tmp_path / "here.md").write_text("# Title\n## Speed (2026-12-01)\n")
    page = tmp_path / "page.md"
    page.write_text("[a](here.md#title) [b](here.md#speed) [c](gone.md) [d](https://x.org/y) `[e](nowhere.md)`\n")
    assert link_problems(page) == ["page.md: here.md#speed (no such heading)", "page.md: gone.md (no such file)"]
    assert headings((tmp_path / "here.md").read_text()) == ["Title", "Speed (2026-12-01)"]


def test_the_code_map_names_every_module():
    code_map = (ROOT / "docs" / "architecture.md").read_text()
    modules = [path for path in (ROOT / "meshws").rglob("*") if path.suffix in (".py", ".c")
               and path.name not in ("__init__.py", "__main__.py")]
    assert [path.relative_to(ROOT).as_posix() for path in modules
            if not re.search(rf"(?<![\w.]){re.escape(path.name)}", code_map)] == []
