"""The error tree: one root, builtin bases kept, typed fields that survive pickling;
fault kinds from exception types; a vLLM worker's exception carried back whole."""

from __future__ import annotations

import pickle

import pytest

from actors.controller.engine_control import RankFault
from actors.tools.cli.plots import MissingExtraError
from actors.tools.testkit.harness import RemoteTargetError
from scheduling.cluster.topology import NoHardwareError
from weight_transfer.engines.vllm.mailbox import Failure
from weight_transfer.errors import (
    BarrierRefusedError,
    BarrierTimeoutError,
    FaultKind,
    IntegrityError,
    UpdateError,
    WeightTransferError,
)
from weight_transfer.sender.pipeline import PipelineError
from weight_transfer.transport.base import (
    LinkDownError,
    PeerUnreachableError,
    RemoteAccessError,
    RetriesExhaustedError,
    TransientTransportError,
    TransportError,
)
from weight_transfer.transport.rdma.cuda import CudaDmaBufError
from weight_transfer.transport.rdma.verbs import RdmaUnavailableError

UPDATE = UpdateError("update to version 3 failed on trainer ranks [1]: boom", version=3,
                     ranks={1: "RuntimeError: boom"}, torn=["engine1"],
                     replicas={"engine1": "engine1/tp0 dead at wt_pause: ..."},
                     lost=["engine1"], resynced=[], rank_kinds={1: FaultKind.FAILED},
                     replica_kinds={"engine1": (FaultKind.DEAD,)})

ERRORS = [
    (UPDATE, RuntimeError),
    (IntegrityError("copy from engine0 to engine1: ...", replicas=["engine1"]), RuntimeError),
    (BarrierTimeoutError("barrier wt/v3/g0: ranks [2] ...", barrier="wt/v3/g0", missing=[2],
                         timeout_s=30.0), TimeoutError),
    (BarrierRefusedError("barrier b/v3/g0: forged arrival of rank 2 ...", barrier="b/v3/g0",
                         rank=2, tag="v3/g0", reason="forged"), RuntimeError),
    (TransportError("write into engine0/tp0 failed"), RuntimeError),
    (RemoteAccessError("rkey 7 revoked"), TransportError),
    (PeerUnreachableError("engine0/tp0 is dead"), TransportError),
    (TransientTransportError("link flapped"), TransportError),
    (LinkDownError("link down"), PeerUnreachableError),
    (RetriesExhaustedError("3 tries"), TransportError),
    (PipelineError("stage prepare failed"), RuntimeError),
    (CudaDmaBufError("no dma-buf"), RuntimeError),
    (RdmaUnavailableError("no device"), RuntimeError),
    (NoHardwareError("no GPU"), RuntimeError),
    (MissingExtraError("install the plots extra"), RuntimeError),
    (RemoteTargetError("target died"), RuntimeError),
]


@pytest.mark.parametrize("err,base", ERRORS, ids=[type(e).__name__ for e, _ in ERRORS])
def test_every_error_is_a_weight_transfer_error_that_pickles_with_its_fields(err, base):
    assert isinstance(err, WeightTransferError) and isinstance(err, base)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err) and back.args == err.args
    assert vars(back) == vars(err)


def test_update_error_keeps_its_typed_fields_across_pickle():
    back = pickle.loads(pickle.dumps(UPDATE))
    assert (back.version, back.ranks, back.torn, back.lost) == (3, {1: "RuntimeError: boom"},
                                                                ["engine1"], ["engine1"])
    assert back.rank_kinds == {1: FaultKind.FAILED} and back.rank_kinds[1] is FaultKind.FAILED
    assert back.replica_kinds == {"engine1": (FaultKind.DEAD,)}


def test_fault_kinds_are_their_labels_and_rank_faults_take_them_by_value():
    assert FaultKind.DEAD == "dead" and str(FaultKind.UNRESPONSIVE) == "unresponsive"
    fault = RankFault(replica="engine1", rank=1, kind="dead", method="wt_pause", error="x")
    assert fault.kind is FaultKind.DEAD and fault.kind.silent
    assert fault.describe() == "engine1/tp1 dead at wt_pause: x"
    with pytest.raises(ValueError, match="'asleep' is not a valid FaultKind"):
        RankFault(replica="engine1", rank=1, kind="asleep", method="wt_pause", error="x")


def test_fault_kind_is_read_from_the_exception_type_not_its_message():
    import ray

    from actors.controller.engine_control import fault_kind_of

    died = ray.exceptions.ActorDiedError()
    assert fault_kind_of(died) is FaultKind.DEAD
    assert fault_kind_of(ray.exceptions.ActorUnavailableError("gone for now", None)) \
        is FaultKind.UNRESPONSIVE
    assert fault_kind_of(ray.exceptions.GetTimeoutError("late")) is FaultKind.UNRESPONSIVE
    assert fault_kind_of(IntegrityError("bytes differ")) is FaultKind.INTEGRITY
    assert fault_kind_of(RuntimeError("ActorDiedError in the message")) is FaultKind.FAILED


def _failure_of(exc: BaseException) -> Failure:
    try:
        raise exc
    except BaseException as raised:
        return Failure.of(raised)


def test_a_vllm_worker_failure_comes_back_as_the_exception_it_raised():
    for exc in (ValueError("unknown operation 'x'"), KeyError("tensor"),
                BarrierTimeoutError("barrier b: ranks [1]", barrier="b", missing=[1])):
        failure = pickle.loads(pickle.dumps(_failure_of(exc)))
        err = failure.exception("vLLM worker rank 1, setup")
        fields = {k: v for k, v in vars(err).items() if k != "__notes__"}
        assert type(err) is type(exc) and err.args == exc.args and fields == vars(exc)
        assert any(n.startswith("vLLM worker rank 1, setup, in the vLLM worker:")
                   for n in err.__notes__)


def test_a_vllm_worker_failure_that_does_not_pickle_is_a_runtime_error_naming_it():
    class Local(Exception):  # not importable by the driver: pickling it fails
        pass

    err = _failure_of(Local("no way back")).exception("vLLM worker rank 0, setup")
    assert type(err) is RuntimeError
    assert str(err) == "vLLM worker rank 0, setup: Local: no way back"
