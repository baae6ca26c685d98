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
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        out = json.loads(self.proc.stdout.readline())
        assert "error" not in out, out
        return out

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)
