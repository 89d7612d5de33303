"""One row per protocol (`tokenload/protocolspec.py`), and ARCHITECTURE.md's "add a protocol" recipe against the code.

The recipe must name every file that knows a protocol by name: the Python that writes a protocol's name as a
string (its row, its adapter, its simulator framer, the test fake server's builders) and every page that lists
the protocols. Each per-protocol table holds every row, and a test module parametrises over `PROTOCOLS`
instead of writing its own list of them.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from fakeserver import WIRES, api_base

from tokenload.channel import Channel
from tokenload.protocols import ADAPTERS
from tokenload.protocolspec import PROTOCOLS, SPECS, ProtocolSpec
from tokenload.sim import server as sim_server
from tokenload.sim import wire

ROOT = Path(__file__).resolve().parent.parent
NAMES = set(PROTOCOLS)


def recipe() -> str:
    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    start = text.index("**A fourth protocol.**")
    return text[start:text.index("\n\n", start)]


def recipe_files() -> set[str]:
    """The repository files the recipe names (`<name>` stands for any protocol's module)."""
    named = set(re.findall(r"`((?:tokenload|tests|docs|analysis|locustfiles)/[\w/<>.]+\.(?:py|md))`", recipe()))
    files = {p for p in named if "<name>" not in p}
    for pattern in (p for p in named if "<name>" in p):
        files |= {str(path.relative_to(ROOT)) for path in ROOT.glob(pattern.replace("<name>", "*"))}
    return files


def _names_in_code(path: Path) -> list[int]:
    """Lines where `path` writes a protocol's name as a string (docstrings aside)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)}
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Constant) and node.value in NAMES
            and id(node) not in docstrings]


def test_the_recipe_names_every_file_that_knows_a_protocol_by_name() -> None:
    named = recipe_files()
    assert all((ROOT / path).is_file() for path in named), sorted(p for p in named if not (ROOT / p).is_file())
    code = [*(ROOT / "tokenload").rglob("*.py"), *(ROOT / "analysis").rglob("*.py"),
            *(ROOT / "locustfiles").rglob("*.py"), ROOT / "tests" / "fakeserver.py"]
    knows = {str(path.relative_to(ROOT)) for path in code if _names_in_code(path)}
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    lists = {str(page.relative_to(ROOT)) for page in pages
             if all(name in page.read_text(encoding="utf-8") for name in NAMES)}
    assert not (knows | lists) - named, f"files the recipe does not name: {sorted((knows | lists) - named)}"
    missing = {page: sorted(n for n in NAMES if n not in (ROOT / page).read_text(encoding="utf-8"))
               for page in named if page.startswith("docs/")}
    assert not any(missing.values()), f"pages the recipe names that miss a protocol: {missing}"


def test_every_per_protocol_table_has_every_protocol() -> None:
    for table in (ADAPTERS, wire.PROTOCOLS, WIRES):
        assert set(table) == NAMES, table
    assert all(cls.name == name for name, cls in (*ADAPTERS.items(), *wire.PROTOCOLS.items()))


def test_no_test_module_lists_the_protocols_itself() -> None:
    """A list, tuple or set of two or more protocol names in a test module goes stale when a protocol is added:
    parametrise over `PROTOCOLS` (a few chosen for a reason: a dict that says which and why)."""
    found = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
                names = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in NAMES]
                if len(names) >= 2:
                    found.append(f"{path.name}:{node.lineno} {names}")
    assert not found, found


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_each_row_gives_the_url_and_headers_its_sdks_use(protocol: str) -> None:
    """The channel's URL, headers and the model list's URL, from the row (the ground truth: the SDKs' own)."""
    truth = {
        "anthropic": ("https://r.example/api/v1/messages", "https://r.example/api/v1/models",
                      {"x-api-key": "k", "authorization": "Bearer t", "anthropic-version": "2023-06-01"}),
        "openai-chat": ("https://r.example/api/v1/chat/completions", "https://r.example/api/v1/models",
                        {"authorization": "Bearer k"}),
        "openai-responses": ("https://r.example/api/v1/responses", "https://r.example/api/v1/models",
                             {"authorization": "Bearer k"}),
    }
    url, models, headers = truth[protocol]
    channel = Channel(base_url=api_base("https://r.example/api", protocol, ""), protocol=protocol, model="m",
                      api_key="k", auth_token="t")
    assert channel.url == url and SPECS[protocol].models_url(channel.base_url) == models
    sent = channel.headers()
    assert {k: v for k, v in sent.items() if k not in ("content-type", "accept")} == headers


def test_a_model_in_the_path_is_filled_in_and_routed() -> None:
    """A protocol whose path names the model (as Gemini's does): the URL carries it and the simulator's router
    reads it back from the path."""
    spec = ProtocolSpec("path-model", "/models/{model}:stream", "https://g.example", "m-1", ("openai",),
                        root="/v1beta", key_header="x-goog-api-key", error_keys=("status",))
    assert spec.endpoint_url("https://g.example/", "m-7b") == "https://g.example/v1beta/models/m-7b:stream"
    assert spec.auth_headers("k", None) == {"x-goog-api-key": "k"}
    match = spec.route().match("/v1beta/models/m-7b:stream")
    assert match is not None and match["model"] == "m-7b" and spec.route().match("/v1beta/models/a/b:stream") is None
    assert sim_server._route("POST", "/v1/messages") == ("anthropic", None)
    SPECS[spec.name] = spec
    try:
        assert sim_server._route("POST", "/v1beta/models/m-7b:stream") == ("path-model", "m-7b")
    finally:
        del SPECS[spec.name]
