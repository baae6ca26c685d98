"""The transport benchmark end to end, with tiny sizes: JSON shape and positive numbers."""

from __future__ import annotations

import json
import math

from actors.tools.bench.transport import parse_backends, run


def test_benchmark_writes_json_with_every_backend(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert run(sizes="64K,1M", repeats=2, backends="memcpy,simnic,mooncake_tcp",
               json_path=out) == 0
    doc = json.loads(out.read_text())
    assert set(doc) == {"memcpy", "simnic", "mooncake_tcp", "unavailable"}
    for name in ("memcpy", "simnic"):
        assert set(doc[name]) == {"65536", "1048576"}
        assert all(math.isfinite(v) and v > 0 for v in doc[name].values())
    # Mooncake is optional: either it measured every size or it says why not.
    if doc["mooncake_tcp"]:
        assert set(doc["mooncake_tcp"]) == {"65536", "1048576"}
        assert all(v > 0 for v in doc["mooncake_tcp"].values())
    else:
        assert doc["unavailable"]["mooncake_tcp"].startswith("unavailable")
    printed = capsys.readouterr().out
    assert "simnic / memcpy" in printed and "64 KiB" in printed and "1 MiB" in printed


def test_benchmark_runs_every_tcp_mode_beside_memcpy(tmp_path, capsys):
    out = tmp_path / "tcp.json"
    modes = ["tcp", "tcp_enc", "tcp_lz4", "tcp_zstd"]
    assert run(sizes="64K,1M", repeats=1, backends=",".join(["memcpy", *modes]),
               json_path=out) == 0
    doc = json.loads(out.read_text())
    assert doc["unavailable"] == {}
    for mode in modes:
        assert set(doc[mode]) == {"65536", "1048576"} and all(v > 0 for v in doc[mode].values())
    assert doc["tcp_window_us_per_update"] > 0


def test_benchmark_rejects_bad_arguments(tmp_path, capsys):
    assert run(sizes="1M", repeats=1, backends="memcpy,ucx", json_path=None) == 2
    assert "unknown ['ucx']" in capsys.readouterr().out
    assert run(sizes="-3", repeats=1, backends="memcpy", json_path=None) == 2
    assert run(sizes="1M", repeats=0, backends="memcpy", json_path=None) == 2
    assert parse_backends(" simnic , memcpy") == ["simnic", "memcpy"]
