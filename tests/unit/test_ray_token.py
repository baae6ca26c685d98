"""Ray's token stays readable by its owner only: the launch helper and docs/commands.md's
Ray job lines."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from actors.tools.demo.run_config import ROOT
from actors.tools.ray_token import private_token, protect_token


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture()
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    old = os.umask(0o022)  # the usual umask, under which Ray writes 0644
    yield tmp_path
    os.umask(old)


def test_a_token_readable_by_others_is_made_owner_only(home):
    token = home / ".ray" / "auth_token"
    token.parent.mkdir()
    token.write_text("t")
    token.chmod(0o644)
    assert protect_token() is True and mode(token) == 0o600
    assert protect_token() is False  # already private: nothing to do


def test_no_token_no_change(home):
    assert protect_token() is False and not (home / ".ray").exists()


def test_the_launch_helper_makes_a_new_cluster_s_token_0600(home):
    private_token(new_cluster=True)  # what connect_ray does before ray.init("local")
    token = home / ".ray" / "auth_token"
    assert token.is_file() and mode(token) == 0o600
    assert os.umask(0o022) == 0o022  # the process umask is back


def test_joining_a_cluster_makes_no_token(home):
    private_token(new_cluster=False)
    assert not (home / ".ray" / "auth_token").exists()


def _readme_token_lines() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "docs" / "commands.md").read_text(), re.S)
    (block,) = [b for b in blocks if "ray job submit" in b]
    return [line for line in block.splitlines()
            if "auth_token" in line or line.startswith("export RAY_AUTH_MODE")]


@pytest.mark.slow  # runs the ray command line (imports Ray)
@pytest.mark.parametrize("before", [None, 0o644])
def test_the_readme_launch_lines_leave_the_token_0600(home, before):
    token = home / ".ray" / "auth_token"
    if before is not None:  # a token made earlier, readable by everyone
        token.parent.mkdir()
        token.write_text("0" * 32)
        token.chmod(before)
    lines = _readme_token_lines()
    assert any("get-auth-token" in line for line in lines)
    env = {**os.environ, "HOME": str(home),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    script = "set -e\numask 022\n" + "\n".join(lines)
    subprocess.run([shutil.which("bash"), "-c", script], env=env, check=True, timeout=120)
    assert mode(token) == 0o600
