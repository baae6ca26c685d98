"""The documentation stays true: links resolve, and the configuration reference lists every
field of every configuration model.

- Every relative link in README.md and docs/*.md points to a file (or folder)
  of the repository; the README links only inside the repository.
- docs/configuration.md has one section per configuration model, its heading
  naming the model (``module.Class``), with a table row for each field (the
  YAML key, so the alias where a field has one).
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")

CONFIG_MODELS = (
    "weight_transfer.model.models.ModelConfig",
    "scheduling.cluster.config.ClusterConfig",
    "scheduling.cluster.config.TrainerCluster",
    "scheduling.cluster.megatron.MegatronLayout",
    "scheduling.cluster.config.InferenceCluster",
    "scheduling.cluster.config.SimConfig",
    "actors.tools.demo.run_config.RunConfig",
    "actors.tools.demo.run_config.TrainConfig",
    "actors.tools.demo.run_config.VerifyConfig",
    "actors.tools.demo.run_config.RayConfig",
    "actors.tools.demo.run_config.RlConfig",
    "actors.config.TransferSettings",
    "actors.config.TransferConfig",
    "actors.config.DemoActorConfig",
    "weight_transfer.integrity.checksums.IntegrityPolicy",
    "weight_transfer.sender.retry.RetryPolicy",
)


def links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # code is not a link
    return [a or b for a, b in LINK.findall(text)]


def test_there_is_documentation_to_check():
    names = {p.name for p in DOCS}
    assert {"architecture.md", "embedding.md", "transports.md", "configuration.md",
            "observability.md", "performance.md"} <= names


@pytest.mark.parametrize("doc", [ROOT / "README.md", *DOCS], ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    bad = []
    for target in links(doc):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor in the same file
        path = (doc.parent / target.split("#")[0]).resolve()
        if not path.exists() or not path.is_relative_to(ROOT):
            bad.append(target)
    assert not bad, f"{doc.name}: links to nothing in the repository: {bad}"


def test_the_readme_links_only_inside_the_repository():
    outside = [t for t in links(ROOT / "README.md") if re.match(r"[a-z]+:", t)]
    assert not outside, outside


def _fields(qualname: str) -> list[str]:
    module, _, name = qualname.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls)]
    # A model deriving from another documented one lists its own fields (the section of
    # the base describes the rest).
    inherited = {n for base in cls.__mro__[1:] if f"{base.__module__}.{base.__qualname__}"
                 in CONFIG_MODELS for n in getattr(base, "model_fields", {})}
    return [f.alias or n for n, f in cls.model_fields.items() if n not in inherited]


def _sections(text: str) -> dict[str, str]:
    """Markdown sections by the ``(module.Class)`` their heading names."""
    out, current = {}, None
    for line in text.splitlines():
        m = re.match(r"#+ .*\(([\w.]+)\)\s*$", line)
        if line.startswith("#"):
            current = m.group(1) if m else None
            if current:
                out[current] = ""
        elif current:
            out[current] += line + "\n"
    return out


@pytest.mark.parametrize("model", CONFIG_MODELS)
def test_the_configuration_reference_lists_every_field(model):
    sections = _sections((ROOT / "docs" / "configuration.md").read_text())
    assert model in sections, f"docs/configuration.md has no section headed ({model})"
    rows = set(re.findall(r"^\| `([\w.]+)` \|", sections[model], flags=re.M))
    missing = [f for f in _fields(model) if f not in rows]
    assert not missing, f"docs/configuration.md ({model}) does not describe {missing}"
    stale = sorted(rows - set(_fields(model)))
    assert not stale, f"docs/configuration.md ({model}) describes fields that are gone: {stale}"
