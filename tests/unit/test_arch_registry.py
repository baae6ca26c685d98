"""The architecture registry: lookup by name, lazy import, registration, config validation."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import weight_transfer.model.arch as registry
from weight_transfer.model.arch import (
    Architecture,
    architecture_names,
    get_architecture,
    register_architecture,
)
from weight_transfer.model.arch.llama import Llama
from weight_transfer.model.models import ModelConfig, load_model_config, trainer_param_specs
from weight_transfer.model.naming import bound_rules, name_problems

ROOT = Path(__file__).resolve().parents[2]
BUILTIN = ("deepseek_v3", "llama", "mixtral", "qwen2", "qwen3", "qwen3_moe")


class _WithQkNorm(Llama):
    """A test-only variant: Llama with Qwen3's q/k norms, registered from this module."""

    name = "llama_qk_norm"
    qk_norm = True


VARIANT = _WithQkNorm()
NOT_AN_ARCHITECTURE = object()


@pytest.fixture
def scratch_registry(monkeypatch):
    """Registrations made by a test are undone after it."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_LOADED", dict(registry._LOADED))


def test_builtin_architectures_by_name():
    assert set(BUILTIN) <= set(architecture_names())
    for name in BUILTIN:
        arch = get_architecture(name)
        assert isinstance(arch, Architecture) and arch.name == name
        assert get_architecture(name) is arch
        assert type(arch).__module__ == f"weight_transfer.model.arch.{name}"


def test_unknown_architecture_lists_the_known_names():
    with pytest.raises(ValueError, match="unknown architecture 'gpt2'; known: deepseek_v3, llama"):
        get_architecture("gpt2")


def test_model_config_is_validated_against_the_registry(tmp_path):
    path = tmp_path / "gpt2.yaml"
    text = (ROOT / "configs/models/tiny_llama.yaml").read_text()
    path.write_text(text.replace("architecture: llama", "architecture: gpt2"))
    with pytest.raises(ValueError, match=r"field architecture: .*known: .*mixtral") as info:
        load_model_config(path)
    assert str(path) in str(info.value)


def test_modules_are_imported_on_first_use_and_import_no_torch():
    code = (
        "import sys, weight_transfer.model.arch as a, weight_transfer.model.models\n"
        "assert 'weight_transfer.model.arch.mixtral' not in sys.modules\n"
        "arch = a.get_architecture('mixtral')\n"
        "assert 'weight_transfer.model.arch.mixtral' in sys.modules\n"
        "assert 'weight_transfer.model.arch.deepseek_v3' not in sys.modules\n"
        "for name in a.architecture_names(): a.get_architecture(name)\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_registered_architecture_is_usable_by_configs(scratch_registry):
    register_architecture("llama_qk_norm", __name__, "VARIANT")
    register_architecture("llama_qk_norm", __name__, "VARIANT")  # same target: no-op
    base = load_model_config(ROOT / "configs/models/tiny_llama.yaml")
    cfg = ModelConfig(**{**base.model_dump(), "architecture": "llama_qk_norm"})
    assert cfg.arch is VARIANT and "llama_qk_norm" in architecture_names()
    names = [s.name for s in trainer_param_specs(cfg)]
    assert "model.layers.1.self_attn.q_norm.weight" in names
    assert "model.layers.1.self_attn.k_norm.weight" in {r.engine for r in bound_rules(cfg)}
    assert name_problems(cfg, "per_expert", names, ()) == []


def test_registration_errors(scratch_registry):
    with pytest.raises(ValueError, match="'llama' is already registered as weight_transfer"):
        register_architecture("llama", __name__, "VARIANT")
    register_architecture("broken", __name__, "NOT_AN_ARCHITECTURE")
    with pytest.raises(ValueError, match=r"'broken': .*NOT_AN_ARCHITECTURE is not an Architecture"):
        get_architecture("broken")


@pytest.mark.parametrize(
    ("name", "moe_layers"),
    [("tiny_llama", []), ("tiny_moe", [1, 2]), ("tiny_deepseek_v3", [1, 2]),
     ("tiny_mixtral", [0, 1])],
)
def test_moe_layers_come_from_the_architecture(name, moe_layers):
    cfg = load_model_config(ROOT / f"configs/models/{name}.yaml")
    assert [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)] == moe_layers
    assert (cfg.n_experts > 0) == bool(moe_layers)
