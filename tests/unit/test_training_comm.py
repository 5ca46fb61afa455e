"""``--comm`` (``TrainConfig.comm``): which communicator a training run exchanges over, and that
the trainer hands it to the embedding and the optimizer. NCCL itself needs GPUs
(tests/gpu/test_nccl_comm_gpu.py); here CuPy, NCCL and MPI are stand-ins that record what was
built, so the choice and its refusals are checked on any machine."""
import socket
import sys
import types

import numpy as np
import pytest

import one_embedding as oe
from one_embedding import training
from one_embedding.config import TrainConfig
from one_embedding.errors import ConfigError
from one_embedding.parallel import comm as comm_mod


HOST = socket.gethostname()


class _FakeMpi(comm_mod.LocalComm):
    """An MpiComm stand-in for rank 0 of ``1 + len(peers)`` ranks, ``local`` of them on this
    machine; ``allgather`` answers with this rank's rows and then each peer's row (its GPU
    identity "host/bus id" and whether its CuPy loads NCCL), as ``_nccl_problem`` sends them."""

    def __init__(self, peers=(), local=1):
        self.rank, self.world, self.local_size, self.local_rank = 0, 1 + len(peers), local, 0
        self.peers = peers

    def allgather(self, array):
        rows = [array]
        for identity, nccl in self.peers:
            row = np.zeros_like(array)
            row[0, :len(identity)] = np.frombuffer(identity.encode(), np.uint8)
            row[0, -1] = nccl
            rows.append(row)
        return np.concatenate(rows)


class _FakeNccl:
    def __init__(self, mpi):
        self.mpi = mpi


@pytest.fixture
def machine(monkeypatch):
    """set(peers, visible GPUs' bus ids, local ranks, this rank's NCCL) -> the default
    communicator (this rank's GPU is the first visible one: local rank 0)."""
    def set_up(peers=(), buses=("0000:01:00.0",), local=1, nccl=True):
        base = _FakeMpi(peers, local) if peers else comm_mod.LocalComm()
        cupy = types.ModuleType("cupy")
        cupy.cuda = types.SimpleNamespace(
            runtime=types.SimpleNamespace(getDeviceCount=lambda: len(buses)),
            Device=lambda i: types.SimpleNamespace(id=i, pci_bus_id=buses[i]))
        monkeypatch.setitem(sys.modules, "cupy", cupy)
        monkeypatch.setattr(comm_mod, "default_comm", lambda: base)
        monkeypatch.setattr(comm_mod, "nccl_available", lambda: nccl)
        monkeypatch.setattr(comm_mod, "MpiComm", _FakeMpi)
        monkeypatch.setattr(comm_mod, "NcclComm", _FakeNccl)
        return base
    return set_up


def test_auto_takes_nccl_for_several_ranks_each_with_a_gpu(machine):
    base = machine(peers=[(f"{HOST}/0000:02:00.0", True), ("other/0000:01:00.0", True)],
                   buses=("0000:01:00.0", "0000:02:00.0"), local=2)
    chosen = comm_mod.training_comm("auto", on_gpu=True)
    assert isinstance(chosen, _FakeNccl) and chosen.mpi is base      # bootstrapped by the job's MPI
    assert comm_mod.training_comm("mpi", on_gpu=True) is base
    assert comm_mod.training_comm("auto", on_gpu=False) is base      # --device cpu


def test_ranks_bound_to_a_gpu_each_by_the_scheduler_take_nccl(machine):
    """Each rank sees one GPU (CUDA_VISIBLE_DEVICES set per task): two ranks on a machine, each
    with "its GPU 0", are two GPUs all the same (other bus ids), so NCCL runs."""
    machine(peers=[(f"{HOST}/0000:41:00.0", True)], buses=("0000:01:00.0",), local=2)
    assert isinstance(comm_mod.training_comm("auto", on_gpu=True), _FakeNccl)
    assert comm_mod.local_gpu(types.SimpleNamespace(local_rank=1)) == 0


@pytest.mark.parametrize("peers,nccl", [((), True),                               # one rank
                                        ([(f"{HOST}/0000:01:00.0", True)], True),  # shared GPU
                                        ([(f"{HOST}/0000:02:00.0", False)], True),  # peer: no NCCL
                                        ([(f"{HOST}/0000:02:00.0", True)], False)])  # here: none
def test_auto_stays_on_mpi_where_nccl_cannot_run(machine, peers, nccl):
    base = machine(peers=peers, local=2, nccl=nccl)
    assert comm_mod.training_comm("auto", on_gpu=True) is base


def test_nccl_is_refused_by_name_where_it_cannot_run(machine):
    machine(peers=[(f"{HOST}/0000:01:00.0", True)], local=2)
    with pytest.raises(ConfigError, match=rf"--comm nccl: ranks 0 and 1 share the GPU "
                                          rf"{HOST}/0000:01:00.0 .* or use --comm mpi"):
        comm_mod.training_comm("nccl", on_gpu=True)
    machine(peers=[(f"{HOST}/0000:02:00.0", False)], local=2)
    with pytest.raises(ConfigError, match=r"on rank\(s\) \[1\]: pip install nvidia-nccl-cu12"):
        comm_mod.training_comm("nccl", on_gpu=True)
    with pytest.raises(ConfigError, match="add --device cuda"):
        comm_mod.training_comm("nccl", on_gpu=False)
    with pytest.raises(ConfigError, match=r"--comm nccl.*add --device cuda"):
        TrainConfig(comm="nccl")
    with pytest.raises(ConfigError, match="comm='ucx' \\(--comm\\): choose one of"):
        TrainConfig(comm="ucx")


def test_nccl_over_one_rank_bootstraps_its_own_mpi(machine):
    machine()
    chosen = comm_mod.training_comm("nccl", on_gpu=True)    # a one-rank NCCL run (the GPU test)
    assert isinstance(chosen, _FakeNccl) and isinstance(chosen.mpi, _FakeMpi)


def test_a_rank_takes_the_gpu_of_its_place_on_the_machine(machine):
    machine(buses=tuple(f"0000:{i:02x}:00.0" for i in range(8)))
    assert [comm_mod.local_gpu(types.SimpleNamespace(local_rank=r)) for r in (0, 3, 9)] == \
        [0, 3, 1]


def test_the_trainer_hands_its_communicator_to_the_embedding_and_the_optimizer(monkeypatch):
    picked = []

    def pick(choice, on_gpu):
        picked.append((choice, on_gpu))
        return _FakeMpi()                   # one rank: every exchange is local

    monkeypatch.setattr(training, "training_comm", pick)
    trainer = training.Trainer(TrainConfig(steps=1, batch_size=64, comm="mpi",
                                           synthetic_scale=0.001), progress=False,
                               metrics_stdout=False)
    assert picked == [("mpi", False)]
    assert type(trainer.comm) is _FakeMpi
    assert trainer.embedding.comm is trainer.comm and trainer.optimizer.comm is trainer.comm
    trainer.embedding.close()


def test_a_model_given_its_embedding_refuses_a_communicator_for_another():
    emb = oe.models.base.build_embedding("e", [16], 26, None, None, 0)
    with pytest.raises(ConfigError, match="comm was given together with embedding="):
        oe.models.DLRM(embedding=emb, comm=comm_mod.LocalComm())
    emb.close()
    local = comm_mod.LocalComm()
    model = oe.models.DLRM(num_tables=2, embedding_dim=4, bottom_mlp=(4,), table_sizes=(10, 10),
                           comm=local)
    assert model.embedding.comm is local
    model.embedding.close()


def test_no_gpu_is_refused_before_the_ranks_look_for_nccl(monkeypatch):
    """--device cuda without a GPU: the trainer says so by name before choosing a communicator
    (which, over several ranks, would look for each rank's GPU)."""
    from one_embedding.backend import cupy_available

    if cupy_available():
        pytest.skip("a GPU is visible here")

    def pick(choice, on_gpu):
        raise AssertionError("the communicator was chosen before the device was checked")

    monkeypatch.setattr(training, "training_comm", pick)
    with pytest.raises(ConfigError, match="--device cuda: no CUDA device is visible"):
        training.Trainer(TrainConfig(steps=1, batch_size=64, device="cuda"), progress=False,
                         metrics_stdout=False)
