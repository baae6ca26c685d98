"""Asynchronous RL over served vLLM replicas with bounded staleness
(:mod:`actors.tools.demo.async_rl`)::

    python scripts/async_rl.py [--replicas 1] [--steps 4] [--batch 8] [--max-lag 1] [--json PATH]
"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python scripts/async_rl.py` puts scripts/ first, not the root
    sys.path.insert(0, str(ROOT))


def main(replicas: int = 1, steps: int = 4, batch: int = 8, max_lag: int = 1,
         rollout_tokens: int = 16, json_path: Path | None = None) -> None:
    """Rollouts stream from served vLLM replicas while the trainers train and update them."""
    import ray

    from actors.tools.demo.async_rl import AsyncRlSettings, print_summary, run
    from actors.tools.demo.checks import make_console

    s = AsyncRlSettings(replicas=replicas, steps=steps, batch=batch, max_lag=max_lag,
                        rollout_tokens=rollout_tokens)
    console = make_console()
    from actors.tools.demo.fleet import LOCAL_NODE_IP
    from actors.tools.ray_token import private_token

    private_token(new_cluster=True)  # a fresh local instance, its token 0600
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
             _node_ip_address=LOCAL_NODE_IP)
    try:
        summary = run(s, console)
    finally:
        ray.shutdown()
    print_summary(summary, s, console)
    if json_path is not None:
        json_path.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    import typer

    typer.run(main)
