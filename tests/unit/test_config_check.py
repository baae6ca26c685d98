"""``wt config check``: good and bad files of each kind, the kind detected or given."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from actors.tools.cli.config_cmd import check, detect_kind
from actors.tools.cli.main import app
from actors.tools.demo.run_config import ROOT

CONFIGS = ROOT / "configs"
runner = CliRunner()


def wt(*args: object):
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


def flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("path,kind,facts", [
    ("models/tiny_llama.yaml", "model", ["trainer parameters", "hidden_size", "256"]),
    ("models/kimi_k2.yaml", "model", ["n_routed_experts", "384", "trainer parameters"]),
    ("clusters/local_cpu.yaml", "cluster", ["trainer.nodes", "inference.tensor_parallel",
                                           "trainer ranks / NICs", "4 / 4"]),
    ("runs/demo.yaml", "run", ["train.lr", "verify.max_new_tokens", "model file",
                               "tiny-llama"]),
])
def test_good_files_print_what_they_resolved_to(path, kind, facts):
    r = wt("config", "check", CONFIGS / path)
    assert r.exit_code == 0, r.output
    out = flat(r.output)
    assert f"a valid {kind} config" in out
    for word in facts:
        assert word in out, word
    assert "default" in out and "file" in out  # where each value came from


def _write(tmp_path: Path, name: str, data: object) -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return p


def _load(rel: str) -> dict:
    return yaml.safe_load((CONFIGS / rel).read_text())


@pytest.mark.parametrize("rel,change,field,expected", [
    ("models/tiny_llama.yaml", {"hidden_size": 0}, "hidden_size", "greater than 0 (got 0)"),
    ("models/tiny_llama.yaml", {"architecture": "gpt9"}, "architecture", "gpt9"),
    ("models/tiny_llama.yaml", {"colour": "red"}, "colour", "Extra inputs are not permitted"),
    ("clusters/local_cpu.yaml", {"trainer": {"nodes": "two", "gpus_per_node": 2,
                                             "nics_per_node": 2, "nic_gbps": 8}},
     "trainer.nodes", "valid integer"),
    ("clusters/local_cpu.yaml", {"inference": None}, "inference", "valid dictionary"),
    ("runs/demo.yaml", {"updates": 0}, "updates", "greater than or equal to 1 (got 0)"),
    ("runs/demo.yaml", {"model": "configs/models/nope.yaml"}, "model", "no such file"),
])
def test_bad_files_name_the_file_the_field_and_what_was_expected(tmp_path, rel, change, field,
                                                                 expected):
    path = _write(tmp_path, "bad.yaml", {**_load(rel), **change})
    r = wt("config", "check", path)
    assert r.exit_code == 2, r.output
    out = flat(r.output)
    assert str(path) in out and f"field {field}:" in out and expected in out


def test_the_kind_can_be_forced_and_a_wrong_one_fails(tmp_path):
    model = CONFIGS / "models" / "tiny_llama.yaml"
    assert wt("config", "check", model, "--kind", "model").exit_code == 0
    r = wt("config", "check", model, "--kind", "cluster")
    assert r.exit_code == 2 and "invalid cluster config" in flat(r.output)
    assert "--kind must be one of" in flat(wt("config", "check", model, "--kind", "x").output)


@pytest.mark.parametrize("data,kind", [
    ({"architecture": "llama"}, "model"),
    ({"name": "c", "trainer": {}, "inference": {}}, "cluster"),
    ({"model": "m.yaml"}, "run"),
])
def test_detect_kind(data, kind):
    assert detect_kind(data, Path("x.yaml")) == kind


@pytest.mark.parametrize("text", ["- a\n- b\n", "name: only\n", "{unclosed\n"])
def test_files_of_no_known_kind_or_not_yaml_exit_2(tmp_path, text):
    path = tmp_path / "odd.yaml"
    path.write_text(text)
    r = wt("config", "check", path)
    assert r.exit_code == 2 and str(path) in flat(r.output)
    with pytest.raises(ValueError, match=r"odd\.yaml"):
        check(path)


def test_a_missing_file_exits_2(tmp_path):
    r = wt("config", "check", tmp_path / "none.yaml")
    assert r.exit_code == 2 and "no such file" in flat(r.output)
