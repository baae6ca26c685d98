"""Transport by configuration: each bad choice fails at setup, naming the field and the actors.

Pure: ``TransferConfig`` and run YAML validation, the typed options of each
transport, the registry behind ``TransportSpec.open``, and the host check the
controller runs before any NIC connects (here through its ``Connector`` with
direct calls instead of Ray).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from actors.config import TransferConfig, TransferSettings
from actors.connections import Connector
from actors.tools.demo.run_config import parse_run_config
from scheduling.cluster.config import load_cluster_config
from weight_transfer.model.models import load_model_config
from weight_transfer.transport import fault_injection, make_transport
from weight_transfer.transport.handshake import HostId, reaches, unreachable_links
from weight_transfer.transport.mooncake.transport import MooncakeOptions
from weight_transfer.transport.options import DEFAULT_TRANSPORT, parse_transport
from weight_transfer.transport.simnic.nic import SimNicOptions
from weight_transfer.types import EngineRankMeta, EngineTensorMeta, RegionDesc, ShardSpec

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = "configs/models/tiny_llama.yaml"
A = HostId(hostname="node-a", address="10.0.0.1")
B = HostId(hostname="node-b", address="10.0.0.2")


@pytest.fixture(scope="module")
def cfg() -> TransferConfig:
    return TransferConfig.from_files(CONFIGS / "models" / "tiny_llama.yaml",
                                     CONFIGS / "clusters" / "local_cpu.yaml")


# ------------------------------------------------------------------------ TransferConfig


def test_the_default_is_simnic_with_default_options(cfg):
    assert cfg.transport == "simnic"
    assert cfg.transport_spec == DEFAULT_TRANSPORT
    capped = cfg.replace(nic_gbps=2.0)
    assert capped.transport_spec.options.bandwidth_gbps == 2.0  # nic_gbps: the simnic cap


@pytest.mark.parametrize(
    ("transport", "options", "want"),
    [
        ("simnic", {"bandwidth_gbps": 2, "latency_us": 5}, SimNicOptions(bandwidth_gbps=2.0,
                                                                          latency_us=5.0)),
        ("mooncake", {"protocol": "tcp", "hostname": "10.1.2.3"},
         MooncakeOptions(hostname="10.1.2.3")),
        ("mooncake", None, MooncakeOptions()),
    ],
)
def test_options_are_typed_per_transport(cfg, transport, options, want):
    new = cfg.replace(transport=transport, transport_options=options)
    assert new.transport_spec.kind == transport and new.transport_spec.options == want
    assert new.replace() == new  # replace() takes the typed options back


@pytest.mark.parametrize(
    ("changes", "field", "words"),
    [
        ({"transport": "pigeon"}, "TransferConfig.transport",
         "unknown transport 'pigeon' (used by every trainer and engine NIC); known: "
         "['mooncake', 'rdma', 'simnic', 'tcp']"),
        ({"transport": None}, "TransferConfig.transport", "unknown transport None"),
        ({"transport_options": {"bandwidth": 2}}, "TransferConfig.transport_options",
         "unknown option(s) ['bandwidth'] for transport 'simnic' (used by every trainer and "
         "engine NIC); known: ['bandwidth_gbps', 'chunk_bytes', 'latency_us', 'max_inflight']"),
        ({"transport_options": {"bandwidth_gbps": "fast"}},
         "TransferConfig.transport_options.bandwidth_gbps", "Input should be a valid number"),
        ({"transport_options": {"bandwidth_gbps": -1.0}},
         "TransferConfig.transport_options.bandwidth_gbps", "greater than 0"),
        ({"transport_options": {"max_inflight": 2.5}},
         "TransferConfig.transport_options.max_inflight", "valid integer"),
        ({"transport_options": ["bandwidth_gbps"]}, "TransferConfig.transport_options",
         "must be a mapping of option names to values, not list"),
        ({"transport": "mooncake", "transport_options": {"protocol": "udp"}},
         "TransferConfig.transport_options.protocol", "Input should be 'tcp' or 'rdma'"),
        ({"transport": "mooncake", "transport_options": {"hostname": 7}},
         "TransferConfig.transport_options.hostname", "valid string"),
        ({"transport": "rdma", "transport_options": {"gid_index": "3"}},
         "TransferConfig.transport_options.gid_index", "valid integer"),
        ({"transport": "rdma", "transport_options": {"port": True}},
         "TransferConfig.transport_options.port", "valid integer"),
        ({"transport": "rdma", "transport_options": {"dev": "mlx5_0"}},
         "TransferConfig.transport_options", "unknown option(s) ['dev'] for transport 'rdma'"),
        ({"transport": "mooncake"}, "TransferConfig.transport_options",
         "SimNicOptions given for transport 'mooncake'"),
        ({"transport": "mooncake", "transport_options": None, "nic_gbps": 1.0},
         "TransferConfig.nic_gbps", "caps simulated NICs only; transport is 'mooncake'"),
        ({"transport_options": {"bandwidth_gbps": 1.0}, "nic_gbps": 2.0},
         "TransferConfig.nic_gbps", "disagree"),
    ],
)
def test_bad_transport_config_names_the_field(cfg, changes, field, words):
    with pytest.raises(ValueError) as err:
        cfg.replace(**changes)
    assert str(err.value).startswith(field), str(err.value)
    assert words in str(err.value)
    assert "trainer and engine NIC" in str(err.value)  # the actors concerned


# ------------------------------------------------------------------------ run YAML


@pytest.mark.parametrize(
    ("transfer", "field", "words"),
    [
        ({"transport": "pigeon"}, "transfer.transport",
         "transfer.transport: unknown transport 'pigeon' (used by every trainer and "
         "engine NIC); known: ['mooncake', 'rdma', 'simnic', 'tcp']"),
        ({"transport_options": {"bandwidth_gbps": "fast"}},
         "transfer.transport_options.bandwidth_gbps",
         "Input should be a valid number (got 'fast')"),
        ({"transport": "mooncake", "transport_options": {"bogus": 1}}, "transfer.transport_options",
         "transfer.transport_options: unknown option(s) ['bogus'] for transport "
         "'mooncake'"),
        ({"transport": "rdma", "transport_options": {"port": 1.5}},
         "transfer.transport_options.port", "Input should be a valid integer (got 1.5)"),
        ({"watermark_bytes": 0}, "transfer.watermark_bytes", "greater than 0"),
        ({"metric": "ray"}, "transfer.metric", "Extra inputs"),
        # The run file's names of earlier versions: an error naming the field that replaced it.
        ({"timeout_s": 300}, "transfer",
         "transfer.timeout_s was renamed: use transfer.setup_timeout_s and update_timeout_s"),
        ({"simnic": {"latency_us": 1}}, "transfer",
         "transfer.simnic was renamed: use transfer.transport_options"),
    ],
)
def test_bad_transport_in_a_run_yaml_names_the_file_and_field(transfer, field, words):
    with pytest.raises(ValueError, match=r"runs/bad\.yaml") as err:
        parse_run_config({"model": TINY, "transfer": transfer}, source="runs/bad.yaml")
    assert f"field {field}:" in str(err.value) and words in str(err.value), str(err.value)


def test_every_library_setting_is_settable_from_a_run_yaml():
    transfer = {"barrier_timeout_s": 7.0, "watermark_bytes": 1 << 20, "metrics": "null",
                "setup_timeout_s": 11.0, "update_timeout_s": 13.0, "nic_gbps": 2.0,
                "integrity": "full", "retry": {"attempts": 2}, "audit_path": "audit.jsonl",
                "pause_during_update": False, "transport_options": {"latency_us": 5}}
    run = parse_run_config({"model": TINY, "transfer": transfer}, source="x.yaml")
    cfg = TransferConfig.from_settings(load_model_config(run.model_path),
                                       load_cluster_config(run.cluster_path),
                                       settings=run.transfer)
    assert set(TransferSettings.model_fields) <= set(TransferConfig.model_fields)
    assert cfg.settings() == run.transfer
    assert (cfg.barrier_timeout_s, cfg.watermark_bytes, cfg.metrics, cfg.setup_timeout_s,
            cfg.update_timeout_s, cfg.pause_during_update) == (7.0, 1 << 20, "null", 11.0,
                                                               13.0, False)
    assert cfg.integrity.mode == "full" and cfg.retry.attempts == 2
    assert cfg.audit_path == Path("audit.jsonl")
    assert cfg.transport_spec.options == SimNicOptions(bandwidth_gbps=2.0, latency_us=5.0)
    assert not {"seed", "lr", "actor_cpus"} & set(TransferConfig.model_fields)  # demo actors'


def test_the_run_yaml_chooses_the_transport_and_the_command_line_overrides_it():
    run = parse_run_config({"model": TINY, "transfer": {"transport": "mooncake",
                                                        "transport_options": {
                                                            "hostname": "10.0.0.9"}}},
                           source="x.yaml")
    assert run.transfer.transport_spec.options.hostname == "10.0.0.9"
    same = run.with_overrides(transport="mooncake")  # the file's own options stay
    assert same.transfer.transport_spec == run.transfer.transport_spec
    sim = run.with_overrides(transport="simnic")  # another transport: its own defaults
    assert sim.transfer.transport_spec == DEFAULT_TRANSPORT
    with pytest.raises(ValueError, match=r"<command line>.*field transfer\.transport:.*'carrier'"):
        run.with_overrides(transport="carrier")


def test_wt_demo_refuses_an_unknown_transport_before_starting_anything():
    from typer.testing import CliRunner

    from actors.tools.cli.main import app

    result = CliRunner().invoke(app, ["demo", "--transport", "pigeon"])
    assert result.exit_code == 2
    assert "field transfer.transport: unknown transport 'pigeon'" in (
        " ".join(result.output.split()))


# ------------------------------------------------------------------------ registry and faults


def test_spec_open_builds_through_the_registry():
    spec = parse_transport("simnic", {"latency_us": 3}, where="test")
    with spec.open(owner="trainer0", nic="nic0", node="n") as nic:
        assert (nic.kind, nic.owner, nic.nic, nic.latency_us) == ("simnic", "trainer0", "nic0",
                                                                  3.0)
        assert fault_injection(nic) is nic
    with pytest.raises(ValueError, match="unknown transport 'x'; known"):
        make_transport("x", owner="a")


def test_mooncake_takes_the_actor_address_unless_a_hostname_is_set():
    spec = parse_transport("mooncake", {}, where="test")
    assert spec.kwargs(address="10.0.0.7")["hostname"] == "10.0.0.7"
    fixed = parse_transport("mooncake", {"hostname": "10.9.9.9"}, where="test")
    assert fixed.kwargs(address="10.0.0.7")["hostname"] == "10.9.9.9"


def test_fault_injection_names_a_transport_without_it():
    class Mooncakeish:
        kind, owner, nic = "mooncake", "trainer0", "mc0"

    with pytest.raises(TypeError, match=r"NIC trainer0/mc0 of transport 'mooncake' cannot "
                                        r"inject faults"):
        fault_injection(Mooncakeish())


# ------------------------------------------------------------------------ hosts


@pytest.mark.parametrize(
    ("kind", "options", "src", "dst", "ok"),
    [
        ("simnic", {}, A, A, True),
        ("simnic", {}, A, B, False),
        # Several Ray nodes on one host share hostname and address: simnic reaches them.
        ("simnic", {}, A, HostId(hostname="node-a", address="10.0.0.1"), True),
        ("simnic", {}, A, HostId(hostname="node-a", address="10.0.0.5"), False),
        ("mooncake", {}, A, B, False),  # TCP authenticates nothing: refused across hosts
        ("mooncake", {"allow_unauthenticated": True}, A, B, True),
        ("mooncake", {"protocol": "rdma"}, A, B, True),
        ("mooncake", {}, A, A, True),  # within one host it stays allowed
        ("mooncake", {"hostname": "127.0.0.1"}, A, B, False),
        ("mooncake", {"hostname": "10.0.0.1"}, A, B, False),  # every actor would say 10.0.0.1
        ("mooncake", {"hostname": "10.0.0.1"}, A, A, True),
        ("mooncake", {}, A, HostId(hostname="node-b", address="127.0.0.2"), False),
        ("rdma", {}, A, B, True),
    ],
)
def test_which_transports_reach_across_hosts(kind, options, src, dst, ok):
    assert reaches(parse_transport(kind, options, where="t"), src, dst) is ok


def _engine(replica: str, rank: int) -> EngineRankMeta:
    region = RegionDesc(owner=f"{replica}/tp{rank}", nic="inic0", addr=4096, length=64, rkey=1)
    return EngineRankMeta(replica=replica, rank=rank, node="n", nic="inic0",
                          shard=ShardSpec(tp_rank=rank, tp_size=2),
                          tensors=(EngineTensorMeta(name="w", shape=(64,), dtype="uint8",
                                                    region=region, offset=0),))


def _connector(kind: str, hosts: dict[str, HostId]) -> Connector:
    conn = Connector(parse_transport(kind, {}, where="t"), call=None, gather=None)
    conn.hosts.update(hosts)
    return conn


def test_simnic_across_hosts_fails_at_setup_naming_transport_actors_and_hosts():
    hosts = {"trainer0": A, "trainer1": A, "engine0/tp0": B, "engine0/tp1": A}
    conn = _connector("simnic", hosts)
    with pytest.raises(ValueError) as err:
        conn.check_engines([0, 1], [_engine("engine0", 0), _engine("engine0", 1)])
    msg = str(err.value)
    assert msg.startswith("TransferConfig.transport (trainer -> engine): transport 'simnic' "
                          "cannot reach across hosts: ")
    assert "trainer0 on node-a (10.0.0.1) -> engine0/tp0 on node-b (10.0.0.2)" in msg
    assert "trainer1 on node-a (10.0.0.1) -> engine0/tp0 on node-b (10.0.0.2)" in msg
    assert "engine0/tp1" not in msg  # same host: reachable
    assert "'rdma'" in msg.split("choose ")[1] and "'mooncake'" not in msg.split("choose ")[1]
    _connector("rdma", hosts).check_engines([0, 1], [_engine("engine0", 0)])  # reaches


def test_a_new_replica_on_another_host_is_refused_for_the_peer_copy_too():
    hosts = {"trainer0": A, "engine0/tp0": A, "engine1/tp0": B}
    conn = _connector("simnic", hosts)
    conn.hosts["trainer0"] = B  # the trainer reaches engine1; engine0 does not
    with pytest.raises(ValueError, match=r"\(replica copy\): transport 'simnic'.*engine0/tp0 "
                                         r"on node-a \(10.0.0.1\) -> engine1/tp0 on node-b"):
        conn.check_engines([0], [_engine("engine1", 0)], sources=[_engine("engine0", 0)])


def test_an_actor_without_a_host_is_named():
    conn = _connector("simnic", {"trainer0": None, "engine0/tp0": A})
    with pytest.raises(ValueError, match=r"no host reported by \['trainer0'\]"):
        conn.check_engines([0], [_engine("engine0", 0)])
    with pytest.raises(ValueError, match=r"no host known for \['x'\]"):
        unreachable_links(DEFAULT_TRANSPORT, {}, [("x", "x")])


def test_an_in_place_controller_refuses_a_rank_served_only_by_a_flip():
    """An engine rank keeps the shadow a shadow-mode set-up gave it: an in-place controller
    would write a copy never served, so it refuses the rank at setup, naming it; a
    shadow-mode controller takes it, and both take a rank whose writes serve."""
    spec = parse_transport("simnic", {}, where="t")
    shadow = dataclasses.replace(_engine("engine0", 1), served_by_flip=True)
    in_place = Connector(spec, call=None, gather=None)
    with pytest.raises(ValueError, match=r"^engine0/tp1: its registered memory is a shadow "
                                         r"copy .* set TransferConfig.apply='shadow'"):
        in_place.check_apply(shadow, "engine0/tp1")
    in_place.check_apply(_engine("engine0", 0), "engine0/tp0")
    shadowed = Connector(spec, call=None, gather=None, apply="shadow")
    shadowed.check_apply(shadow, "engine0/tp1")
    shadowed.check_apply(_engine("engine0", 0), "engine0/tp0")
