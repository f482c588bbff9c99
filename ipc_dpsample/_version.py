"""The package version and the commit it was built from, in a module of its own so that
any module can read them without importing the package root (which imports
:mod:`.comm` and so everything below it)."""

from __future__ import annotations

import importlib
import os
import subprocess
from pathlib import Path

__version__ = "0.1.0"

__all__ = ["__version__", "package_commit"]

_PKG = Path(__file__).resolve().parent


def _source_root() -> Path | None:
    """The checkout this module runs from (an editable install or ``PYTHONPATH`` on
    the tree), None when it runs from an installed copy. An installed copy may sit
    inside some other git repository (a project's ``.venv``): asking git there would
    report that repository's commit, so git is only asked inside the package's own
    tree (``pyproject.toml`` and ``kernels/`` beside the package)."""
    root = _PKG.parent
    if (root / "pyproject.toml").is_file() and (root / "kernels" / "onesided.cu").is_file():
        return root
    return None


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(root), *args],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def package_commit() -> str | None:
    """The commit of the code that runs, for the benchmarks' and the doctor's reports.

    ``GIT_COMMIT`` when set (a tree copied without ``.git``); else, in the source tree,
    ``git rev-parse --short HEAD`` with ``-dirty`` appended when tracked files differ
    from it; else the commit recorded in the wheel when it was built
    (``ipc_dpsample/_build_info.py``, written by ``setup.py``). None when none of them
    is known (a wheel built without git, for instance).
    """
    env = os.environ.get("GIT_COMMIT", "").strip()
    if env:
        return env
    root = _source_root()
    if root is not None:
        top = _git(root, "rev-parse", "--show-toplevel")
        if top is None or Path(top).resolve() != root:
            return None  # a copy of the tree inside another repository, or no git
        head = _git(root, "rev-parse", "--short", "HEAD")
        if head:
            dirty = _git(root, "status", "--porcelain", "--untracked-files=no")
            return f"{head}-dirty" if dirty else head
        return None
    try:  # (a generated module: no static import, it is absent from the source tree)
        info = importlib.import_module(f"{__package__}._build_info")
    except ImportError:
        return None
    commit = getattr(info, "COMMIT", None)
    return str(commit) if commit else None
