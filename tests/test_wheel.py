"""The installed package is the product: everything k3 reads at run time ships in its wheel, and an installed wheel
plans as the checkout does (it never reads the repository's folders)."""

import fnmatch
import os
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _package_data() -> dict[str, list[str]]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["package-data"]


def test_every_data_file_of_the_package_is_declared_package_data():
    """A tracked non-Python file under k3/ that pyproject's package-data does not name would be missing from the
    wheel (and from every install that is not a checkout)."""
    tracked = subprocess.run(["git", "ls-files", "k3"], cwd=ROOT, capture_output=True, text=True, check=True)
    data = [Path(p) for p in tracked.stdout.split() if not p.endswith(".py")]
    declared = _package_data()
    missing = []
    for path in data:
        package = ".".join(path.parent.parts)
        patterns = declared.get(package, []) + declared.get("*", [])
        if not any(fnmatch.fnmatch(path.name, pattern) for pattern in patterns):
            missing.append(str(path))
    assert not missing, f"not in [tool.setuptools.package-data]: {missing}"


@pytest.mark.slow
def test_an_installed_wheel_plans_as_the_checkout_does(tmp_path):
    """Build the wheel, install it into a fresh virtual environment (the system's packages visible for torch),
    and run ``k3 plan`` from an empty folder with no PYTHONPATH: the same plan as from the checkout."""
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", wheels, ROOT],
        check=True,
    )
    env_dir = tmp_path / "venv"
    venv.create(env_dir, system_site_packages=True, with_pip=True)
    python = env_dir / "bin" / "python"
    (wheel,) = wheels.glob("k3-*.whl")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel], check=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    argv = ["-m", "k3", "plan", "--preset", "k3", "--gpus", "64"]
    where = subprocess.run(
        [python, "-c", "import k3; print(k3.__file__)"], cwd=elsewhere, env=env, capture_output=True, text=True
    )
    assert str(env_dir) in where.stdout, where.stdout + where.stderr  # the wheel's k3, not the checkout's
    installed = subprocess.run([python, *argv], cwd=elsewhere, env=env, capture_output=True, text=True)
    checkout = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True)
    assert installed.returncode == 0, installed.stderr
    assert checkout.returncode == 0, checkout.stderr
    assert installed.stdout == checkout.stdout
