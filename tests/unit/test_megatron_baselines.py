"""The Megatron baselines of ``wt bench designs`` (slime's ``native``), pure: their refusals.

One broadcast group joins trainer rank 0 and the engine ranks, so rank 0 must hold every
parameter once gathered over TP; a model with pipeline stages or expert parallelism is
refused before any collective, naming the rank and the size (the design runs in
tests/integration/test_megatron_trainers.py's smoke run).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from actors.tools.bench.baselines_megatron import gathered


@pytest.mark.parametrize(("pp", "ep", "says"), [(2, 1, "PP 2"), (1, 2, "EP 2")])
def test_pipeline_stages_and_expert_parallelism_are_refused(pp, ep, says):
    model = SimpleNamespace(config=SimpleNamespace(pipeline_model_parallel_size=pp,
                                                   expert_model_parallel_size=ep))
    with pytest.raises(ValueError, match=f"trainer rank 3: .*this model has {says}"):
        next(gathered(model, vocab=1000, rank=3))
