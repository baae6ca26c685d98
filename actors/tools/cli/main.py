"""The ``wt`` command line: thin typer commands over the library's demo, benchmark and
planning modules (:mod:`actors.tools.demo`, :mod:`actors.tools.bench`, :mod:`scheduling`).

Each command imports its implementation lazily, so ``wt --help`` is instant and
a command only pays for what it uses (Ray, torch, pyverbs, Mooncake).
"""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.splitlines()[0])
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print a baseline beside us.")
app.add_typer(bench_app, name="bench")
config_app = typer.Typer(no_args_is_help=True, help="Check configuration files.")
app.add_typer(config_app, name="config")
JSON_HELP = "Also write the result as JSON (- : to stdout, the rest to stderr)."


def _default_config(engine: str | None, which: str) -> Path:
    """The run config a command starts from for ``engine`` (its registry entry's
    ``demo_config`` or ``bench_config``; the reference engine's when none or unknown: the
    run config's validation then names a bad engine)."""
    from actors.engine_registry import DEFAULT_ENGINE, engine_names, engine_spec

    name = engine if engine in engine_names() else DEFAULT_ENGINE
    return Path(getattr(engine_spec(name), which))


@app.command("demo")
def demo(
    model: Path | None = typer.Option(
        None, help="Model YAML [default: configs/models/tiny_llama.yaml, from --config]."),
    cluster: Path | None = typer.Option(
        None, help="Cluster YAML [default: configs/clusters/local_cpu.yaml, from --config]."),
    fp8: bool | None = typer.Option(None, "--fp8/--no-fp8", help="FP8 engines [default: no]."),
    updates: int | None = typer.Option(None, min=1, help="Train-step + update cycles [3]."),
    json_path: Path | None = typer.Option(None, "--json", help=JSON_HELP),
    trace: Path | None = typer.Option(
        None, "--trace", help="Write a Chrome trace of every update (Perfetto; `wt trace`)."),
    config: Path | None = typer.Option(
        None, help="Run config to start from [default: configs/runs/demo.yaml; "
        "configs/runs/demo_vllm.yaml with --engine vllm]."),
    corrupt_version: int | None = typer.Option(
        None, hidden=True, help="Test hook: flip one engine byte after this update."),
    transport: str | None = typer.Option(
        None, help="simnic (one host), mooncake (TCP) or rdma [default: from --config]."),
    engine: str | None = typer.Option(
        None, help="reference (our decoder), vllm (a real vLLM, the `vllm` extra) or "
        "vllm-server (`vllm serve` driven over HTTP) [default: from --config]."),
    verbose: bool = typer.Option(
        False, "--verbose", help="Also show vLLM's own INFO logs (--engine vllm) "
        "[default: WARNING and above]."),
    trainer: str | None = typer.Option(
        None, help="Trainer actors: fsdp2 (FSDP2), deepspeed (DeepSpeed ZeRO-3, the "
        "`deepspeed` extra) or megatron (Megatron-core, the `megatron` extra) "
        "[default: from --config, fsdp2]."),
) -> None:
    """Trainers -> inference replicas over simnic (or --transport), every update verified."""
    from actors.tools.demo.fleet import run_cli

    if verbose:  # read by actors.tools.demo.vllm_demo, here and in the engines' processes
        from actors.tools.demo.vllm_demo import set_vllm_log_level, vllm_log_level

        set_vllm_log_level(vllm_log_level(verbose=True))
    if config is None:
        config = _default_config(engine, "demo_config")
    raise typer.Exit(run_cli(config=config, model=model, cluster=cluster, fp8=fp8,
                             updates=updates, json_path=json_path,
                             corrupt_version=corrupt_version, trace_path=trace,
                             transport=transport, engine=engine, trainer=trainer))


@app.command("chaos")
def chaos(
    config: Path = typer.Option(Path("configs/runs/demo.yaml"), help="Run config (actors)."),
    faults: str | None = typer.Option(
        None, help="Comma-separated faults to run (default: every one, in order): "
                   "engine-killed-before, engine-killed-during, engine-stopped-before, "
                   "engine-stopped-during, region-revoked, trainer-killed-during, "
                   "nic-link-down, nic-transient-error."),
    update_timeout_s: float = typer.Option(15.0, help="The controller's update timeout."),
    nic_gbps: float = typer.Option(0.01, help="NIC cap in GB/s, so a fault lands mid-write."),
    apply: str = typer.Option("in_place", help="in_place|shadow: how updates land (shadow: "
                              "every fault judged as a transaction, a client generating)."),
    json_path: Path | None = typer.Option(None, "--json", help=JSON_HELP),
) -> None:
    """Inject each fault (dead, stopped, revoked, NIC) into the demo cluster; did it heal?"""
    from actors.tools.demo.chaos import run

    raise typer.Exit(run(config=config, faults=faults, update_timeout_s=update_timeout_s,
                         nic_gbps=nic_gbps, json_path=json_path, apply=apply))


@app.command("soak")
def soak(
    config: Path = typer.Option(Path("configs/runs/demo.yaml"), help="Run config (actors)."),
    updates: int = typer.Option(200, min=1, help="Consecutive updates after the warm-up."),
    json_path: Path | None = typer.Option(None, "--json", help=JSON_HELP),
) -> None:
    """Many updates back to back: RSS, fds, threads and store keys must not grow."""
    from actors.tools.demo.soak import run

    raise typer.Exit(run(config=config, updates=updates, json_path=json_path))


@app.command("trace")
def trace(
    path: Path = typer.Argument(..., help="A trace written by `wt demo --trace PATH`."),
    png: Path | None = typer.Option(None, "--png", help="Draw a Gantt chart here (PNG)."),
    version: int | None = typer.Option(None, help="Only this update [default: every one]."),
) -> None:
    """Draw a Chrome trace of updates: stages per trainer rank, the NIC bound marked."""
    from actors.tools.cli.trace_cmd import run_trace

    raise typer.Exit(run_trace(path, png=png, version=version))


@config_app.command("check")
def config_check(
    path: Path = typer.Argument(..., help="A model, cluster or run YAML."),
    kind: str | None = typer.Option(None, help="model|cluster|run [default: from content]."),
) -> None:
    """Validate a config file and print what it resolved to (exit 2 when invalid)."""
    from actors.tools.cli.config_cmd import run_check

    raise typer.Exit(run_check(path, kind=kind))


@bench_app.command("transport")
def bench_transport(
    sizes: str = typer.Option(
        "1M,4M,16M,64M,256M,1G", help="Comma-separated write sizes (K/M/G suffixes)."
    ),
    repeats: int = typer.Option(5, min=1, help="Timed writes per size (best is reported)."),
    backends: str = typer.Option(
        "memcpy,simnic,mooncake_tcp,tcp,tcp_enc,tcp_lz4,tcp_zstd",
        help="Which of memcpy, simnic, mooncake_tcp, tcp, tcp_enc, tcp_lz4, tcp_zstd to run."
    ),
    json_path: Path | None = typer.Option(None, "--json", help=JSON_HELP),
) -> None:
    """GB/s of memcpy, simnic, mooncake-tcp and our tcp (plain, encrypted, lz4, zstd)."""
    from actors.tools.bench.transport import run

    raise typer.Exit(run(sizes=sizes, repeats=repeats, backends=backends, json_path=json_path))


@bench_app.command("groups")
def bench_groups(
    rate_mbit: float = typer.Option(40.0, min=0.1, help="Each remote site's link (tc tbf)."),
    updates: int = typer.Option(2, min=1, help="Updates per mode (direct, grouped)."),
    transport: str = typer.Option("tcp", help="tcp, or mooncake (allow_unauthenticated)."),
    json_path: Path | None = typer.Option(None, "--json", help=JSON_HELP),
) -> None:
    """Replica groups behind slow links (network namespaces, root): one copy per site over
    the link and peer copies inside it, against a copy per replica over it."""
    from actors.tools.bench.groups.bench import run

    raise typer.Exit(run(rate_mbit=rate_mbit, updates=updates, transport=transport,
                         json_path=json_path))


@bench_app.command("pipeline")
def bench_pipeline(
    model: Path = typer.Option(Path("configs/models/bench_dense.yaml"), help="Model YAML."),
    cluster: Path = typer.Option(Path("configs/clusters/bench_pipeline.yaml"),
                                 help="Cluster YAML (default: one trainer rank per core)."),
    fp8: bool = typer.Option(True, help="FP8 engines (quantize while writing)."),
    nic_gbps: float = typer.Option(0.1, help="Trainer NIC cap in GB/s (see the docstring)."),
    watermark: str = typer.Option("512M", help="Pipeline memory watermark per rank."),
    repeats: int = typer.Option(3, min=1, help="Runs per mode (interleaved); the median."),
    bucket_bytes: str = typer.Option("16M", help="Gather bucket size (pipeline items)."),
    json_path: Path | None = typer.Option(None, "--json", help=JSON_HELP),
) -> None:
    """The same plan run serially and pipelined, with the speedup."""
    from actors.tools.bench.pipeline import run

    raise typer.Exit(run(model, cluster, fp8, nic_gbps, watermark, json_path, repeats,
                         bucket_bytes))


@bench_app.command("gather")
def bench_gather(
    model: list[Path] = typer.Option(
        [Path("configs/models/tiny_llama.yaml"), Path("configs/models/bench_moe.yaml")],
        help="Model YAML (repeat for several)."),
    cluster: Path = typer.Option(Path("configs/clusters/local_cpu.yaml"), help="Cluster YAML."),
    updates: int = typer.Option(3, min=1, help="Updates per gather mode."),
    layout: list[str] = typer.Option(
        ["fsdp", "hsdp", "ep_fsdp"],
        help="Trainer layout (repeat for several): fsdp (1-D Shard(0)), hsdp (2-D "
             "Replicate x Shard(0)), ep_fsdp (MoE: stacked experts on (ep, fsdp))."),
    json_path: Path | None = typer.Option(None, "--json", help=JSON_HELP),
) -> None:
    """Per-parameter gathers beside coalesced buckets: prepare-stage and update seconds."""
    from actors.tools.bench.gather import run

    raise typer.Exit(run(model, cluster, updates, json_path, layout))


@bench_app.command("staging")
def bench_staging(
    model: Path = typer.Option(Path("configs/models/bench_moe.yaml"), help="Model YAML."),
    cluster: Path = typer.Option(Path("configs/clusters/local_cpu.yaml"), help="Cluster YAML."),
    fp8: bool = typer.Option(False, help="FP8 engines (quantize while writing)."),
    nic_gbps: float | None = typer.Option(None, help="Trainer NIC cap in GB/s [uncapped]."),
    watermark: str = typer.Option("512M", help="Pipeline memory watermark per rank."),
    updates: int = typer.Option(5, min=1, help="Updates per mode (the first is cold)."),
    json_path: Path | None = typer.Option(None, "--json", help="Also write results as JSON."),
) -> None:
    """Per-update seconds of fresh piece buffers beside the staging arena."""
    from actors.tools.bench.staging import run

    raise typer.Exit(run(model, cluster, fp8, nic_gbps, watermark, updates, json_path))


@bench_app.command("designs")
def bench_designs(
    model: Path | None = typer.Option(
        Path("configs/models/bench_dense.yaml"), help="Model YAML (>= 0.5 GB for the table)."),
    config: Path | None = typer.Option(
        None, help="Run config (actors) [configs/runs/demo.yaml; "
                   "configs/runs/bench_vllm.yaml with --engine vllm]."),
    engine: str = typer.Option("reference", help="Inference engine: reference or vllm."),
    nic_gbps: float = typer.Option(0.05, help="NIC cap in GB/s, ours (simnic) and baselines "
                                              "(low, so that the link binds: see the docstring)."),
    updates: int = typer.Option(3, min=1, help="Updates per design (the median is reported)."),
    designs: str | None = typer.Option(
        None, help="Which designs to run (p2p: shard-direct pieces, zero-copy where they "
                   "may; p2p_staged: every piece staged; p2p_gather: ours gathering every "
                   "parameter; native: the trainer's own, OpenRLHF's with --trainer "
                   "deepspeed, slime's with --trainer megatron) [default: "
                   "p2p,p2p_staged,p2p_gather,rank0,rpc,bucketed,rdt; p2p,native with "
                   "--trainer deepspeed or megatron]."),
    trainer: str | None = typer.Option(
        None, help="Trainer actors: fsdp2, deepspeed (DeepSpeed ZeRO-3, the `deepspeed` "
                   "extra) or megatron (Megatron-core) [default: from --config, fsdp2]."),
    bucket: str = typer.Option("64M", help="Bucket size of the bucketed design."),
    caps_off: bool = typer.Option(True, help="Also run every design uncapped (memcpy bound)."),
    timeout_s: float = typer.Option(900.0, help="Per-update timeout of every design."),
    json_path: Path | None = typer.Option(None, "--json", help=JSON_HELP),
    png: Path | None = typer.Option(None, "--png", help="Bar chart (PNG, the plots extra)."),
) -> None:
    """Ours (p2p) beside rank-0 broadcast, per-tensor RPC and bucketed broadcast, verified."""
    from actors.tools.bench.designs.bench import run

    if config is None:
        config = _default_config(engine, "bench_config")
    raise typer.Exit(run(config=config, model=model, nic_gbps=nic_gbps, updates=updates,
                         designs=designs, bucket=bucket, caps_off=caps_off,
                         timeout_s=timeout_s, json_path=json_path, png=png, engine=engine,
                         trainer=trainer))


@bench_app.command("delta")
def bench_delta(
    model: Path | None = typer.Option(
        None, help="Model YAML [configs/models/bench_dense.yaml; tiny_llama with --quick]."),
    config: Path = typer.Option(Path("configs/runs/demo.yaml"), help="Run config (actors)."),
    nic_gbps: float = typer.Option(0.05, help="NIC cap in GB/s (every trainer and engine NIC)."),
    updates: int = typer.Option(2, min=1, help="Rounds per (dtype, lr): one update per mode."),
    lrs: str = typer.Option("1e-6,1e-5", help="AdamW learning rates, comma-separated."),
    dtypes: str = typer.Option("bf16,fp8", help="Engine dtypes: bf16, fp8 (a fleet each)."),
    quick: bool = typer.Option(False, "--quick", help="tiny_llama, one round (a test's size)."),
    oracle: str = typer.Option("every", help="every|last: the reference-layout byte check "
                               "after every update, or after each lr's last (the integrity "
                               "check of every range runs after every update either way)."),
    timeout_s: float = typer.Option(900.0, help="Timeout of each call to the actors."),
    apply: str = typer.Option("in_place", help="in_place|shadow: deltas applied in place at "
                              "finish, or to the shadow (live copied into it first) and "
                              "flipped; shadow also reports the copy and the flip."),
    json_path: Path | None = typer.Option(None, "--json", help=JSON_HELP),
) -> None:
    """Dense (gather) beside sparse delta updates: bytes, seconds, CPU of diff/encode/apply."""
    from actors.tools.bench.delta import run

    raise typer.Exit(run(config=config, model=model, nic_gbps=nic_gbps, updates=updates,
                         lrs=lrs, dtypes=dtypes, quick=quick, timeout_s=timeout_s,
                         json_path=json_path, oracle=oracle, apply=apply))


@bench_app.command("integrity")
def bench_integrity(
    config: Path = typer.Option(Path("configs/runs/demo.yaml"), help="Run config (actors)."),
    model: Path | None = typer.Option(None, help="Model YAML [the run config's]."),
    modes: str = typer.Option("off,sample,full", help="Integrity modes to compare."),
    fraction: float = typer.Option(0.1, help="Fraction of the sample mode."),
    updates: int = typer.Option(5, min=1, help="Timed updates per mode and round."),
    rounds: int = typer.Option(2, min=1, help="Times the modes take turns."),
    json_path: Path | None = typer.Option(None, "--json", help=JSON_HELP),
) -> None:
    """Update seconds with checksums off, sampled and full, side by side."""
    from actors.tools.bench.integrity import run

    raise typer.Exit(run(config, model, modes, fraction, updates, rounds, json_path))


@bench_app.command("served")
def bench_served(
    model: Path = typer.Option(Path("configs/models/tiny_llama.yaml"), help="Model YAML."),
    cluster: Path = typer.Option(Path("configs/clusters/local_cpu.yaml"), help="Cluster YAML."),
    checks: int = typer.Option(5, min=1, help="Full checks to time."),
    updates: int = typer.Option(4, min=1, help="Updates per setting (reference on, off)."),
    window_s: float = typer.Option(20.0, help="Seconds of each CPU window (idle, ticking)."),
    interval: float = typer.Option(10.0, help="Background tick interval the share is for."),
    json_path: Path | None = typer.Option(None, "--json", help=JSON_HELP),
) -> None:
    """The cost of checking served memory: a full check, the sample-mode reference, a
    background tick's CPU share."""
    from actors.tools.bench.served import run

    raise typer.Exit(run(model, cluster, checks=checks, updates=updates, window_s=window_s,
                         interval=interval, json_out=json_path))


@bench_app.command("stall")
def bench_stall(
    config: Path | None = typer.Option(
        None, help="Run config (actors) [default: the engine's demo config]."),
    engine: str = typer.Option("reference", help="Engine whose client generates "
                               "(STALL_CLIENTS of wt bench stall): reference or vllm."),
    updates: int = typer.Option(3, min=1, help="Updates per mode."),
    nic_gbps: float | None = typer.Option(
        None, help="Cap every simulated NIC (GB/s), both modes: a transfer as long as on a "
        "cluster whose NICs bind [uncapped]."),
    cluster: Path | None = typer.Option(
        None, help="Cluster YAML [default: the run config's], e.g. "
        "configs/clusters/vllm_cpu_tp1.yaml."),
    json_path: Path | None = typer.Option(None, "--json", help=JSON_HELP),
) -> None:
    """Engine stall per update, in place and in shadow mode, while a client generates."""
    from actors.tools.bench.stall.bench import run

    raise typer.Exit(run(config=config, engine=engine, updates=updates, nic_gbps=nic_gbps,
                         json_out=json_path, cluster=cluster))


@bench_app.command("lora")
def bench_lora(
    model: Path = typer.Option(Path("configs/models/bench_dense.yaml"), help="Model YAML."),
    ranks: str = typer.Option("16,64", help="LoRA ranks, comma-separated."),
    tp: str = typer.Option("1", help="vLLM tensor-parallel sizes, comma-separated."),
    designs: str = typer.Option("ours,disk,merged", help="Designs, comma-separated."),
    updates: int = typer.Option(3, min=1, help="Updates per design."),
    json_path: Path | None = typer.Option(None, "--json", help=JSON_HELP),
) -> None:
    """A LoRA adapter update into vLLM: one-sided into its slots, from disk, or merged."""
    from actors.tools.bench.lora import run

    raise typer.Exit(run(model=model, ranks=ranks, tp=tp, designs=designs, updates=updates,
                         json_out=json_path))


@app.command("selftest")
def selftest(
    device: str | None = typer.Option(None, help="RDMA device name (default: the first one)."),
    size: str = typer.Option("256M", help="Bytes to write in the loopback test."),
    gid_index: int = typer.Option(0, help="GID index (RoCE needs one with an IP)."),
) -> None:
    """RDMA WRITE loopback on a real device: verify the bytes and report GB/s."""
    from actors.tools.cli.selftest import run

    raise typer.Exit(run(device=device, size=size, gid_index=gid_index))


@app.command("topology")
def topology(
    sysfs: Path = typer.Option(Path("/sys"), help="Root of the sysfs tree to read."),
    out: Path | None = typer.Option(None, help="Write the cluster YAML here [stdout]."),
    json_path: Path | None = typer.Option(None, "--json", help="Also write GPUs, NICs, pairs."),
    name: str = typer.Option("from_sysfs", help="Cluster name in the YAML."),
    trainer_nodes: int = typer.Option(1, min=1, help="Trainer nodes like this one."),
    replicas: int = typer.Option(1, min=1, help="Inference replicas."),
    gpus_per_replica: int | None = typer.Option(None, min=1, help="[one node's GPUs]"),
    trainer_ep: int = typer.Option(1, min=1, help="Trainer expert_parallel."),
    inference_ep: int = typer.Option(1, min=1, help="Inference expert_parallel."),
    fp8: bool = typer.Option(False, help="FP8 engines."),
    nic_gbps: float | None = typer.Option(None, help="NIC rate [port 1 rate from sysfs]."),
) -> None:
    """Cluster YAML from this host's GPUs and RDMA NICs, each GPU with its nearest NIC.

    Exit codes: 0 written; 3 no NVIDIA GPU or no RDMA device found (nothing
    written); 1 inconsistent sysfs tree or options.
    """
    from actors.tools.cli.topology_cmd import run

    raise typer.Exit(run(sysfs=sysfs, out=out, json_path=json_path, name=name,
                         trainer_nodes=trainer_nodes, replicas=replicas,
                         gpus_per_replica=gpus_per_replica, trainer_expert_parallel=trainer_ep,
                         inference_expert_parallel=inference_ep, fp8=fp8, nic_gbps=nic_gbps))


@app.command("plan")
def plan(
    model: Path = typer.Option(..., help="Model YAML (configs/models/*.yaml)."),
    cluster: Path = typer.Option(..., help="Cluster YAML (configs/clusters/*.yaml)."),
    json_path: Path | None = typer.Option(None, "--json", help=JSON_HELP),
    expert_naming: str = typer.Option("per_expert", help="Trainer experts: per_expert|stacked."),
    gather_order: str = typer.Option("interleaved", help="interleaved|canonical."),
    validate: bool = typer.Option(True, help="Check every destination byte is written once."),
    gather: str = typer.Option("shard_direct", help="shard_direct|full: pieces from the "
                                                    "owners' shards, or every param gathered."),
    megatron: str | None = typer.Option(
        None, help="Lay the trainer out as Megatron: tp=8,pp=8,ep=32[,etp=1,vpp=1,"
        "layers=7:8:...] (instead of the cluster YAML's trainer layout)."),
) -> None:
    """Plan a model on a cluster from configs alone: tasks, bytes per NIC, bound, time."""
    from actors.tools.cli.plan_cmd import run_plan

    raise typer.Exit(run_plan(model=model, cluster=cluster, json_path=json_path,
                              expert_naming=expert_naming, gather_order=gather_order,
                              validate=validate, gather=gather, megatron=megatron))


@app.command("simulate")
def simulate(
    model: Path = typer.Option(..., help="Model YAML (configs/models/*.yaml)."),
    cluster: Path = typer.Option(..., help="Cluster YAML (configs/clusters/*.yaml)."),
    json_path: Path | None = typer.Option(None, "--json", help=JSON_HELP),
    expert_naming: str = typer.Option("per_expert", help="Trainer experts: per_expert|stacked."),
    gather_order: str = typer.Option("interleaved", help="interleaved|canonical."),
    inflight: int | None = typer.Option(None, help="Writes in flight per rank (default: cluster)."),
    resolution: float = typer.Option(1e-5, help="Event window, fraction of a group's bound."),
    png: Path | None = typer.Option(None, "--png", help="Draw the simulated timeline (PNG)."),
    nic_model: str = typer.Option("events", help="events|bound (bound: fast, for sweeps)."),
    sweep: bool = typer.Option(False, help="Also sweep watermark and inflight (bound model)."),
    calibrate: bool = typer.Option(False, help="Measure this machine's sim constants."),
    check: bool = typer.Option(False, help="With --calibrate: predict and run wt bench pipeline "
                                           "configurations, print predicted vs measured."),
    write_sim: Path | None = typer.Option(None, help="With --calibrate: write the constants "
                                                     "into this cluster YAML's sim: section."),
    delta: float | None = typer.Option(
        None, min=0.0, max=1.0, help="Also predict a sparse delta update with this share of "
        "elements changed (measured: wt bench delta)."),
    gather: str = typer.Option("shard_direct", help="shard_direct|full|both (both: the two "
                                                    "side by side)."),
    megatron: str | None = typer.Option(
        None, help="Lay the trainer out as Megatron: tp=8,pp=8,ep=32[,etp=1,vpp=1,"
        "layers=7:8:...] (instead of the cluster YAML's trainer layout)."),
) -> None:
    """Predict the transfer time of the plan (every stage, NICs as discrete events)."""
    from actors.tools.cli.plan_cmd import run_simulate

    if gather == "both":
        from actors.tools.cli.gather_modes import run_both

        raise typer.Exit(run_both(model=model, cluster=cluster, json_path=json_path,
                                  expert_naming=expert_naming, gather_order=gather_order,
                                  inflight=inflight, resolution=resolution,
                                  nic_model=nic_model, megatron=megatron))

    raise typer.Exit(run_simulate(model=model, cluster=cluster, json_path=json_path,
                                  expert_naming=expert_naming, gather_order=gather_order,
                                  inflight=inflight, resolution=resolution, png=png,
                                  nic_model=nic_model, sweep=sweep, calibrate=calibrate,
                                  check=check, write_sim=write_sim, gather=gather,
                                  delta=delta, megatron=megatron))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
