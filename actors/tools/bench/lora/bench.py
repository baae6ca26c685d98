"""``wt bench lora``: a LoRA adapter update into vLLM, ours against the disk path and a
full-weight update of the merged model (issue 35, item 6).

Per TP size and rank one engine (:func:`~.designs.start_rig`, ``max_lora_rank`` equal to
the rank, as docs/vllm.md advises: below it vLLM's ``lora_B`` slots are wider than the
adapter and every row is its own write) and a PEFT adapter over a base of the engine's
architecture; each design in turn (``ours``, ``disk``, ``merged``: :mod:`.designs`),
``--updates`` timed updates after one untimed warm-up, every update verified after its
window. While the updates run, a client
generates greedily on the engine (base requests, one batch after another), and vLLM's
own step timestamps give, per update:

* ``seconds``: the update from the trainer's tensors to the new version served;
* ``bytes``: what it moves (ours: the slots' bytes; disk: the checkpoint's files;
  merged: every engine byte);
* ``max_step_gap_s``: the longest gap between engine steps overlapping the update;
* ``idle_step_gap_s``: the engine's floor for the same measure: the median, over
  windows of the update's length while only the client runs, of the longest gap in each.

::

    wt bench lora --model configs/models/bench_dense.yaml --ranks 16,64 --tp 1 --json out.json
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from actors.tools.bench.lora import designs as D
from actors.tools.bench.stall.bench import idle_floor, stall_of

IDLE_S = 3.0  # the client alone before the updates: the engine's floor
SETTLE_S = 0.3  # the client alone around each update (the steps before and after it)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoraRun:
    design: str
    rank: int
    tp: int
    seconds: float
    bytes: int
    max_step_gap_s: float
    idle_step_gap_s: float
    verified: bool


class Client:
    """Greedy requests on the engine, one batch after another, until stopped."""

    def __init__(self, link: Any, vocab: int, *, max_new_tokens: int = 16) -> None:
        self.link, self.max_new_tokens = link, max_new_tokens
        self.prompts = [[(7 * i + j) % vocab for j in range(8)] for i in range(2)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lora-bench-client",
                                        daemon=True)
        self.error: BaseException | None = None

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self.link.generate(self.prompts, self.max_new_tokens)
        except BaseException as exc:  # reported by stop()
            self.error = exc

    def __enter__(self) -> Client:
        # The client and the trainer side share this process here (not in a deployment):
        # a thread that drops the GIL (every torch call of the prepare) waits up to the 5 ms
        # switch interval to get it back from the client's loop, so ours is slower here than
        # with the client in a process of its own (docs/performance.md).
        self._thread.start()
        count = self.link.clock.count
        while self.link.clock.count < count + 2 and self.error is None:
            time.sleep(0.05)  # steps flow
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        if self.error is not None and exc[0] is None:
            raise RuntimeError(f"the bench's client failed: {self.error!r}") from self.error


def bench_rank(rig: D.Rig, rank: int, designs: list[str], updates: int, *,
               idle_s: float = IDLE_S, warmup: bool = True) -> list[LoraRun]:
    """Each design in turn (``designs`` in the order of :data:`~.designs.DESIGNS`: merged
    last, as a full-weight update drops vLLM's adapters), ``updates`` timed updates each
    after one untimed warm-up (not for merged: its cost is the full write), each verified
    after its window (:data:`VERIFY`)."""
    model = D.adapter_model(rig, rank, seed=rank)
    D.setup_ours(rig, model)  # ours, and the oracle of disk
    windows: list[tuple[str, float, float, int, bool]] = []
    with Client(rig.link, rig.model_cfg.vocab_size):
        idle = (time.monotonic(), time.monotonic() + idle_s)
        time.sleep(idle_s)
        for design in designs:
            warm = int(warmup and design != "merged")
            for u in range(updates + warm):
                D.train_step(model, seed=1000 * rank + 10 * u + len(windows))
                time.sleep(SETTLE_S)  # steps flow again after the last check
                t0 = time.monotonic()
                nbytes = D.DESIGNS[design](rig, model)
                t1 = time.monotonic()
                time.sleep(SETTLE_S)
                ok = VERIFY[design](rig, model)
                if u >= warm:
                    windows.append((design, t0, t1, nbytes, ok))
    steps = rig.link.clock.times()
    return [LoraRun(design=d, rank=rank, tp=rig.tp, seconds=t1 - t0, bytes=n,
                    max_step_gap_s=stall_of(steps, t0, t1),
                    idle_step_gap_s=idle_floor(steps, *idle, t1 - t0), verified=ok)
            for d, t0, t1, n, ok in windows]


def _ours_ok(rig: D.Rig, model: Any) -> bool:
    D.disk(rig, model)  # vLLM's own load of the same version, untimed
    return D.slots_equal(rig)


def _disk_ok(rig: D.Rig, model: Any) -> bool:
    D.ours(rig, model)  # ours of the same version, untimed
    return D.slots_equal(rig)


# Per design, after its window: ours and disk leave equal bytes in every slot tensor of
# every rank (the other written untimed); merged: every registered byte equals vLLM's
# load_weights of the merged checkpoint.
VERIFY = {"ours": _ours_ok, "disk": _disk_ok, "merged": D.merged_equal}


def summarize(runs: list[LoraRun]) -> list[dict[str, Any]]:
    """Per (design, rank, tp): the median seconds and the worst step gap."""
    out = []
    keys = sorted({(r.tp, r.rank, r.design) for r in runs})
    for tp, rank, design in keys:
        rs = [r for r in runs if (r.tp, r.rank, r.design) == (tp, rank, design)]
        out.append(dict(design=design, rank=rank, tp=tp,
                        seconds=statistics.median(r.seconds for r in rs), bytes=rs[0].bytes,
                        max_step_gap_s=max(r.max_step_gap_s for r in rs),
                        idle_step_gap_s=statistics.median(r.idle_step_gap_s for r in rs),
                        verified=all(r.verified for r in rs)))
    return out


def print_table(runs: list[LoraRun]) -> None:
    from rich.console import Console
    from rich.table import Table

    rows = summarize(runs)
    disk = {(r["tp"], r["rank"]): r["seconds"] for r in rows if r["design"] == "disk"}
    table = Table(title="LoRA adapter update into vLLM (median of the updates)")
    for col in ("design", "rank", "tp", "seconds", "bytes", "vs disk", "max step gap (ms)",
                "idle gap (ms)", "verified"):
        table.add_column(col)
    for r in rows:
        ref = disk.get((r["tp"], r["rank"]))
        table.add_row(r["design"], str(r["rank"]), str(r["tp"]), f"{r['seconds']:.4f}",
                      f"{r['bytes']:,}", f"{ref / r['seconds']:.1f}x" if ref else "-",
                      f"{r['max_step_gap_s'] * 1e3:.1f}", f"{r['idle_step_gap_s'] * 1e3:.1f}",
                      "yes" if r["verified"] else "NO")
    Console(stderr=True).print(table)


def run(*, model: Path, ranks: str = "16,64", tp: str = "1",
        designs: str = "ours,disk,merged", updates: int = 3,
        json_out: Path | None = None) -> int:
    """The bench (see the module docstring); exit status 1 when a run is not verified."""
    rank_list = [int(r) for r in ranks.split(",")]
    tp_list = [int(t) for t in tp.split(",")]
    asked = {d.strip() for d in designs.split(",")}
    design_list = [d for d in D.DESIGNS if d in asked]  # in this order (see bench_rank)
    unknown = sorted(asked - set(D.DESIGNS))
    if unknown:
        raise ValueError(f"--designs: unknown {unknown} (known: {sorted(D.DESIGNS)})")
    runs: list[LoraRun] = []
    for size in tp_list:
        for rank in rank_list:  # max_lora_rank = the rank: one write per slot tensor
            with tempfile.TemporaryDirectory(prefix="wt-bench-lora-") as tmp:
                rig = D.start_rig(model, tp=size, max_rank=rank, root=Path(tmp))
                try:
                    runs += bench_rank(rig, rank, design_list, updates)
                finally:
                    close_rig(rig)
    print_table(runs)
    out = {"runs": [asdict(r) for r in runs]}
    if json_out is not None:
        text = json.dumps(out, indent=2)
        if str(json_out) == "-":
            print(text)
        else:
            json_out.write_text(text + "\n")
    return 0 if all(r.verified for r in runs) else 1


def close_rig(rig: D.Rig) -> None:
    try:
        rig.link.close()
    finally:
        rig.llm.llm_engine.engine_core.shutdown()
