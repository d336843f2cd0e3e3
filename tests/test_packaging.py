"""What the wheel carries: the PEP 561 marker (gradmap is typed) and the native walk's source."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not (ROOT / "pyproject.toml").is_file(), reason="not a source checkout")
def test_wheel_ships_py_typed_and_the_native_source(tmp_path: pathlib.Path) -> None:
    # a copy of what the wheel is built from: no build folder of an earlier build to reuse
    source = tmp_path / "source"
    shutil.copytree(
        ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    build = subprocess.run(
        [*pip, "-w", str(tmp_path), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if build.returncode != 0 and (
        "No module named" in build.stderr or "BackendUnavailable" in build.stderr
    ):
        pytest.skip(f"cannot build a wheel here: {build.stderr.strip()[-200:]}")
    assert build.returncode == 0, build.stderr
    (wheel,) = tmp_path.glob("gradmap-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "gradmap/py.typed" in names
    assert "gradmap/_torch/_native.cpp" in names
