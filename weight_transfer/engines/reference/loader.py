"""Reference loader: a Hugging Face state dict -> the tensors of one engine rank.

This is the independent oracle for :mod:`weight_transfer.layout.engine_layout` and, later, the
demo engine's loader. It is written the way vLLM's ``load_weights`` does it -
``narrow`` each checkpoint tensor to this rank's shard, ``torch.cat`` fused
parts, ``torch.stack`` local experts - and shares no code with
``engine_pieces`` or the rule tables: layer kinds are read off the checkpoint
keys (``mlp.gate.weight`` present: a MoE layer; ``kv_a_proj_with_mqa``: MLA
attention; ``q_proj.bias``: biases ...). The one thing it needs per
architecture, how the checkpoint spells a MoE block (Mixtral:
``block_sparse_moe.experts.{e}.w1/w3/w2``), is restated in :data:`MOE_SPELLING`
rather than taken from the architecture module, so a wrong spelling there
shows up as a difference.

With ``fp8=True`` each projection weight (``*proj*.weight``, Mixtral's
``w1``/``w2``/``w3``) is first quantized whole, as DeepSeek's FP8 checkpoints
store it (``quantize_fp8_blocks``), and the loader then narrows the FP8 values
and the ``weight_scale_inv`` rows together, as vLLM's block-FP8 loader does
(offset / 128); a cut inside a block is a ValueError.
Stacked transformers-5 experts (``mlp.experts.gate_up_proj``) are first split
into per-expert checkpoint tensors (gate rows first), and the transformers-5
block ``mlp`` is renamed to the checkpoint's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from weight_transfer.layout.fp8_geometry import FP8_BLOCK
from weight_transfer.layout.quant import quantize_fp8_blocks
from weight_transfer.model.models import ModelConfig
from weight_transfer.types import ShardSpec

_PAD = 64  # vLLM DEFAULT_VOCAB_PADDING_SIZE


@dataclass(frozen=True)
class MoeSpelling:
    """Checkpoint (and vLLM) module of a MoE block and its per-expert gate/up/down names."""

    block: str = "mlp"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"


# Checkpoint spelling per architecture (default: Qwen/DeepSeek's); vLLM's mixtral.py
# loads these with ckpt_gate_proj_name="w1", ckpt_down_proj_name="w2", ckpt_up_proj_name="w3".
MOE_SPELLING: dict[str, MoeSpelling] = {
    "mixtral": MoeSpelling(block="block_sparse_moe", gate="w1", up="w3", down="w2"),
}
_HF5_BLOCK = "mlp"  # transformers 5 names every MoE block "mlp"


@dataclass
class Fp8:
    """An FP8 weight with its block scales, narrowed and concatenated together."""

    w: torch.Tensor
    s: torch.Tensor

    def narrow(self, dim: int, start: int, length: int, name: str) -> Fp8:
        size = self.w.shape[dim]
        if start % FP8_BLOCK or (length % FP8_BLOCK and start + length != size):
            raise ValueError(f"{name}: shard [{start}, {start + length}) cuts an FP8 block")
        nblocks = -(-length // FP8_BLOCK)
        return Fp8(
            self.w.narrow(dim, start, length), self.s.narrow(dim, start // FP8_BLOCK, nblocks)
        )


def _cat(parts: list, name: str) -> torch.Tensor | Fp8:
    if not isinstance(parts[0], Fp8):
        return torch.cat(parts)
    for p in parts[:-1]:
        if p.w.shape[0] % FP8_BLOCK:
            raise ValueError(f"{name}: fused part of {p.w.shape[0]} rows cuts an FP8 block")
    return Fp8(_u8cat([p.w for p in parts]), torch.cat([p.s for p in parts]))


def _stack(parts: list) -> torch.Tensor | Fp8:
    if not isinstance(parts[0], Fp8):
        return torch.stack(parts)
    w = _u8cat([p.w.unsqueeze(0) for p in parts])
    return Fp8(w, torch.stack([p.s for p in parts]))


def _u8cat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.contiguous().view(torch.uint8) for t in ts]).view(torch.float8_e4m3fn)


class _Loader:
    def __init__(self, cfg: ModelConfig, state: dict, shard: ShardSpec, fp8: bool,
                 moe: MoeSpelling):
        self.cfg, self.state, self.shard, self.fp8, self.moe = cfg, state, shard, fp8, moe
        self.dtype = getattr(torch, cfg.torch_dtype)
        self.out: dict[str, torch.Tensor] = {}
        self.used: set[str] = set()
        self.linear = {moe.gate, moe.up, moe.down}

    def get(self, name: str):
        self.used.add(name)
        t = self.state[name]
        module = name.split(".")[-2]
        linear = "proj" in module or module in self.linear
        quantize = self.fp8 and name.endswith(".weight") and linear
        if quantize:
            return Fp8(*quantize_fp8_blocks(t))
        return t.to(self.dtype)

    def put(self, name: str, value) -> None:
        if isinstance(value, Fp8):
            self.out[name] = value.w.contiguous()
            self.out[name + "_scale_inv"] = value.s.contiguous()
        else:
            self.out[name] = value.contiguous()

    def tp(self, value, dim: int, name: str, size: int | None = None, rank: int | None = None):
        size = self.shard.tp_size if size is None else size
        rank = self.shard.tp_rank if rank is None else rank
        n = _shape(value)[dim]
        if n % size:
            raise ValueError(f"{name}: dim {dim} of size {n} does not split over {size} ranks")
        return _narrow(value, dim, rank * (n // size), n // size, name)


def _shape(value) -> tuple[int, ...]:
    return tuple((value.w if isinstance(value, Fp8) else value).shape)


def _narrow(value, dim: int, start: int, length: int, name: str):
    if isinstance(value, Fp8):
        return value.narrow(dim, start, length, name)
    return value.narrow(dim, start, length)


def _vocab(ld: _Loader, name: str) -> None:
    w = ld.get(name)
    padded = (w.shape[0] + _PAD - 1) // _PAD * _PAD
    if padded % ld.shard.tp_size:
        raise ValueError(f"{name}: padded vocab {padded} does not split over tp")
    per = padded // ld.shard.tp_size
    start = ld.shard.tp_rank * per
    end = min(start + per, w.shape[0])
    if end > start:
        ld.put(name, w.narrow(0, start, end - start))


def _gqa_attention(ld: _Loader, p: str) -> None:
    cfg, tp, r = ld.cfg, ld.shard.tp_size, ld.shard.tp_rank
    total_kv, hd = cfg.kv_heads, cfg.head_size
    if cfg.num_attention_heads % tp:
        raise ValueError(f"{p}self_attn: {cfg.num_attention_heads} heads over tp={tp}")
    if (tp % total_kv) if tp >= total_kv else (total_kv % tp):
        raise ValueError(f"{p}self_attn: {total_kv} kv heads over tp={tp}")
    replicas, kv_heads = max(1, tp // total_kv), max(1, total_kv // tp)
    kv_start = (r // replicas) * kv_heads * hd
    for kind in ("weight", "bias"):
        names = [f"{p}self_attn.{x}_proj.{kind}" for x in "qkv"]
        if names[0] not in ld.state:
            continue
        q = ld.tp(ld.get(names[0]), 0, names[0])
        k = _narrow(ld.get(names[1]), 0, kv_start, kv_heads * hd, names[1])
        v = _narrow(ld.get(names[2]), 0, kv_start, kv_heads * hd, names[2])
        ld.put(f"{p}self_attn.qkv_proj.{kind}", _cat([q, k, v], f"{p}self_attn.qkv_proj"))
    name = f"{p}self_attn.o_proj.weight"
    ld.put(name, ld.tp(ld.get(name), 1, name))
    for extra in ("o_proj.bias", "q_norm.weight", "k_norm.weight"):
        if f"{p}self_attn.{extra}" in ld.state:
            ld.put(f"{p}self_attn.{extra}", ld.get(f"{p}self_attn.{extra}"))


def _mla_attention(ld: _Loader, p: str) -> None:
    a = f"{p}self_attn."
    if ld.cfg.num_attention_heads % ld.shard.tp_size:
        raise ValueError(f"{a}: heads do not split over tp={ld.shard.tp_size}")
    if f"{a}q_a_proj.weight" in ld.state:
        fused = [ld.get(f"{a}q_a_proj.weight"), ld.get(f"{a}kv_a_proj_with_mqa.weight")]
        ld.put(f"{a}fused_qkv_a_proj.weight", _cat(fused, f"{a}fused_qkv_a_proj"))
        ld.put(f"{a}q_a_layernorm.weight", ld.get(f"{a}q_a_layernorm.weight"))
        ld.put(f"{a}q_b_proj.weight", ld.tp(ld.get(f"{a}q_b_proj.weight"), 0, a + "q_b_proj"))
    else:
        ld.put(f"{a}q_proj.weight", ld.tp(ld.get(f"{a}q_proj.weight"), 0, a + "q_proj"))
        ld.put(f"{a}kv_a_proj_with_mqa.weight", ld.get(f"{a}kv_a_proj_with_mqa.weight"))
    ld.put(f"{a}kv_a_layernorm.weight", ld.get(f"{a}kv_a_layernorm.weight"))
    ld.put(f"{a}kv_b_proj.weight", ld.tp(ld.get(f"{a}kv_b_proj.weight"), 0, a + "kv_b_proj"))
    ld.put(f"{a}o_proj.weight", ld.tp(ld.get(f"{a}o_proj.weight"), 1, a + "o_proj"))


def _mlp(ld: _Loader, m: str, names=("gate_proj", "up_proj", "down_proj"), **tp) -> tuple:
    """(gate_up shard, down shard) of a SwiGLU module ``m`` whose gate/up/down linears
    are ``names`` (vLLM MergedColumn/Row)."""
    gate_n, up_n, down_n = names
    gate = ld.tp(ld.get(f"{m}.{gate_n}.weight"), 0, f"{m}.{gate_n}", **tp)
    up = ld.tp(ld.get(f"{m}.{up_n}.weight"), 0, f"{m}.{up_n}", **tp)
    down = ld.tp(ld.get(f"{m}.{down_n}.weight"), 1, f"{m}.{down_n}", **tp)
    return _cat([gate, up], f"{m}.gate_up_proj"), down


def _moe(ld: _Loader, m: str) -> None:
    ld.put(f"{m}.gate.weight", ld.get(f"{m}.gate.weight"))
    if f"{m}.gate.e_score_correction_bias" in ld.state:
        name = f"{m}.gate.e_score_correction_bias"
        ld.used.add(name)
        ld.put(name, ld.state[name].to(torch.float32))
    n_exp, s = ld.cfg.n_experts, ld.shard
    if s.ep_size > 1:  # vLLM expert parallelism: whole experts, no TP inside the MoE
        if n_exp % s.ep_size:
            raise ValueError(f"{m}.experts: {n_exp} experts over ep_size={s.ep_size}")
        local = range(s.ep_rank * n_exp // s.ep_size, (s.ep_rank + 1) * n_exp // s.ep_size)
        tp = {"size": 1, "rank": 0}
    else:
        local, tp = range(n_exp), {}
    names = (ld.moe.gate, ld.moe.up, ld.moe.down)
    for e in set(range(n_exp)) - set(local):  # other EP ranks' experts: skipped, as vLLM does
        ld.used.update(f"{m}.experts.{e}.{x}.weight" for x in names)
    w13, w2 = zip(*(_mlp(ld, f"{m}.experts.{e}", names, **tp) for e in local), strict=True)
    ld.put(f"{m}.experts.w13_weight", _stack(list(w13)))
    ld.put(f"{m}.experts.w2_weight", _stack(list(w2)))
    if f"{m}.shared_experts.gate_proj.weight" in ld.state:
        gate_up, down = _mlp(ld, f"{m}.shared_experts")
        ld.put(f"{m}.shared_experts.gate_up_proj.weight", gate_up)
        ld.put(f"{m}.shared_experts.down_proj.weight", down)


def _unstack(state: dict[str, torch.Tensor], moe: MoeSpelling) -> dict[str, torch.Tensor]:
    """transformers-5 3-D experts (and router) -> the checkpoint's per-expert tensors."""
    out = {}
    hf5 = f".{_HF5_BLOCK}."
    for name, t in state.items():
        layer, _, rest = name.partition(hf5)
        base = f"{layer}.{moe.block}.experts."
        if rest == "experts.gate_up_proj":
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, dim=0)
                out[f"{base}{e}.{moe.gate}.weight"], out[f"{base}{e}.{moe.up}.weight"] = gate, up
        elif rest == "experts.down_proj":
            for e in range(t.shape[0]):
                out[f"{base}{e}.{moe.down}.weight"] = t[e]
        elif rest == "gate.weight":
            out[f"{layer}.{moe.block}.gate.weight"] = t
        else:
            out[name] = t
    return out


def load_engine_shard(
    cfg: ModelConfig, hf_state: dict[str, torch.Tensor], shard: ShardSpec, *, fp8: bool
) -> dict[str, torch.Tensor]:
    """The engine tensors (vLLM names, local shapes) of ``shard`` from a HF state dict."""
    moe = MOE_SPELLING.get(cfg.architecture, MoeSpelling())
    ld = _Loader(cfg, _unstack(hf_state, moe), shard, fp8, moe)
    _vocab(ld, "model.embed_tokens.weight")
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        if f"{p}self_attn.kv_a_proj_with_mqa.weight" in ld.state:
            _mla_attention(ld, p)
        else:
            _gqa_attention(ld, p)
        if f"{p}{moe.block}.gate.weight" in ld.state:
            _moe(ld, f"{p}{moe.block}")
        else:
            gate_up, down = _mlp(ld, f"{p}mlp")
            ld.put(f"{p}mlp.gate_up_proj.weight", gate_up)
            ld.put(f"{p}mlp.down_proj.weight", down)
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            ld.put(p + norm, ld.get(p + norm))
    ld.put("model.norm.weight", ld.get("model.norm.weight"))
    if not cfg.tie_word_embeddings:
        _vocab(ld, "lm_head.weight")
    tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    unused = sorted(set(ld.state) - ld.used - tied)
    if unused:
        raise ValueError(f"load_engine_shard: checkpoint tensors not loaded: {unused}")
    return ld.out
