"""Package discovery and the build's provenance for setuptools; everything else is in
pyproject.toml.

Every package under ``ipc_dpsample/`` is found, so a new subpackage cannot be left out
of the wheel, and the CUDA sources in the top-level ``kernels/`` folder ship inside the
package as ``ipc_dpsample.kernels`` (mapped in ``[tool.setuptools.package-dir]``).
``find_packages`` alone cannot add that one: it lives outside ``ipc_dpsample/``.

The built package also gets ``ipc_dpsample/_build_info.py``, holding the commit it was
built from (``GIT_COMMIT`` when set, else ``git rev-parse --short HEAD`` of this tree,
``-dirty`` when tracked files differ; None without either), which
``ipc_dpsample._version.package_commit`` reports from an installed copy. It is written
into the build folder only, never into the source tree.
"""

import os
import subprocess
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _git(*args):
    try:
        done = subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def build_commit():
    """The commit this build is made from, or None."""
    env = os.environ.get("GIT_COMMIT", "").strip()
    if env:
        return env
    top = _git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != ROOT:
        return None  # an sdist, or a copy of the tree inside another repository
    head = _git("rev-parse", "--short", "HEAD")
    if not head:
        return None
    return head + "-dirty" if _git("status", "--porcelain", "--untracked-files=no") else head


class BuildPyWithCommit(build_py):
    """build_py, then ``_build_info.py`` beside the built package's modules."""

    def run(self):
        super().run()
        if self.dry_run:
            return
        target = Path(self.build_lib) / "ipc_dpsample" / "_build_info.py"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(
            '"""Written by setup.py when this copy was built; read by _version.package_commit."""\n'
            f"COMMIT = {build_commit()!r}\n"
        )

    def get_outputs(self, include_bytecode=True):
        return [
            *super().get_outputs(include_bytecode),
            str(Path(self.build_lib) / "ipc_dpsample" / "_build_info.py"),
        ]


setup(
    packages=[*find_packages(include=["ipc_dpsample", "ipc_dpsample.*"]), "ipc_dpsample.kernels"],
    cmdclass={"build_py": BuildPyWithCommit},
)
