"""The configuration snippets of docs/configuration.md run as written ("configs from what is
live": a config.json as it is, cluster defaults and the check against the actors). The
docs/embedding.md snippet of a controller without files runs in
tests/integration/test_actors.py on live actors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from scheduling.cluster.defaults import ClusterMismatchError

ROOT = Path(__file__).resolve().parents[2]
CONFIGURATION = ROOT / "docs" / "configuration.md"


def python_block(doc: Path, heading: str) -> str:
    """The first ```python block after the line ``heading`` of ``doc``."""
    text = doc.read_text()
    found = re.search(r"```python\n(.*?)```", text[text.index(f"\n{heading}\n"):], flags=re.S)
    assert found, f"{doc.name}: no python block under {heading!r}"
    return found.group(1)


def test_the_live_model_snippet(tmp_path):
    ns = {"ckpt": str(tmp_path)}
    exec(python_block(CONFIGURATION, "## No model file with a live model"), ns)
    assert (tmp_path / "config.json").is_file()
    assert ns["same"].architecture == ns["cfg"].architecture == "qwen3"


def test_the_cluster_defaults_snippet(monkeypatch):
    monkeypatch.chdir(ROOT)  # the snippet names configs/ relative to the repository
    ns: dict = {}
    with pytest.raises(ClusterMismatchError, match=r"cluster says 4 trainer ranks .* 2 trainer "
                                                   r"actors were given"):
        exec(python_block(CONFIGURATION, "## Cluster defaults from the actors"), ns)
    assert ns["cluster"].trainer_world == 2 and ns["local"].trainer_world == 4
