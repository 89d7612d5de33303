"""The CLI's exit-code contract: bad input is exit 2 with one clear stderr line, never a traceback.

Common mistake 7 (configuration not read) surfaces here: a wrong path, bad
JSON or a malformed value must say what and where, in one line, in a real
subprocess exactly as a user runs it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tokenload.cli import COMMANDS, main


def run_cli(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "OPENAI_"))}
    clean.update(HOME=str(tmp_path / "home"), PYTHONIOENCODING="utf-8", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "tokenload", *args],
        capture_output=True, text=True, encoding="utf-8", cwd=tmp_path, env=clean, timeout=60,
    )


def _files(tmp_path: Path) -> dict[str, Path]:
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "env": {"ANTHROPIC_MODEL": "x",}\n}\n', encoding="utf-8")
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00{")
    array = tmp_path / "array.json"
    array.write_text("[]", encoding="utf-8")
    return {"bad": bad, "binary": binary, "array": array}


@pytest.mark.parametrize(
    ("args", "env", "expect"),
    [
        (["--base-url", "relay.example/api"], {}, "not an http(s) URL"),
        (["--base-url", "http://127.0.0.1:9"], {"ANTHROPIC_BASE_URL": "ftp://x"}, None),  # flag wins: not a config error
        ([], {"ANTHROPIC_BASE_URL": "localhost:8080"}, "not an http(s) URL"),
        (["--settings", "{missing}"], {}, "does not exist"),
        (["--settings", "{bad}"], {}, "bad.json is not valid JSON: Expecting property name enclosed in double quotes at line 2 column 34"),
        (["--settings", "{binary}"], {}, "not UTF-8"),
        (["--settings", "{array}"], {}, "JSON object"),
        (["--max-tokens", "lots"], {}, "--max-tokens"),
        (["--max-tokens", "0"], {}, "--max-tokens must be at least 1"),
        (["--protocol", "grpc"], {}, "invalid choice"),
        (["--no-such-flag"], {}, "unrecognized arguments"),
        ([], {"ANTHROPIC_CUSTOM_HEADERS": "X-Key sk-zz-hidden-value-123456"}, "custom header line 1"),
    ],
    ids=["bad-url-flag", "flag-overrides-bad-env", "bad-url-env", "missing-settings", "invalid-json", "not-utf8",
         "not-object", "max-tokens-text", "max-tokens-zero", "bad-protocol", "unknown-flag", "bad-custom-header"],
)
def test_bad_config_exits_2_with_one_line(tmp_path: Path, args: list[str], env: dict[str, str], expect: str | None) -> None:
    files = {**_files(tmp_path), "missing": tmp_path / "nope" / "settings.json"}
    args = [a.format(**files) for a in args]
    proc = run_cli(tmp_path, "probe", *args, env=env)
    if expect is None:
        assert proc.returncode == 1  # reached the network: connection refused is a probe failure, not bad input
        assert "FAIL bad_base_url" in proc.stderr
        return
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("tokenload: error: ") and expect in lines[0]
    assert proc.stdout == ""
    assert "sk-zz-hidden-value-123456" not in proc.stderr


REPO = Path(__file__).resolve().parent.parent


def _cited_but_missing(text: str, where: Path = REPO) -> list[str]:
    """Documents (`*.md`) a text names that the repository does not have (a user cannot read them); a name is
    looked up from the repository's root and from the citing file's folder (`where`)."""
    return sorted({name for name in re.findall(r"[\w./-]+\.md\b", text)
                   if not (REPO / name).is_file() and not (where / name).is_file()})


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`--help` works and cites no document outside the repository (probe, doctor and analyze cited the
    project's contract files, which users do not have)."""
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: tokenload {command}" in out
    assert _cited_but_missing(out) == []


def test_docs_cite_no_document_outside_the_repository() -> None:
    cited = {str(path.relative_to(REPO)): _cited_but_missing(path.read_text(encoding="utf-8"), path.parent)
             for path in [*REPO.glob("*.md"), *REPO.glob("docs/*.md"), *REPO.glob("results/*.md")]}
    assert cited and all(missing == [] for missing in cited.values()), cited


def test_probe_help_lists_channel_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["probe", "--help"])
    out = capsys.readouterr().out
    for option in ("--base-url", "--api-key", "--auth-token", "--model", "--protocol", "--settings", "--prompt", "--max-tokens", "--json"):
        assert option in out


def test_no_command_is_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "probe" in capsys.readouterr().out


def test_unknown_command_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["frobnicate"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "invalid choice" in err[0]


def test_module_entry_point_version(tmp_path: Path) -> None:
    """`python -m tokenload` is the console script (CI and users without the script on PATH use it)."""
    proc = run_cli(tmp_path, "--version")
    assert proc.returncode == 0 and proc.stdout.startswith("tokenload ")


def test_settings_error_message_names_the_file_in_json_mode_too(tmp_path: Path) -> None:
    """`--json` does not change the bad-input contract: still exit 2, one line on stderr, nothing on stdout."""
    bad = _files(tmp_path)["bad"]
    proc = run_cli(tmp_path, "probe", "--json", "--settings", str(bad))
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and str(bad) in proc.stderr


def test_demo_help_describes_the_packaged_demo(capsys: pytest.CaptureFixture[str]) -> None:
    """`demo --help` says what the demo runs, in the packaged scenario's numbers (it described an older demo)."""
    from tokenload.workload.scenario import load_scenario

    scenario = load_scenario("demo")
    search = scenario.load.search
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert scenario.load.kind == "search" and search is not None and scenario.slo.ttft_s is not None
    assert f"a breakpoint search from {search.min_level:g} users" in out, out
    assert f"TTFT stays within {scenario.slo.ttft_s:g} s for {100 * scenario.slo.target:g}% of requests" in out, out


def test_a_reader_that_stops_reading_ends_the_command_quietly(tmp_path: Path) -> None:
    """`tokenload analyze DIR | head`: the reader is gone before the verdict's last line (here before its first,
    so the race cannot hide it); the command ends without a BrokenPipeError traceback."""
    from tokenload.analysis.synthetic import Law, write_synthetic_run

    run_dir = write_synthetic_run(tmp_path / "run", Law(users=(1, 2)), n=300)
    for quiet in ([], ["--quiet"]):  # the verdict table (rich) and the plain report path (print)
        proc = subprocess.Popen([sys.executable, "-m", "tokenload", "analyze", str(run_dir), *quiet],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
        assert proc.stdout is not None
        proc.stdout.close()
        stderr = proc.communicate(timeout=120)[1]
        assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr[-2000:]
        assert proc.returncode == 1, (quiet, proc.returncode, stderr[-2000:])
        assert (run_dir / "report.html").is_file()


@pytest.mark.parametrize(("args", "flag"), [
    (["analyze", "{run}", "--slo-ttf", "0.5"], "--slo-ttf"),
    (["run", "smoke", "--dur", "1", "--base-url", "http://127.0.0.1:9"], "--dur"),
    (["--vers"], "--vers"),
], ids=["analyze", "run", "top"])
def test_an_abbreviated_option_is_an_unknown_one(tmp_path: Path, args: list[str], flag: str) -> None:
    """`--slo-ttf 0.5` was silently taken as `--slo-ttft 0.5` (argparse's prefix matching)."""
    proc = run_cli(tmp_path, *[a.format(run=tmp_path) for a in args])
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "unrecognized arguments" in line and flag in line


def test_run_help_lists_every_packaged_scenario(tmp_path: Path) -> None:
    """The list was written by hand and lacked `search`."""
    from tokenload.workload.scenario import packaged_file

    names = sorted(path.stem for path in packaged_file("").glob("*.toml"))
    assert "search" in names
    proc = run_cli(tmp_path, "run", "--help")
    assert proc.returncode == 0
    listed = re.search(r"Packaged scenarios: ([^.]+)\.", proc.stdout)
    assert listed is not None and listed.group(1).split(", ") == names
