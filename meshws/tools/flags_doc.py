"""`python -m meshws.tools.flags_doc`: docs/flags.md, a node's flags and environment variables, from the code.

    python -m meshws.tools.flags_doc > docs/flags.md    # write the page again
    python -m meshws.tools.flags_doc --check            # exit 1 if docs/flags.md is not what the code says

The flags come from `meshws.config.build_parser`, the parser `python -m meshws.node` and `meshws node`
run, in its groups and order: each with its values, default, MESHWS_* variable and help. The other
variables are the ones the package's source reads (`variables_read` finds them); each needs a line in
`OTHER_VARIABLES`, or the page is not made, so a new variable cannot go undocumented.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path

from .. import config

PACKAGE = Path(__file__).resolve().parents[1]
PAGE = Path("docs/flags.md")
# The variables the code reads besides the flags' own MESHWS_* ones, and what each does.
OTHER_VARIABLES = {
    "MESHWS_CACHE_DIR": "The model cache (as `--cache-dir`), and also where meshws's kernels are built "
                        "(`$MESHWS_CACHE_DIR/native`), which `--cache-dir` does not move: the kernels start "
                        "building before the flags are read. Default `~/.cache/meshws/models`.",
    "XDG_CACHE_HOME": "Without `MESHWS_CACHE_DIR`, the cache is `$XDG_CACHE_HOME/meshws/models`.",
    "MESHWS_NATIVE": "`0`: do not build or load meshws's kernels. A GGUF then runs on the transformers path "
                     "(its weights dequantized in memory), int8 weights on FBGEMM, decode attention on "
                     "torch's sdpa.",
    "MESHWS_AMX": "`0`: bfloat16 products do not use AMX tiles even where the CPU has them.",
    "CC": "The C compiler that builds the kernels (default: `cc`, else `gcc`; without one, as `MESHWS_NATIVE=0`).",
    "HF_HUB_OFFLINE": "A node sets it to `1` unless it is set, so `--model` never reaches the Hugging Face hub "
                      "by surprise. Set `HF_HUB_OFFLINE=0` to let `--model org/name` download.",
    "TORCHINDUCTOR_CACHE_DIR": "Where `--compile` keeps torch's compiled code; set by the node to "
                               "`<cache>/inductor` unless it is set.",
}
NOT_SETTINGS = {"PYTHONPATH"}  # read only to hand on to a child process with the package's folder in front
_READS = re.compile(r"""(?:environ\.get|environ\.setdefault|getenv)\(\s*["']([A-Z][A-Z0-9_]*)["']"""
                    r"""|environ\[\s*["']([A-Z][A-Z0-9_]*)["']\s*\]""")
_SUFFIX = re.compile(r"\s*\[env MESHWS_[A-Z0-9_]+; default [^\]]*\]$")  # what build_parser adds for --help


def variables_read(package: Path = PACKAGE) -> set[str]:
    """The environment variables the package's source reads by name."""
    found: set[str] = set()
    for path in package.rglob("*.py"):
        for match in _READS.finditer(path.read_text()):
            found.add(match.group(1) or match.group(2))
    return found - NOT_SETTINGS


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(value: object, action: argparse.Action) -> str:
    if value is None or value == ():
        return "unset"
    if value is False:
        return "off"
    if action.type is config.parse_size and isinstance(value, int):
        for unit, size in (("G", 1024**3), ("M", 1024**2), ("K", 1024)):
            if value % size == 0:
                return f"`{value // size}{unit}`"
    if isinstance(value, float):
        return f"`{value:g}`"
    return f"`{value}`"


def _flag(action: argparse.Action) -> str:
    flag = "`" + ", ".join(action.option_strings)
    if action.nargs == 0:
        return flag + "`"
    if action.choices:
        return flag + " {" + ",".join(map(str, action.choices)) + "}`"
    return flag + " " + (action.metavar or action.dest.upper()) + "`"


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """The whole page, as markdown."""
    parser = parser or config.build_parser()
    defaults = config.NodeSettings()
    lines = [
        "# Node flags and environment variables",
        "",
        "<!-- Made by `python -m meshws.tools.flags_doc > docs/flags.md` from meshws/config.py; do not edit. -->",
        "",
        f"`{parser.prog}` (also `meshws node`) takes these flags. Every flag is also a `MESHWS_*` environment",
        "variable; a flag on the command line wins over the variable, and the variable over the default.",
        "A switch's variable takes `1`, `true`, `yes` or `on` (or `0`, `false`, `no`, `off`). Sizes take",
        "`512`, `64K`, `64M`, `2G`. Layer ranges are inclusive (`0-14`). `--help` prints the same text.",
    ]
    for group in parser._action_groups:  # (argparse keeps its groups only there)
        actions = [a for a in group._group_actions if a.help is not argparse.SUPPRESS and a.dest != "help"]
        if not actions:
            continue
        lines += ["", f"## {group.title}", "", "| flag | default | variable | what it does |",
                  "| --- | --- | --- | --- |"]
        for action in actions:
            params = dict(vars(action), prog=parser.prog)
            text = _SUFFIX.sub("", (action.help or "") % params)
            if isinstance(action, argparse._AppendAction) and "repeatable" not in text:
                text += " (repeatable)"
            lines.append(f"| {_flag(action)} | {_default(getattr(defaults, action.dest, None), action)} | "
                         f"`{config.env_name(action.dest)}` | {_cell(text)} |")
    lines += ["", "## Other environment variables", "", "| variable | what it does |", "| --- | --- |"]
    missing = sorted(variables_read() - set(OTHER_VARIABLES) - {config.env_name(f) for f in config.settings_fields()})
    if missing:
        raise RuntimeError(f"the code reads {', '.join(missing)}: describe each in flags_doc.OTHER_VARIABLES")
    lines += [f"| `{name}` | {_cell(text)} |" for name, text in OTHER_VARIABLES.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m meshws.tools.flags_doc", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", nargs="?", const=str(PAGE), metavar="PAGE",
                        help=f"compare with PAGE (default {PAGE}) instead of printing; exit 1 if it differs")
    args = parser.parse_args(argv)
    page = render()
    if args.check is None:
        sys.stdout.write(page)
        return
    try:
        written = Path(args.check).read_text()
    except OSError as exc:
        raise SystemExit(f"{args.check}: {exc.strerror or exc}") from None
    if written != page:
        sys.stderr.writelines(difflib.unified_diff(written.splitlines(True), page.splitlines(True), args.check,
                                                   "what the code says"))
        raise SystemExit(f"{args.check} is out of date: python -m meshws.tools.flags_doc > {args.check}")
    print(f"{args.check} is up to date")


if __name__ == "__main__":
    main()
