"""vLLM models built without an engine: FP8 layout checks that run where FP8 kernels cannot.

vLLM's block-FP8 linear layers (``Fp8Config``, ``weight_block_size`` [128, 128])
need AMX or a CUDA GPU to compute, but their parameters (``float8_e4m3fn``
weights, float32 ``weight_scale_inv``) and weight loaders are plain torch. Here,
in fresh processes (one per TP rank, gloo), vLLM's own model class is built from
a checkpoint directory whose ``config.json`` carries the quantization config:

1. on the meta device, and vLLM's ``load_weights`` is recorded exactly as our
   backend records it in an engine's worker (:func:`record_load`);
2. on the CPU, and vLLM's ``load_weights`` loads the FP8 checkpoint of a bf16
   state dict (quantized with our reference quantizer): the oracle;
3. the recorded pieces, renamed onto the trainer's parameters, are prepared from
   the bf16 state dict (the trainers' quantization) and laid out in buffers of
   the engine's parameters, which must equal the oracle byte for byte.

Only the FP8 kernel choice (``init_fp8_linear_kernel``, which refuses this CPU)
is replaced, with None: it decides how to compute, not the layout, and no
forward pass runs::

    result = check_fp8_layout("configs/models/tiny_llama.yaml", tp_size=2, root=tmp)
    result[rank]["table"]   # differences from our rule tables ([] when they agree)
    result[rank]["bytes"]   # differences from vLLM's load_weights ([] when equal)
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import torch

FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [128, 128]}


def quantized(name: str, t: torch.Tensor) -> bool:
    """Which tensors an FP8 checkpoint quantizes: the projection weights (2-D)."""
    return name.endswith("proj.weight") and t.dim() == 2


def fp8_checkpoint(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A bf16 state dict as a block-FP8 checkpoint (weights + ``weight_scale_inv``)."""
    from weight_transfer.layout.quant import quantize_fp8_blocks

    out = {}
    for name, t in state.items():
        if quantized(name, t):
            out[name], out[name + "_scale_inv"] = quantize_fp8_blocks(t)
        else:
            out[name] = t
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _vllm_config(model_dir: str):
    from vllm.config import LoadConfig, ModelConfig, VllmConfig

    mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16",
                     enforce_eager=True, max_model_len=256)
    return VllmConfig(model_config=mc, load_config=LoadConfig(load_format="dummy"))


def _build(vc, device: str):
    from vllm.model_executor.layers.quantization import fp8
    from vllm.model_executor.model_loader.utils import initialize_model

    fp8.init_fp8_linear_kernel = lambda **_: None  # no FP8 kernel runs here (docstring)
    with torch.device(device):
        return initialize_model(vllm_config=vc)


def _rank_check(rank: int, world: int, port: int, model_dir: str, model_yaml: str,
                out: str) -> None:
    """One TP rank: record on meta, load on CPU, compare; writes ``out``/rank<r>.json."""
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    from scheduling.build.recorded import engine_table_differences
    from weight_transfer.engines.vllm.recording import exposed_shapes, record_load
    from weight_transfer.layout.recording.checkpoint import checkpoint_specs
    from weight_transfer.model.checkpoint_names import to_trainer_pieces
    from weight_transfer.model.models import load_model_config
    from weight_transfer.sender.prepare import piece_bytes
    from weight_transfer.types import EngineRankMeta, ShardSpec

    vc = _vllm_config(model_dir)
    bf16 = load_file(Path(model_dir) / "bf16.safetensors.src")
    # vLLM's CPU worker names the shared-memory group of its communicator after the
    # rendezvous port before it initializes; where the CPU extension offers that
    # communicator, initialize_model_parallel reads the name, so set it the same way.
    os.environ["VLLM_DIST_IDENT"] = str(port)
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=world, rank=rank, local_rank=rank,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     backend="gloo")
        initialize_model_parallel(world)
        layout = record_load(_build(vc, "meta"), checkpoint=checkpoint_specs(model_dir),
                             device=torch.device("meta"))
        exposed = exposed_shapes(layout)
    vc = _vllm_config(model_dir)  # a second model needs its own config (layer registry)
    with set_current_vllm_config(vc), torch.no_grad():
        model = _build(vc, "cpu")
        model.load_weights(iter(load_file(Path(model_dir) / "model.safetensors").items()))
        loaded = {n: p.detach() for n, p in model.named_parameters()}
    shard = ShardSpec(tp_rank=rank, tp_size=world)
    meta = EngineRankMeta(replica="meta", rank=rank, node="-", nic="-", shard=shard,
                          tensors=(), pieces=layout.pieces)
    cfg = load_model_config(model_yaml)
    shapes = {n: tuple(t.shape) for n, t in bf16.items()}
    pieces, missing = to_trainer_pieces(layout.pieces, shapes)
    ours = {n: torch.zeros(layout.params[n].nbytes, dtype=torch.uint8) for n in exposed}
    for p in pieces:
        ours[p.dst_tensor][p.dst_offset:p.dst_offset + p.nbytes] = piece_bytes(bf16[p.src_param], p)
    problems = [f"checkpoint tensor {n}: no trainer parameter" for n in missing]
    direct, n_direct = _shard_direct_bytes(pieces, bf16, ours), 0
    for name, buf in ours.items():
        want = loaded[name].contiguous().reshape(-1).view(torch.uint8)
        if not torch.equal(buf[:exposed[name].nbytes], want[:exposed[name].nbytes]):
            problems.append(f"{name}: bytes differ from vLLM's load_weights")
        got, n = direct[name]
        n_direct += n
        if not torch.equal(got[:exposed[name].nbytes], want[:exposed[name].nbytes]):
            problems.append(f"{name}: shard-direct bytes differ from vLLM's load_weights")
    result = {
        "params": {n: [list(s.shape), s.dtype] for n, s in layout.params.items()},
        "transforms": sorted({str(p.transform) for p in layout.pieces}),
        "table": engine_table_differences(cfg, meta, shapes, expert_naming="stacked"),
        "bytes": problems,
        "direct_parts": n_direct,
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


DIRECT_FSDP = 4  # trainer ranks of the FSDP (Shard(0)) layout the shard-direct check assumes


def _shard_direct_bytes(pieces, full: dict, like: dict) -> dict:
    """Per engine tensor: (the bytes shard-direct mode lays from ``pieces`` when each trainer
    parameter is FSDP-sharded over :data:`DIRECT_FSDP` ranks: a covered piece's parts cut
    from their owner's block alone, the others from the full tensor; the count of parts)."""
    from scheduling.build.direct import cover_piece
    from weight_transfer.layout.shard_blocks import local_rect, shifted
    from weight_transfer.sender.prepare import piece_bytes
    from weight_transfer.types import MeshDesc, ParamMeta, Placement

    mesh = MeshDesc(ranks=tuple(range(DIRECT_FSDP)), shape=(DIRECT_FSDP,))
    out = {n: [torch.zeros_like(b), 0] for n, b in like.items()}
    for p in pieces:
        t = full[p.src_param]
        meta = ParamMeta(name=p.src_param, shape=tuple(t.shape), dtype="bfloat16", mesh=mesh,
                         placements=(Placement(kind="shard", dim=0),))
        cov = cover_piece(p, meta)
        parts = cov.parts or ((p, None),)
        for part, owners in parts:
            src, q = t, part
            if owners is not None:  # the owner's block alone, as DTensor.to_local() holds it
                block = local_rect(meta, owners[0])
                src = t[tuple(slice(a, b) for a, b in block)].clone()
                q = shifted(part, block)
                out[p.dst_tensor][1] += 1
            out[p.dst_tensor][0][part.dst_offset:part.dst_offset + part.nbytes] = \
                piece_bytes(src, q)
    return {n: (b, k) for n, (b, k) in out.items()}


def save_fp8_model(model_yaml: str | Path, *, seed: int, root: str | Path) -> Path:
    """A random bf16 HF model of ``model_yaml`` as a block-FP8 checkpoint directory (its
    bf16 state kept beside it, ``bf16.safetensors.src``, for the trainer side)."""
    from safetensors.torch import save_file

    from weight_transfer.engines.reference.hf_model import build_hf_model, hf_config
    from weight_transfer.model.models import load_model_config

    cfg = load_model_config(model_yaml)
    model = build_hf_model(cfg, seed=seed)
    path = Path(root) / f"{cfg.name}-seed{seed}-fp8"
    path.mkdir(parents=True, exist_ok=True)
    hc = hf_config(cfg)
    hc.quantization_config = dict(FP8_CONFIG)
    hc.save_pretrained(path)
    state = {n: p.detach().contiguous() for n, p in model.named_parameters()}
    save_file(fp8_checkpoint(state), path / "model.safetensors")
    save_file(state, path / "bf16.safetensors.src")
    return path


def check_fp8_layout(model_yaml: str | Path, *, tp_size: int, root: str | Path,
                     seed: int = 3) -> list[dict[str, Any]]:
    """Run the check of the module docstring on ``tp_size`` ranks; one result per rank."""
    import torch.multiprocessing as mp

    model_dir = save_fp8_model(model_yaml, seed=seed, root=root)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    mp.spawn(_rank_check, args=(tp_size, _free_port(), str(model_dir), str(model_yaml),
                                str(root)), nprocs=tp_size, join=True)
    return [json.loads(Path(root, f"rank{r}.json").read_text()) for r in range(tp_size)]
