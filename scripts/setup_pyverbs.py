"""Make the distribution's pyverbs importable inside this virtual environment.

PyPI's pyverbs needs a newer libibverbs than Debian 12 ships, so we reuse the
``python3-pyverbs`` package built against the system rdma-core. Only the
``pyverbs`` package is exposed (through a one-entry directory and a ``.pth``
file), not the rest of the system's dist-packages.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path


def find_system_pyverbs() -> Path | None:
    try:
        out = subprocess.run(
            ["dpkg", "-L", "python3-pyverbs"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    for line in out.splitlines():
        if line.endswith("/pyverbs/__init__.py"):
            return Path(line).parent
    return None


def main() -> int:
    try:
        import pyverbs  # noqa: F401

        print("pyverbs: already importable")
        return 0
    except ImportError:
        pass
    src = find_system_pyverbs()
    if src is None:
        print("pyverbs: python3-pyverbs is not installed; the rdma transport will be unavailable")
        return 0
    shim = Path(sys.prefix) / "pyverbs-shim"
    shim.mkdir(exist_ok=True)
    link = shim / "pyverbs"
    if not link.exists():
        os.symlink(src, link)
    pth = Path(site.getsitepackages()[0]) / "system_pyverbs.pth"
    pth.write_text(f"{shim}\n")
    print(f"pyverbs: linked {src} into {shim}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
