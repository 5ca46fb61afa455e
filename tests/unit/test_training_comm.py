"""``--comm`` (``TrainConfig.comm``): which communicator a training run exchanges over, and that
the trainer hands it to the embedding and the optimizer. NCCL itself needs GPUs
(tests/gpu/test_nccl_comm_gpu.py); here CuPy, NCCL and MPI are stand-ins that record what was
built, so the choice and its refusals are checked on any machine."""
import sys
import types

import pytest

import one_embedding as oe
from one_embedding import training
from one_embedding.config import TrainConfig
from one_embedding.errors import ConfigError
from one_embedding.parallel import comm as comm_mod


class _FakeMpi(comm_mod.LocalComm):
    """An MpiComm stand-in: ``world`` ranks, ``local`` of them on this node."""

    def __init__(self, world=1, local=1):
        self.rank, self.world, self.local_size = 0, world, local


class _FakeNccl:
    def __init__(self, mpi):
        self.mpi = mpi


@pytest.fixture
def machine(monkeypatch):
    """set(world, local ranks, gpus, nccl loadable) -> the default communicator."""
    def set_up(world, local, gpus, nccl=True):
        base = _FakeMpi(world, local) if world > 1 else comm_mod.LocalComm()
        cupy = types.ModuleType("cupy")
        cupy.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(
            getDeviceCount=lambda: gpus))
        monkeypatch.setitem(sys.modules, "cupy", cupy)
        monkeypatch.setattr(comm_mod, "default_comm", lambda: base)
        monkeypatch.setattr(comm_mod, "nccl_available", lambda: nccl)
        monkeypatch.setattr(comm_mod, "MpiComm", _FakeMpi)
        monkeypatch.setattr(comm_mod, "NcclComm", _FakeNccl)
        return base
    return set_up


def test_auto_takes_nccl_for_several_ranks_each_with_a_gpu(machine):
    base = machine(world=4, local=2, gpus=2)
    chosen = comm_mod.training_comm("auto", on_gpu=True)
    assert isinstance(chosen, _FakeNccl) and chosen.mpi is base      # bootstrapped by the job's MPI
    assert comm_mod.training_comm("mpi", on_gpu=True) is base
    assert comm_mod.training_comm("auto", on_gpu=False) is base      # --device cpu


@pytest.mark.parametrize("world,local,gpus,nccl", [(1, 1, 1, True),     # one rank: nothing to send
                                                   (2, 2, 1, True),     # two ranks share a GPU
                                                   (2, 2, 2, False)])   # CuPy without NCCL
def test_auto_stays_on_mpi_where_nccl_cannot_run(machine, world, local, gpus, nccl):
    base = machine(world, local, gpus, nccl)
    assert comm_mod.training_comm("auto", on_gpu=True) is base


def test_nccl_is_refused_by_name_where_it_cannot_run(machine):
    machine(world=2, local=2, gpus=1)
    with pytest.raises(ConfigError, match=r"--comm nccl: 2 ranks on this node share 1 GPU.*"
                                          r"--comm mpi"):
        comm_mod.training_comm("nccl", on_gpu=True)
    machine(world=2, local=2, gpus=2, nccl=False)
    with pytest.raises(ConfigError, match="nvidia-nccl-cu12"):
        comm_mod.training_comm("nccl", on_gpu=True)
    with pytest.raises(ConfigError, match="add --device cuda"):
        comm_mod.training_comm("nccl", on_gpu=False)
    with pytest.raises(ConfigError, match=r"--comm nccl.*add --device cuda"):
        TrainConfig(comm="nccl")
    with pytest.raises(ConfigError, match="comm='ucx' \\(--comm\\): choose one of"):
        TrainConfig(comm="ucx")


def test_nccl_over_one_rank_bootstraps_its_own_mpi(machine):
    machine(world=1, local=1, gpus=1)
    chosen = comm_mod.training_comm("nccl", on_gpu=True)    # a one-rank NCCL run (the GPU test)
    assert isinstance(chosen, _FakeNccl) and isinstance(chosen.mpi, _FakeMpi)


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
