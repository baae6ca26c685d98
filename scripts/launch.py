"""The entry point for ``ray job submit``: runs the demo job of a run config
(:mod:`actors.tools.demo.launch`) on the cluster it runs in::

    ray job submit --working-dir . -- python scripts/launch.py --config configs/runs/demo.yaml
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python scripts/launch.py` puts scripts/ first, not the root
    sys.path.insert(0, str(ROOT))

if __name__ == "__main__":
    import typer

    from actors.tools.demo.launch import main

    typer.run(main)
