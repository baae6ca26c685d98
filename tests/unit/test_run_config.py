"""Run configs: every shipped YAML loads, and bad input is a ValueError naming file and field."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.tools.demo.run_config import ROOT, load_run_config, parse_run_config, resolve_path

RUNS = sorted((ROOT / "configs" / "runs").glob("*.yaml"))
TINY = "configs/models/tiny_llama.yaml"


@pytest.mark.parametrize("path", RUNS, ids=[p.stem for p in RUNS])
def test_shipped_run_configs_load_and_name_existing_files(path):
    run = load_run_config(path)
    assert run.model_path.is_file() and run.cluster_path.is_file()
    assert run.updates >= 1


def test_demo_run_is_tiny_llama_bf16_on_the_local_cluster():
    run = load_run_config("configs/runs/demo.yaml")
    assert (run.model_path.name, run.cluster_path.name, run.fp8) == (
        "tiny_llama.yaml", "local_cpu.yaml", False)
    assert 3 <= run.updates <= 5


def test_relative_paths_resolve_from_the_repository_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the model path does not exist from here
    run = parse_run_config({"model": TINY}, source="x.yaml")
    assert run.model_path == ROOT / TINY
    assert resolve_path("/abs/none.yaml") == Path("/abs/none.yaml")


@pytest.mark.parametrize(
    ("data", "field", "words"),
    [
        ({"model": TINY, "updates": 0}, "updates", "greater than or equal to 1"),
        ({"model": TINY, "train": {"lr": -1.0}}, "train.lr", "greater than 0"),
        ({"model": TINY, "verify": {"prompts": 0}}, "verify.prompts", "greater than 0"),
        ({"model": TINY, "bogus": 1}, "bogus", "Extra inputs are not permitted"),
        ({"model": TINY, "ray": {"num_cpus": "many"}}, "ray.num_cpus", "valid integer"),
        ({"updates": 2}, "model", "Field required"),
        ({"model": "configs/models/none.yaml"}, "model", "no such file"),
        ({"model": TINY, "cluster": "nope.yaml"}, "cluster", "no such file"),
    ],
)
def test_bad_fields_are_named_with_the_file(data, field, words):
    with pytest.raises(ValueError, match=r"runs/bad\.yaml") as err:
        parse_run_config(data, source="runs/bad.yaml")
    assert f"field {field}:" in str(err.value)
    assert words in str(err.value)


def test_a_yaml_that_is_not_a_mapping_or_not_yaml_is_refused(tmp_path):
    listed = tmp_path / "list.yaml"
    listed.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match=r"list.yaml: a run config must be a mapping, not list"):
        load_run_config(listed)
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed\n")
    with pytest.raises(ValueError, match=r"broken.yaml: cannot read run config"):
        load_run_config(broken)
    with pytest.raises(ValueError, match=r"missing.yaml: cannot read run config"):
        load_run_config(tmp_path / "missing.yaml")


def test_overrides_win_and_are_validated():
    run = load_run_config("configs/runs/demo.yaml")
    changed = run.with_overrides(fp8=True, updates=2, json_path="out.json", seed=None)
    assert (changed.fp8, changed.updates, changed.json_path, changed.seed) == (
        True, 2, Path("out.json"), run.seed)
    assert run.fp8 is False  # the original is unchanged (frozen)
    with pytest.raises(ValueError, match="field updates:"):
        run.with_overrides(updates=-1)


def test_the_trainer_is_a_registered_name_fsdp2_by_default():
    from actors.ready.trainer import TrainerActor
    from actors.tools.demo.fleet import trainer_class
    from actors.tools.demo.trainers import register_trainer, trainer_names

    run = load_run_config("configs/runs/demo.yaml")
    assert run.trainer == "fsdp2" and trainer_class(run) is None  # launch_trainers' own
    assert {"fsdp2", "deepspeed"} <= set(trainer_names())
    assert run.with_overrides(trainer="deepspeed").trainer == "deepspeed"
    with pytest.raises(ValueError, match=r"field trainer:.*unknown trainer 'jax' \(choose "
                                         r"from deepspeed, fsdp2"):
        run.with_overrides(trainer="jax")
    with pytest.raises(ValueError, match="must be 'module:attribute'"):
        register_trainer("megatron", "no_colon")
    from actors.tools.demo.trainers import trainer_actor

    assert trainer_actor("fsdp2") is TrainerActor


def test_wt_demo_and_launch_refuse_bad_input_before_starting_anything(tmp_path):
    import typer
    from typer.testing import CliRunner

    from actors.tools.cli.main import app
    from actors.tools.demo import launch

    bad = tmp_path / "bad.yaml"
    bad.write_text(f"model: {TINY}\nupdates: 0\n")
    runner = CliRunner()
    result = runner.invoke(app, ["demo", "--config", str(bad)])
    assert result.exit_code == 2
    # rich wraps long paths anywhere (even before the colon): compare without whitespace
    assert "bad.yaml:invalidrunconfig:fieldupdates" in "".join(result.output.split())
    result = runner.invoke(app, ["demo", "--model", "configs/models/none.yaml"])
    assert result.exit_code == 2 and "field model: no such file" in " ".join(result.output.split())
    result = runner.invoke(app, ["demo", "--trainer", "jax"])
    assert result.exit_code == 2 and "unknown trainer 'jax'" in " ".join(result.output.split())
    launcher = typer.Typer()
    launcher.command()(launch.main)
    result = runner.invoke(launcher, ["--config", str(bad)])
    assert result.exit_code == 2 and "field updates" in " ".join(result.output.split())


@pytest.mark.parametrize("integrity", ["off", "full", {"mode": "sample", "fraction": 0.5}])
def test_a_run_with_any_integrity_mode_takes_command_line_overrides(integrity):
    run = load_run_config(ROOT / "configs" / "runs" / "demo.yaml")
    data = run.model_dump(by_alias=True)
    data["transfer"]["integrity"] = integrity
    run = parse_run_config(data, source="test")
    again = run.with_overrides(updates=1)  # dumps and validates the whole run again
    assert again.transfer.integrity == run.transfer.integrity and again.updates == 1
