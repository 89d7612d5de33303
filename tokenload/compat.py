"""Standard-library pieces that moved between the Python versions tokenload supports (3.10+)."""

from __future__ import annotations

import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 reads TOML with the tomli backport
    import tomli as tomllib

# `python -m` puts the working directory first on sys.path: a folder named `tokenload` there (the parent
# of a clone) would shadow the installed package in every child process. -P (3.11+) leaves it out.
_WITHOUT_CWD = ("import runpy, sys; del sys.path[0]; "
                "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)")


def python_module(module: str) -> list[str]:
    """The command line of `python -m MODULE` in this interpreter, without the working directory on sys.path."""
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", module]
    return [sys.executable, "-c", _WITHOUT_CWD, module]  # pragma: no cover - Python 3.10


__all__ = ["python_module", "tomllib"]
