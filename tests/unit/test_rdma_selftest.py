"""``wt selftest`` without an RDMA device or without pyverbs: exit code 2 and the reason."""

from __future__ import annotations

import sys

import pytest
from typer.testing import CliRunner

from actors.tools.cli.main import app
from weight_transfer.transport.rdma.verbs import rdma_unavailable_reason

needs_no_device = pytest.mark.skipif(rdma_unavailable_reason() is None,
                                     reason="an RDMA device is present: see tests/integration")


@pytest.mark.pyverbs
@needs_no_device
def test_selftest_without_a_device_exits_2_with_the_reason():
    result = CliRunner().invoke(app, ["selftest", "--size", "1M"])
    assert result.exit_code == 2, result.output
    assert "no RDMA device found (asked for the first device)" in result.output
    assert "simnic" in result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


@pytest.mark.pyverbs
@needs_no_device
def test_selftest_names_the_device_asked_for():
    result = CliRunner().invoke(app, ["selftest", "--device", "mlx5_3"])
    assert result.exit_code == 2
    assert "asked for device 'mlx5_3'" in result.output


def test_selftest_without_pyverbs_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyverbs.addr", None)  # `import pyverbs.addr` fails
    result = CliRunner().invoke(app, ["selftest", "--size", "1M"])
    assert result.exit_code == 2, result.output
    out = " ".join(result.output.split())  # rich may wrap long lines
    assert "needs pyverbs, which is not importable" in out
    assert "python3-pyverbs" in out and "setup_pyverbs.py" in out
    assert "Traceback" not in result.output


def test_selftest_rejects_a_bad_size_before_touching_the_device():
    result = CliRunner().invoke(app, ["selftest", "--size", "12Q"])
    assert result.exit_code == 2
    assert "bad size '12Q'" in result.output
