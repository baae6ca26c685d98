"""An OpenRLHF-style RL loop with weight transfer (:mod:`actors.tools.demo.rl_loop`)::

    python scripts/rl_loop.py --config configs/runs/rl_loop.yaml [--iterations N] [--json PATH]
    python scripts/rl_loop.py --engine vllm --cluster configs/clusters/vllm_cpu_tp1.yaml
    python scripts/rl_loop.py --overlap --max-lag 0   # rollouts during updates; stale dropped
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python scripts/rl_loop.py` puts scripts/ first, not the root
    sys.path.insert(0, str(ROOT))

if __name__ == "__main__":
    import typer

    from actors.tools.demo.rl_loop import main

    typer.run(main)
