"""docs/commands.md's Ray job sequence, run as written, on loopback.

The fenced block of docs/commands.md that contains ``ray job submit`` is read from the
file and run line by line as a new user would, in one shell state carried from
line to line (``source``, ``export``). Only what must differ on a shared test
machine is substituted, never the commands themselves:

- ``HOME`` is a fresh temporary directory (a machine that never ran Ray: no
  ``~/.ray/auth_token``, so docs/commands.md's ``ray get-auth-token --generate`` is
  what makes the token);
- ``ray start --head`` gets ``--block``, free loopback ports and a temporary
  ``--temp-dir`` (the test owns the process, so it can stop it), and
  ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` makes Ray take 127.0.0.1 as the node
  address (it would otherwise resolve it to the host's interface address), so
  nothing leaves loopback;
- ``ray job submit`` finds that head through ``RAY_ADDRESS`` in the environment;
- ``ray stop`` (which stops every Ray instance on the machine, including those
  of other test sessions) is replaced by signalling our own ``ray start --block``.

Then the cluster must refuse a client without ``RAY_AUTH_MODE=token`` (what the
the doc warns about) and one with a wrong token.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from actors.tools.demo.run_config import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
BIN = Path(sys.executable).parent


def _plain(text: str) -> str:
    """Without terminal colour codes."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def readme_job_block() -> list[str]:
    """The command lines of docs/commands.md's fenced bash block that submits the job."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "docs" / "commands.md").read_text(), re.S)
    (block,) = [b for b in blocks if "ray job submit" in b]
    return [line for line in block.splitlines() if line.strip() and
            not line.lstrip().startswith("#")]


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _shell(lines: list[str], env: dict[str, str], tmp: Path) -> tuple[str, dict[str, str]]:
    """Run ``lines`` in bash (stop at the first failure); output and the environment after."""
    env_file = tmp / "env.out"
    script = "set -eo pipefail\n" + "\n".join(lines) + f"\nenv -0 > {shlex.quote(str(env_file))}\n"
    proc = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=700)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"doc lines failed ({proc.returncode}):\n{lines}\n{out[-5000:]}"
    pairs = (item.split("=", 1) for item in env_file.read_text().split("\0") if "=" in item)
    return out, dict(pairs)


def _start_head(line: str, env: dict[str, str], tmp: Path) -> tuple[subprocess.Popen, int, Path]:
    """docs/commands.md's ``ray start --head`` with --block and this test's ports and temp dir."""
    gcs, dash, client, agent = _free_ports(4)
    argv = shlex.split(line)
    argv[0] = shutil.which(argv[0], path=env["PATH"]) or argv[0]
    argv += ["--block", "--port", str(gcs), "--dashboard-host", "127.0.0.1",
             "--dashboard-port", str(dash), "--ray-client-server-port", str(client),
             "--dashboard-agent-listen-port", str(agent), "--temp-dir", str(tmp / "ray"),
             "--num-cpus", "8", "--disable-usage-stats"]
    log = tmp / "head.log"
    with log.open("w") as out:
        head = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if head.poll() is not None:
            pytest.fail(f"{line} exited with {head.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", dash), 1):
            return head, dash, log
        time.sleep(0.5)
    _stop(head)
    pytest.fail(f"the Ray dashboard did not listen on 127.0.0.1:{dash}:\n{log.read_text()[-3000:]}")


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
def readme_run():
    """Run the documented block; yields (job output, final env, head log); stops the head."""
    # Short: Ray's unix socket paths under the temp dir must stay within 107 bytes.
    tmp = Path(tempfile.mkdtemp(prefix="wtrm", dir="/tmp"))
    (tmp / "home").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "VIRTUAL_ENV"))}
    env.update(HOME=str(tmp / "home"), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
               RAY_USAGE_STATS_ENABLED="0")
    head, pending, output = None, [], []
    try:
        for line in readme_job_block():
            cmd = shlex.split(line)[:3]
            if cmd[:3] == ["ray", "start", "--head"]:
                if pending:
                    out, env = _shell(pending, env, tmp)
                    output.append(out)
                    pending = []
                head, dash, log = _start_head(line, env, tmp)
                env["RAY_ADDRESS"] = f"http://127.0.0.1:{dash}"
            elif cmd[:2] == ["ray", "stop"]:
                out, env = _shell(pending, env, tmp)
                output.append(out)
                pending = []
                yield "\n".join(output), env, log
                _stop(head)
            else:
                pending.append(line)
        assert head is not None and not pending, "the documented block must start and stop Ray"
    finally:
        if head is not None:
            _stop(head)
        shutil.rmtree(tmp, ignore_errors=True)


def test_the_readme_block_starts_a_head_and_the_job_succeeds(readme_run):
    out, env, head_log = readme_run
    said = _plain(out)
    assert "Local node IP: 127.0.0.1" in _plain(head_log.read_text())
    token = Path(env["HOME"]) / ".ray" / "auth_token"
    assert token.is_file()  # made by docs/commands.md's line
    assert stat.S_IMODE(token.stat().st_mode) == 0o600  # readable by its owner only
    assert re.search(r"Job '\w+' succeeded", said), said[-5000:]
    assert "all updates verified" in said and "update 3:" in said
    for column in ("version", "GB/s", "h2d", "prepare", "write", "barrier"):
        assert column in said, column


def _job_list(env: dict[str, str], **changes: str | None) -> subprocess.CompletedProcess:
    env = {**env, **changes}
    env = {k: v for k, v in env.items() if v is not None}
    return subprocess.run([shutil.which("ray", path=env["PATH"]), "job", "list"], env=env,
                          capture_output=True, text=True, timeout=60)


def test_the_cluster_refuses_clients_without_the_token_mode_or_with_a_wrong_token(readme_run):
    _, env, _ = readme_run
    assert _job_list(env).returncode == 0
    plain = _job_list(env, RAY_AUTH_MODE=None)  # what docs/commands.md's export line is for
    assert plain.returncode != 0
    assert "Authentication required" in _plain(plain.stdout + plain.stderr)
    wrong = _job_list(env, RAY_AUTH_TOKEN="not-the-token")  # RAY_AUTH_TOKEN wins over the file
    assert wrong.returncode != 0
    assert "Invalid authentication token" in _plain(wrong.stdout + wrong.stderr)
