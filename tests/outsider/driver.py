"""Drive an outsider program from a test: one process, one JSON command per call."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

STORE_CLIENT = Path(__file__).parent / "store_client.py"


class Outsider:
    """The outsider at a TCPStore (``store_client.py``), started once, asked per call::

        o = Outsider(); o(op="list", host="127.0.0.1", port=p)["keys"]; o.close()
    """

    def __init__(self, program: Path = STORE_CLIENT) -> None:
        self.proc = subprocess.Popen([sys.executable, str(program)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert json.loads(self.proc.stdout.readline()) == {"ready": True}

    def __call__(self, **cmd: object) -> dict:
        out = self.attempt(**cmd)
        assert "error" not in out, out
        return out

    def attempt(self, **cmd: object) -> dict:
        """The answer, an ``{"error": ...}`` one included (an attack that fails)."""
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)

    def __enter__(self) -> Outsider:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


CHURN = Path(__file__).parent / "churn.py"


class Churn:
    """Outsider processes churning connections to ``host:port`` (``churn.py``), each
    keeping its last ``hold`` open; :meth:`stop` ends them and gives their counts::

        flood = Churn("127.0.0.1", port, processes=3); ...; flood.stop()
    """

    def __init__(self, host: str, port: int, *, processes: int = 3, hold: int = 0) -> None:
        self.procs = [subprocess.Popen([sys.executable, str(CHURN), host, str(port), str(hold)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                      for _ in range(processes)]
        for proc in self.procs:
            assert proc.stdout.readline().strip() == "ready"

    def running(self) -> bool:
        return all(proc.poll() is None for proc in self.procs)

    def stop(self) -> list[dict]:
        """``{"connections": n, "errors": m}`` of each process, once all have ended."""
        for proc in self.procs:
            proc.stdin.close()
        out = [json.loads(proc.stdout.readline()) for proc in self.procs]
        for proc in self.procs:
            proc.wait(30)
        return out
