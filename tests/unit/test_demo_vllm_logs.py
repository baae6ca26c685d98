"""``wt demo --engine vllm`` keeps vLLM's own logs at WARNING unless ``--verbose``.

The level reaches vLLM as ``VLLM_LOGGING_LEVEL`` (read when a process imports vLLM) in
this process and in the engines' (their ``env``); one set in the environment wins. The
end-to-end check that the demo's output has no INFO line of vLLM's is in
tests/integration/test_demo_vllm.py (no extra engine start).
"""

from __future__ import annotations

import logging
import os

import pytest
from typer.testing import CliRunner

from actors.tools.cli.main import app
from actors.tools.demo import vllm_demo as demo_vllm


@pytest.mark.parametrize(("env", "verbose", "level"), [
    (None, False, "WARNING"), (None, True, "INFO"), ("DEBUG", False, "DEBUG"),
    ("ERROR", True, "ERROR"),
])
def test_the_level_is_warning_unless_verbose_or_set(monkeypatch, env, verbose, level):
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    if env is not None:
        monkeypatch.setenv("VLLM_LOGGING_LEVEL", env)
    assert demo_vllm.vllm_log_level(verbose=verbose) == level


def test_the_engines_get_the_level_and_the_demos_own_variables():
    env = demo_vllm.engine_env("WARNING")
    assert env["VLLM_LOGGING_LEVEL"] == "WARNING"
    assert env.items() >= demo_vllm.ENGINE_ENV.items()


def test_setting_the_level_here_sets_the_variable_and_the_vllm_logger(monkeypatch):
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")  # restored (or removed) after the test
    logger = logging.getLogger("vllm")
    monkeypatch.setattr(logger, "level", logger.level)  # restored after the test
    demo_vllm.set_vllm_log_level("WARNING")
    assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"
    assert logger.level == logging.WARNING


def test_wt_demo_has_a_verbose_option():
    out = CliRunner().invoke(app, ["demo", "--help"], env={"COLUMNS": "200"})
    assert out.exit_code == 0 and "--verbose" in out.output
