"""What a user installs: the wheel holds every module and the CUDA sources, and the
package installed from it (not the source tree) imports and runs the CPU demo.

The wheel is built once per session of this module; it is installed with
``pip install --no-deps --target`` into an empty folder, and every check runs in a
subprocess whose working directory is outside the source tree and whose
``sys.path`` leads with that folder (asserted, so the editable install cannot stand
in for it).
"""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "ipc_dpsample"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("setuptools", reason="needs setuptools to build the wheel")
    pytest.importorskip("wheel", reason="needs the wheel package to build the wheel")
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    (built,) = out.glob("ipc_dpsample-*.whl")
    return built


def _install(wheel: Path, target: Path) -> Path:
    """The wheel installed into ``target`` (an empty folder), as a user's pip would."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
         "--target", str(target), str(wheel)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return target


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _install(wheel, tmp_path_factory.mktemp("site"))


def _run_installed(
    target: Path, args: list[str], cwd: Path, timeout: float
) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(target), PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def _source_modules() -> list[str]:
    """Every module of the source tree, as the installed package must hold it."""
    names = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).with_suffix("")
        parts = ["ipc_dpsample", *rel.parts]
        if parts[-1] == "__init__":
            parts.pop()
        if "__pycache__" not in parts:
            names.append(".".join(parts))
    return names


def test_wheel_contains_every_kernel_source_and_py_typed(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(p.name for p in (ROOT / "kernels").glob("*.cu*"))
    assert sources, "no kernel sources in kernels/"
    for name in sources:
        packed = f"ipc_dpsample/kernels/{name}"
        assert packed in names, f"{packed} missing from {wheel.name}"
        assert zipfile.ZipFile(wheel).read(packed) == (ROOT / "kernels" / name).read_bytes()
    assert "ipc_dpsample/kernels/__init__.py" in names
    assert "ipc_dpsample/py.typed" in names


def test_wheel_contains_every_python_file_of_the_tree(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [
        f"ipc_dpsample/{p.relative_to(PKG).as_posix()}"
        for p in sorted(PKG.rglob("*.py"))
        if "__pycache__" not in p.parts
        and f"ipc_dpsample/{p.relative_to(PKG).as_posix()}" not in names
    ]
    assert not missing, f"{wheel.name} lacks {missing}"


def _wheel_commit(wheel: Path) -> str | None:
    text = zipfile.ZipFile(wheel).read("ipc_dpsample/_build_info.py").decode()
    scope: dict[str, object] = {}
    exec(compile(text, "_build_info.py", "exec"), scope)
    commit = scope["COMMIT"]
    assert commit is None or isinstance(commit, str)
    return commit


def test_wheel_records_the_commit_it_was_built_from(wheel: Path) -> None:
    from ipc_dpsample._version import package_commit

    # the test process runs from this tree with the build's environment, so the tree's
    # own answer is what setup.py must have recorded
    assert _wheel_commit(wheel) == package_commit()
    if (ROOT / ".git").exists() and shutil.which("git") and not os.environ.get("GIT_COMMIT"):
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        assert (_wheel_commit(wheel) or "").split("-")[0] == head
    assert not (PKG / "_build_info.py").exists(), "setup.py wrote into the source tree"


def test_installed_copy_inside_another_repository_reports_its_own_commit(
    wheel: Path, tmp_path: Path
) -> None:
    """A package installed into a project's folder (a ``.venv`` inside a git checkout)
    must not report that project's commit as its own."""
    if shutil.which("git") is None:
        pytest.skip("needs git to build the enclosing repository")
    repo = tmp_path / "project"
    repo.mkdir()
    (repo / "app.py").write_text("print('the user project')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    for args in (
        ["init", "-q"],
        ["add", "app.py"],
        ["-c", "user.name=u", "-c", "user.email=u@example.com", "commit", "-q", "-m", "x"],
    ):
        subprocess.run(["git", "-C", str(repo), *args], check=True, env=env, timeout=60)
    foreign = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
        capture_output=True, text=True, check=True, env=env,
    ).stdout.strip()  # fmt: skip
    site = _install(wheel, repo / ".venv-site")
    code = (
        "import ipc_dpsample, ipc_dpsample._version as v\n"
        f"assert ipc_dpsample.__file__.startswith({str(site)!r}), ipc_dpsample.__file__\n"
        "print(repr(v.package_commit()))\n"
    )
    run_env = dict(env, PYTHONPATH=str(site), PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=repo, env=run_env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    reported = proc.stdout.strip()
    assert reported == repr(_wheel_commit(wheel))
    assert foreign not in reported


def test_wheel_declares_the_console_script(wheel: Path) -> None:
    zf = zipfile.ZipFile(wheel)
    (ep_name,) = [n for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt")]
    entry_points = configparser.ConfigParser()
    entry_points.read_string(zf.read(ep_name).decode())
    assert entry_points["console_scripts"]["ipc-dpsample"] == "ipc_dpsample.tools.cli:main"


def test_installed_wheel_imports_every_module_from_outside_the_tree(
    installed: Path, tmp_path: Path
) -> None:
    modules = _source_modules()
    assert "ipc_dpsample.backends.onesided.backend" in modules
    code = (
        "import importlib, sys\n"
        "import ipc_dpsample\n"
        f"assert ipc_dpsample.__file__.startswith({str(installed)!r}), ipc_dpsample.__file__\n"
        f"for name in {modules!r}:\n"
        "    module = importlib.import_module(name)\n"
        f"    assert module.__file__.startswith({str(installed)!r}), (name, module.__file__)\n"
        "from ipc_dpsample.kernels import read_source\n"
        "assert '__global__' in read_source('onesided.cu')\n"
        "print('imported', len(sys.modules))\n"
    )
    proc = _run_installed(installed, ["-c", code], tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "imported" in proc.stdout


@pytest.mark.multirank
def test_installed_wheel_runs_the_cpu_demo(installed: Path, tmp_path: Path) -> None:
    proc = _run_installed(
        installed,
        ["-m", "ipc_dpsample", "demo", "--cpu", "--world-size", "2", "--iters", "2"],
        tmp_path,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "OK: every output matches the NumPy reference" in proc.stdout, proc.stdout[-3000:]
    assert str(ROOT) not in proc.stdout + proc.stderr
