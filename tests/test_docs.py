"""The docs against the code: what they name must exist, and what exists must be named.

docs/commands.md is the reference of every command and flag. Its flags are
checked against the real parser (`tokenload.cli.build_parser`, the one that
prints `--help`) in both directions, and the failure lists each missing
`tokenload CMD --flag` on the side it is missing from, so a new flag costs one
table row. The conventions it relies on:

- one section per command, headed `` ## `tokenload CMD` `` (`` ## `tokenload` ``
  for the top-level options), whose flags are the `--flags` written in it;
- the shared channel flags are written once, in `## Channel options`, and count
  for every command section that links to `#channel-options`;
- inside code (`...` or a fenced block), a flag belongs to the nearest
  `tokenload CMD` before it (`tokenload watch --period` in the sim section is
  watch's flag); elsewhere to the section's command.

The same code reading holds every other page (README, ARCHITECTURE.md, docs/):
each `tokenload CMD` written in code is a real command and each flag written
after it one of that command's. Besides: the README stays short, no page cites
a file outside the repository, every relative link (and its #anchor) resolves,
every record column and summary.json key is documented, and docs/scenarios.md
carries the scenario schema `tokenload run --help` prints.
"""

from __future__ import annotations

import argparse
import importlib
import re
import textwrap
from collections import defaultdict
from pathlib import Path

from tokenload.cli import COMMANDS, build_parser
from tokenload.record import COLUMNS
from tokenload.workload.scenario import SCHEMA_HELP

ROOT = Path(__file__).resolve().parent.parent
COMMANDS_MD = ROOT / "docs" / "commands.md"
README_MAX_LINES = 260
CHANNEL_SECTION = "Channel options"
TOP = ""  # the top-level `tokenload` parser's "command" name

# `tokenload` as a command word (not `tokenload.sim`, `tokenload/`, `tokenload-watch`), and the word after it.
_COMMAND = re.compile(r"(?<![\w.-])tokenload(?![\w/.-])(?:[ \t]+([a-z][a-z-]*))?")
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
_SEPARATOR = re.compile(r"&&|;| & ")
_FENCE = re.compile(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```[ \t]*$", re.MULTILINE | re.DOTALL)
_COMMENT = re.compile(r"(^|\s)#.*$")
_SPAN = re.compile(r"`([^`]+)`")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_REPO_DIRS = {"tokenload", "analysis", "locustfiles", "scenarios", "tests", "benchmarks", "docs", ".ci"}
_CITED = re.compile(r"\b(?:SPEC|BRIEF|WIRE|REAL-SERVER)\.md\b")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]


def real_flags() -> dict[str, set[str]]:
    """Command ("" for the top level) -> its long options, from the parser that prints `--help`."""
    parser = build_parser()

    def longs(p: argparse.ArgumentParser) -> set[str]:
        return {o for action in p._actions for o in action.option_strings if o.startswith("--")}

    out = {TOP: longs(parser)}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            out.update({name: longs(sub) for name, sub in action.choices.items()})
    return out


def _code_units(text: str) -> tuple[list[str], str]:
    """(code units, the prose left over): each fenced line (a `\\` continuation joined, a `#` comment cut)
    and each `span`."""
    units: list[str] = []
    for block in _FENCE.findall(text):
        units += [_COMMENT.sub("", line) for line in block.replace("\\\n", " ").splitlines()]
    prose = _FENCE.sub("", text)
    units += _SPAN.findall(prose)
    return units, _SPAN.sub("", prose)


def attributed(text: str, default: str | None) -> tuple[list[tuple[str | None, str]], list[str]]:
    """([(command or None, flag)], [unknown command words]) as written in `text`.

    In code, a flag belongs to the `tokenload CMD` before it in the same unit (a
    shell separator ends it), else to `default`; in prose always to `default`.
    """
    found: list[tuple[str | None, str]] = []
    unknown: list[str] = []
    units, prose = _code_units(text)
    for unit in units:
        current = default
        events = sorted([(m.start(), "cmd", m.group(1) or TOP) for m in _COMMAND.finditer(unit)]
                        + [(m.start(), "flag", m.group()) for m in _FLAG.finditer(unit)]
                        + [(m.start(), "sep", "") for m in _SEPARATOR.finditer(unit)])
        for _, kind, value in events:
            if kind == "cmd":
                if value != TOP and value not in COMMANDS:
                    unknown.append(value)
                current = value
            elif kind == "sep":
                current = default
            else:
                found.append((current, value))
    found += [(default, m.group()) for m in _FLAG.finditer(prose)]
    return found, unknown


def sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) of each `## ` section outside code, the text before the first as heading ""."""
    out: list[tuple[str, list[str]]] = [("", [])]
    fenced = False
    for line in text.splitlines(keepends=True):
        fenced ^= line.lstrip().startswith("```")
        if not fenced and line.startswith("## "):
            out.append((line[3:].strip(), []))
        else:
            out[-1][1].append(line)
    return [(heading, "".join(body)) for heading, body in out]


def spell(command: str, flag: str = "") -> str:
    """`tokenload run --web`, `tokenload --version`."""
    return "`" + " ".join(w for w in ("tokenload", command, flag) if w) + "`"


def section_command(heading: str) -> str | None:
    m = re.fullmatch(r"`tokenload(?: ([a-z][a-z-]*))?`", heading)
    return None if m is None else (m.group(1) or TOP)


def test_commands_md_matches_the_real_help_both_ways() -> None:
    real = real_flags()  # argparse's own `--help` is among each command's flags
    text = COMMANDS_MD.read_text(encoding="utf-8")
    parts = sections(text)
    channel = {flag for heading, body in parts if heading == CHANNEL_SECTION
               for _, flag in attributed(body, None)[0]}
    documented: dict[str, set[str]] = defaultdict(set)
    extra: list[str] = []  # written in the docs, absent from --help
    for heading, body in parts:
        command = section_command(heading)
        found, unknown = attributed(body, command)
        extra += [f"{spell(w)} (no such command)" for w in unknown]
        if heading == CHANNEL_SECTION:
            continue
        if command is not None and "(#channel-options)" in body:
            documented[command] |= channel
            extra += [f"{spell(command, flag)} (via the channel options)"
                      for flag in sorted(channel - real.get(command, set()))]
        for owner, flag in found:
            if owner is None:
                if flag != "--help":
                    extra.append(f"`{flag}` in section {heading or '(preamble)'!r}, which is no command's")
                continue
            if owner == command:
                documented[owner].add(flag)
            if owner in real and flag not in real[owner]:
                extra.append(spell(owner, flag))
    missing = [spell(cmd, flag) for cmd, flags in sorted(real.items()) for flag in sorted(flags - documented[cmd] - {"--help"})]
    no_section = [spell(cmd) for cmd in COMMANDS if cmd not in documented]
    problems = []
    if missing or no_section:
        problems.append("in --help but not in its section of docs/commands.md: " + ", ".join(no_section + missing))
    if extra:
        problems.append("in docs/commands.md but not in --help: " + ", ".join(sorted(set(extra))))
    assert not problems, "\n".join(problems)


def test_every_page_names_real_commands_and_flags() -> None:
    real = real_flags()
    wrong: list[str] = []
    for path in doc_files():
        found, unknown = attributed(path.read_text(encoding="utf-8"), None)
        name = path.relative_to(ROOT)
        wrong += [f"{name}: {spell(w)} (no such command)" for w in unknown]
        wrong += [f"{name}: {spell(cmd, flag)}" for cmd, flag in found
                  if cmd is not None and flag != "--help" and flag not in real.get(cmd, set())]
    assert not wrong, "commands or flags the real --help does not have:\n" + "\n".join(sorted(set(wrong)))


def test_the_readme_is_short() -> None:
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move reference to docs/"


def test_the_readme_documentation_table_lists_every_page() -> None:
    """docs/slo.md was reachable only from other pages."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme[readme.index("## Documentation"):]
    rows = set(re.findall(r"^\| \[([\w./-]+\.md)\]", table, flags=re.MULTILINE))
    pages = {f"docs/{path.name}" for path in (ROOT / "docs").glob("*.md")} | {"ARCHITECTURE.md"}
    assert pages - rows == set(), pages - rows


def test_no_page_cites_files_outside_the_repository() -> None:
    cited = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in doc_files()
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if _CITED.search(line)]
    assert not cited, "pages citing files that are not in the repository:\n" + "\n".join(cited)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = defaultdict(int)
    out = set()
    for m in re.finditer(r"^#{1,6} (.+)$", _FENCE.sub("", path.read_text(encoding="utf-8")), re.MULTILINE):
        base = slug(m.group(1))
        out.add(base if not seen[base] else f"{base}-{seen[base]}")
        seen[base] += 1
    return out


def test_every_relative_link_resolves() -> None:
    broken: list[str] = []
    for path in doc_files():
        for target in _LINK.findall(_FENCE.sub("", path.read_text(encoding="utf-8"))):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def cited_names(path: Path) -> tuple[list[str], list[str]]:
    """(repository paths, dotted `tokenload.` names) written in the code of a page."""
    units, _ = _code_units(path.read_text(encoding="utf-8"))
    words = [w.strip("`,;:()") for unit in units for w in unit.split()]
    paths = [w for w in words if w.split("/")[0] in _REPO_DIRS and "/" in w and not re.search(r"[<>$]", w)]
    names = [w.rstrip(".") for w in words if re.fullmatch(r"tokenload(\.\w+)+\.?", w)]
    return paths, names


def resolves(name: str) -> bool:
    """A dotted name is a module, or an attribute of the longest module that prefixes it."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_path_and_name_cited_in_code_exists() -> None:
    absent: list[str] = []
    for page in doc_files():
        paths, names = cited_names(page)
        absent += [f"{page.relative_to(ROOT)}: {p}" for p in paths if not any(ROOT.glob(p.rstrip("/")))]
        absent += [f"{page.relative_to(ROOT)}: {n}" for n in names if not resolves(n)]
    assert not absent, "cited in the docs but not in the repository:\n" + "\n".join(sorted(set(absent)))


def test_every_record_column_is_documented() -> None:
    text = (ROOT / "docs" / "records.md").read_text(encoding="utf-8")
    missing = [c for c in COLUMNS if f"`{c}`" not in text]
    assert not missing, f"columns of tokenload/record.py missing from docs/records.md: {missing}"


def test_scenarios_md_carries_the_schema_run_help_prints() -> None:
    schema = textwrap.dedent(SCHEMA_HELP.split("\n", 1)[1]).strip("\n")
    assert schema in (ROOT / "docs" / "scenarios.md").read_text(encoding="utf-8"), (
        "docs/scenarios.md's schema block differs from SCHEMA_HELP (tokenload/workload/scenario.py): "
        "paste the schema of `tokenload run --help`, dedented, into its first toml block")


def test_every_summary_key_is_documented(tmp_path: Path) -> None:
    from tokenload.analysis.pipeline import analyze
    from tokenload.analysis.synthetic import Law, write_synthetic_run

    summary = analyze(write_synthetic_run(tmp_path, Law(users=(1, 2, 4)), n=300), write=False).summary
    text = (ROOT / "docs" / "summary.md").read_text(encoding="utf-8")
    keys = [*summary, *(f"steps[].{k}" for k in summary["steps"][0])]
    missing = [k for k in keys if not re.search(rf"(?<![\w.]){re.escape(k.removeprefix('steps[].'))}(?!\w)", text)]
    assert summary["steps"] and not missing, f"summary.json keys missing from docs/summary.md: {missing}"
