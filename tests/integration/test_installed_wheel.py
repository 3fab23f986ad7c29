"""The package as a new user gets it: `pip wheel .`, the wheel and `torch==2.13.0` (CPU)
installed into a fresh virtual environment, and `stateblock up --ask` from a directory that
is not the checkout, answering from the reference pair the wheel carries."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.slow

TORCH = "torch==2.13.0"  # scripts/setup.sh's pin: the CPU build on this workplace's disk
BUILD_TIMEOUT_S = 300
VENV_TIMEOUT_S = 120
# byte-compiling torch's thousands of modules is most of an install on two busy cores;
# the interpreter compiles what it imports instead
INSTALL_TIMEOUT_S = 480
UP_TIMEOUT_S = 240
PROMPT, ANSWER = "copy: hello", "hello"  # the README's first example


def _run(argv: list[str], timeout_s: float, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL, **kwargs
    )
    tail = f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert done.returncode == 0, f"{shlex.join(argv)} exited {done.returncode}\n{tail}"
    return done


def _source_copy(dest: Path) -> Path:
    """What the build reads (the metadata, the packages, the reference pair), copied so the
    build's build/ and *.egg-info stay out of the checkout; links are kept as links."""
    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    tops = [pattern.rstrip("*") for pattern in find["packages"]["find"]["include"]]
    dest.mkdir()
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "*.onnx*")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dest / name)
    for top in [*tops, "models/reference"]:
        shutil.copytree(REPO / top, dest / top, symlinks=True, ignore=skip)
    return dest


def _user_env() -> dict[str, str]:
    """This environment less what points at the checkout or configures the services."""
    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("STATEBLOCK_")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", OMP_NUM_THREADS="1")
    return env


def test_the_installed_wheel_answers_from_another_directory(tmp_path):
    env = _user_env()
    src = _source_copy(tmp_path / "src")
    dist = tmp_path / "dist"
    pip = [sys.executable, "-m", "pip"]
    _run([*pip, "wheel", ".", "--no-deps", "-w", str(dist)], BUILD_TIMEOUT_S, cwd=src, env=env)
    (wheel,) = dist.glob("stateblock-*.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], VENV_TIMEOUT_S, env=env)
    python = venv / "bin" / "python"
    install = [str(python), "-m", "pip", "install", "-q", "--no-compile", TORCH, str(wheel)]
    _run(install, INSTALL_TIMEOUT_S, env=env)

    work = tmp_path / "elsewhere"
    work.mkdir()
    where = _run(
        [str(python), "-c", "from stateblock import runtime; print(runtime.REFERENCE_BASE)"],
        VENV_TIMEOUT_S, cwd=work, env=env,
    ).stdout.strip()  # fmt: skip
    base = Path(where)
    assert base.is_relative_to(venv.resolve()), f"the pair is found outside the venv: {base}"
    assert (base / "config.json").is_file()

    stateblock = venv / "bin" / "stateblock"
    up = [str(stateblock), "up", "--ask", PROMPT, "--http-port", "0", "--grpc-port", "0"]
    done = _run(up, UP_TIMEOUT_S, cwd=work, env=env)
    lines = done.stdout.splitlines()
    asked = lines.index(f"ask: {PROMPT}")
    assert lines[asked + 1] == ANSWER, done.stdout
