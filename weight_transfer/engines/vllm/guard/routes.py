"""The routes of a served vLLM that only the controller may call (a table), and how a
request's path names its route."""

from __future__ import annotations

from collections.abc import Mapping

# The routes of vLLM 0.32 that change weights or serving state, and what an outsider did
# with each (docs/security.md). Reads stay open: /weight_info, /is_paused, /get_world_size,
# /server_info, /health, /v1/models, generation. /v1/load_lora_adapter and
# /v1/unload_lora_adapter change the served weights too; they sit under /v1 (vLLM's
# --api-key) and are guarded here as well.
GUARDED: Mapping[str, str] = {
    "/pause": "pauses (or aborts) generation mid-update or at any time",
    "/resume": "resumes generation while an update is writing (the engine serves torn weights)",
    "/abort_requests": "aborts every request in flight",
    "/init_weight_transfer_engine": "runs our backend's operations (setup, close, stats)",
    "/shutdown_weight_transfer_engine": "shuts the weight-transfer engine down",
    "/start_weight_update": "opens the update window (tcp: writes accepted)",
    "/start_draft_weight_update": "opens the draft model's update window",
    "/update_weights": "loads weights",
    "/finish_weight_update": "ends an update mid-transfer (a torn replica)",
    "/update_weight_version": "relabels the served version",
    "/weight_checker": "resets weights (action reset); checksums every weight",
    "/collective_rpc": "calls any worker method",
    "/sleep": "offloads or drops the weights and KV cache",
    "/wake_up": "reloads weights and KV cache",
    "/release_kv_cache_memory": "frees the KV cache",
    "/reset_prefix_cache": "drops cached prefixes (and recomputes running requests)",
    "/reset_mm_cache": "drops the multimodal cache",
    "/reset_encoder_cache": "drops the encoder cache",
    "/start_profile": "starts the profiler (slows serving, writes traces)",
    "/stop_profile": "stops the profiler",
    "/scale_elastic_ep": "rescales the engine's expert parallelism",
    "/fault_tolerance/apply": "applies a fault-tolerance instruction",
    "/v1/load_lora_adapter": "loads a LoRA adapter into the served model",
    "/v1/unload_lora_adapter": "unloads a LoRA adapter",
    # Ours, answered by the guard itself (guard/lora_names.py): not a route of vLLM's.
    "/wt/lora_name": "serves a name as a LoRA adapter id, or serves it no more",
}


def route_of(path: str, root_path: str = "") -> str:
    """The route vLLM's router matches (as Starlette strips ``root_path``), without a
    trailing slash (a redirect would lead there)."""
    if root_path and path.startswith(root_path) and path[len(root_path):len(root_path) + 1] in (
            "/", ""):
        path = path[len(root_path):]
    return path.rstrip("/") or "/"


def is_guarded(path: str, root_path: str = "") -> bool:
    return route_of(path, root_path) in GUARDED
