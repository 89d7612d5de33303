"""Write `coding-dataset.jsonl`: a small synthetic coding-assistant dataset (no download, fully seeded).

    python scenarios/make_coding_dataset.py            # rewrites scenarios/coding-dataset.jsonl

Each row is one request in Anthropic JSONL form (`system`, `messages`,
`max_tokens`): a coding assistant's system prompt with tool descriptions (the
same for every row, as in Claude Code), then a conversation of 1-4 turns in
which the user pastes code, error output and follow-up requests and the
assistant answered with code. The row's last message is the user's turn to
send; `max_tokens` is the length of a typical answer to it. The texts are
generated from templates, so the file is reproducible byte for byte and safe to
ship; use it with `[prompt] dataset = "coding-dataset.jsonl"`.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

ROWS = 40
SEED = 13
OUT = Path(__file__).with_name("coding-dataset.jsonl")

TOOLS = ("read_file(path): return a file's text", "edit_file(path, old, new): replace text in a file",
         "run(command): run a shell command and return its output", "grep(pattern, path): search files",
         "list_dir(path): list a folder")
SYSTEM = ("You are a coding assistant working in the user's repository. Read before you edit, keep changes "
          "small, run the tests after each change, and explain what you changed and why.\n\nTools:\n"
          + "\n".join(f"- {t}" for t in TOOLS)
          + "\n\nRules:\n- Never print secrets.\n- Prefer the standard library.\n- Match the project's style.")
NOUNS = ("user", "order", "invoice", "session", "token", "record", "report", "cache", "queue", "config")
VERBS = ("load", "parse", "validate", "merge", "render", "fetch", "retry", "flush", "resolve", "export")
ERRORS = ("KeyError: 'id'", "TypeError: 'NoneType' object is not iterable", "AssertionError: assert 3 == 4",
          "ValueError: invalid literal for int() with base 10: ''", "TimeoutError: read timed out after 30 s")
ASKS = ("Why does this fail?", "Can you make it handle empty input?", "Add a test for the edge case.",
        "Refactor this into smaller functions.", "Make it faster; it is called in a hot loop.",
        "The test still fails, here is the new output.", "Now update the docstring and the README.")


def _function(rng: random.Random) -> str:
    verb, noun = rng.choice(VERBS), rng.choice(NOUNS)
    lines = [f"def {verb}_{noun}s(items, *, strict=False):", f'    """{verb.capitalize()} every {noun}."""',
             "    out = []"]
    for _ in range(rng.randint(2, 6)):
        field = rng.choice(NOUNS)
        lines.append(f"    if strict and not items[0].get('{field}'):\n        raise ValueError('{field} missing')")
        lines.append(f"    out.append({{'{field}': [x['{field}'] for x in items if '{field}' in x]}})")
    lines.append("    return out")
    return "\n".join(lines)


def _user(rng: random.Random, first: bool) -> str:
    parts = [rng.choice(ASKS)]
    if first or rng.random() < 0.5:
        parts.append("```python\n" + _function(rng) + "\n```")
    if rng.random() < 0.6:
        parts.append("Output:\n```\n" + "\n".join(f"  File \"app/{rng.choice(NOUNS)}.py\", line {rng.randint(1, 400)}"
                                                   for _ in range(rng.randint(1, 5))) + f"\n{rng.choice(ERRORS)}\n```")
    return "\n\n".join(parts)


def _assistant(rng: random.Random) -> str:
    return ("The problem is that the loop assumes every item has the key. Here is a fixed version:\n\n```python\n"
            + _function(rng) + "\n```\n\nI ran the tests: all pass.")


def rows(n: int = ROWS, seed: int = SEED) -> list[dict[str, object]]:
    rng = random.Random(seed)
    out: list[dict[str, object]] = []
    for _ in range(n):
        turns = rng.randint(1, 4)
        messages: list[dict[str, str]] = []
        for t in range(turns):
            messages.append({"role": "user", "content": _user(rng, t == 0)})
            if t < turns - 1:
                messages.append({"role": "assistant", "content": _assistant(rng)})
        out.append({"system": SYSTEM, "messages": messages, "max_tokens": rng.choice((128, 256, 384, 512, 768))})
    return out


def render(n: int = ROWS, seed: int = SEED) -> str:
    return "".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows(n, seed))


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    target.write_text(render(), encoding="utf-8")
    print(target)
