"""FP8 into vLLM, checked where FP8 kernels cannot run: vLLM's own Llama class with a
block-FP8 quantization config (float8_e4m3fn weights, float32 weight_scale_inv), TP=2,
built in two processes without an engine (:mod:`actors.tools.testkit.vllm_meta`). On the meta device
its load_weights is recorded as our backend records it; the recorded pieces must equal
our rule tables' FP8 pieces, and the bytes the trainers' quantization lays out from them
must equal what vLLM's own load_weights makes of the FP8 checkpoint of the same weights,
both from full tensors and shard-direct (each covered piece cut into parts quantized
from one FSDP rank's block alone). No engine start (about 40-60 s here).
"""

from __future__ import annotations

from pathlib import Path

import pytest

# Skipped where vLLM cannot be imported (tests/conftest.py).
pytestmark = [pytest.mark.vllm]

LLAMA = Path(__file__).parents[2] / "configs" / "models" / "tiny_llama.yaml"


def test_fp8_layout_recorded_from_vllm_matches_our_tables_and_its_loader(tmp_path):
    from actors.tools.testkit.vllm_meta import check_fp8_layout

    results = check_fp8_layout(LLAMA, tp_size=2, root=tmp_path)
    assert len(results) == 2
    for rank, r in enumerate(results):
        assert r["table"] == [], f"tp rank {rank}"
        assert r["bytes"] == [], f"tp rank {rank}"  # from full tensors and shard-direct
        assert r["direct_parts"] > 0, f"tp rank {rank}: no piece was shard-direct"
        assert r["transforms"] == ["copy", "fp8_scale", "fp8_weight"]
        qkv = "model.layers.0.self_attn.qkv_proj.weight"
        # 1024 rows of q|k|v over 2 ranks (head_dim 128), 128x128 scale blocks
        assert r["params"][qkv] == [[512, 256], "float8_e4m3fn"]
        assert r["params"][qkv + "_scale_inv"] == [[4, 2], "float32"]
        assert r["params"]["model.layers.0.self_attn.o_proj.weight_scale_inv"] == [
            [2, 2], "float32"]
