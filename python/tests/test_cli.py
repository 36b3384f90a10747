"""The `comera` command that `pip install` puts beside the interpreter (a console script
running the same command line as the cargo-built binary)."""

import subprocess
import sys
from pathlib import Path

import pytest

import comera


def script():
    path = Path(sys.executable).parent / "comera"
    if not path.is_file():
        pytest.skip(f"no comera script beside {sys.executable} (the package was not pip-installed)")
    return str(path)


def test_the_installed_command_is_comeras_command_line():
    done = subprocess.run([script(), "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == f"comera {comera.__version__}", done
    done = subprocess.run([script(), "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "predict" in done.stdout and "train" in done.stdout


def test_its_exit_status_is_the_commands(tmp_path):
    error = subprocess.run([script(), "predict", str(tmp_path / "missing"), "some text"], capture_output=True, text=True)
    assert error.returncode == 1 and error.stderr.startswith("error: "), error
    assert "Traceback" not in error.stderr
    usage = subprocess.run([script(), "no-such-command"], capture_output=True, text=True)
    assert usage.returncode == 2, usage
