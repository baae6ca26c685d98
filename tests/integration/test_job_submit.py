"""``ray job submit`` of scripts/launch.py against a ``ray start --head`` cluster on loopback.

The head runs in a temporary directory with token authentication on (Ray 2.60's
default for local clusters, set explicitly here): ``RAY_AUTH_MODE=token`` and
a fresh token in a file named by ``RAY_AUTH_TOKEN_PATH``, which ``ray start``,
``ray job submit`` and the job's driver all read. ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``
makes Ray take 127.0.0.1 as the node address (it would otherwise resolve
"127.0.0.1" to the host's interface address), so nothing leaves loopback.

The head is stopped by signalling its own ``ray start --block`` process, not
with ``ray stop``, which would stop every Ray instance on the machine,
including those of other test sessions.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from scripts.run_config import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
BIN = Path(sys.executable).parent


def _plain(text: str) -> str:
    """Without terminal colour codes."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _ray_env(tmp: Path) -> dict[str, str]:
    token = tmp / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token),
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0",
               PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    return env


def _wait_for_dashboard(port: int, head: subprocess.Popen, log: Path, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if head.poll() is not None:
            pytest.fail(f"ray start exited with {head.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        time.sleep(0.5)
    pytest.fail(f"the Ray dashboard did not listen on 127.0.0.1:{port}:\n{log.read_text()[-3000:]}")


def _stop(head: subprocess.Popen) -> None:
    """SIGTERM to our ``ray start --block``: it drains and stops the processes it started."""
    if head.poll() is None:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait(10)
    with contextlib.suppress(ProcessLookupError):  # anything left in its process group
        os.killpg(head.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def ray_head():
    # Short: Ray's unix socket paths under the temp dir must stay within 107 bytes.
    tmp_path = Path(tempfile.mkdtemp(prefix="wtray", dir="/tmp"))
    env = _ray_env(tmp_path)
    gcs, dash, client, agent = _free_ports(4)
    log = tmp_path / "head.log"
    cmd = [str(BIN / "ray"), "start", "--head", "--block", "--port", str(gcs),
           "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash),
           "--ray-client-server-port", str(client), "--dashboard-agent-listen-port", str(agent),
           "--temp-dir", str(tmp_path / "ray"), "--num-cpus", "8", "--disable-usage-stats"]
    with log.open("w") as out:
        head = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        _wait_for_dashboard(dash, head, log)
        yield env, f"http://127.0.0.1:{dash}", log
    finally:
        _stop(head)
        shutil.rmtree(tmp_path, ignore_errors=True)


def test_ray_job_submit_runs_the_demo_and_succeeds(ray_head):
    env, address, head_log = ray_head
    assert "Local node IP: 127.0.0.1" in _plain(head_log.read_text())
    job_id = f"wt_demo_{secrets.token_hex(4)}"
    submit = subprocess.run(
        [str(BIN / "ray"), "job", "submit", "--address", address, "--submission-id", job_id,
         "--working-dir", ".", "--", "python", "scripts/launch.py",
         "--config", "configs/runs/demo.yaml", "--updates", "2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=500)
    logs = submit.stdout + submit.stderr
    assert submit.returncode == 0, logs[-5000:]
    status = subprocess.run(
        [str(BIN / "ray"), "job", "status", "--address", address, job_id],
        env=env, capture_output=True, text=True, timeout=60)
    said = _plain(status.stdout + status.stderr)
    assert f"Job '{job_id}' succeeded" in said, said  # the CLI's words for SUCCEEDED
    job_logs = subprocess.run(
        [str(BIN / "ray"), "job", "logs", "--address", address, job_id],
        env=env, capture_output=True, text=True, timeout=60).stdout
    assert "all updates verified" in job_logs, job_logs[-5000:]
    assert "update 2:" in job_logs and "verified" in job_logs
    for column in ("version", "GB/s", "h2d", "prepare", "write", "barrier"):
        assert column in job_logs, column


def test_the_cluster_refuses_a_wrong_token(ray_head):
    env, address, _ = ray_head

    def job_list(**extra):
        return subprocess.run([str(BIN / "ray"), "job", "list", "--address", address],
                              env={**env, **extra}, capture_output=True, text=True, timeout=60)

    assert job_list().returncode == 0
    wrong = job_list(RAY_AUTH_TOKEN="not-the-token")  # RAY_AUTH_TOKEN wins over the file
    assert wrong.returncode != 0
    assert "Invalid authentication token" in _plain(wrong.stdout + wrong.stderr)
