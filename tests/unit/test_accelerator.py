"""Device and backend choice, decided from what the machine has, tested without a GPU."""

from __future__ import annotations

import pytest
import torch

from elastic_rt.accelerator import (
    GLOO,
    MIXED,
    backend_from_env,
    choose_backend,
    choose_device,
    use_worker_device,
    uses_nccl,
    worker_device,
)
from elastic_rt.config import BACKEND_ENV
from elastic_rt.errors import ConfigError
from elastic_rt.process_groups import abort_groups


@pytest.mark.parametrize(("local_rank", "cuda", "count", "want"), [
    (0, False, 0, "cpu"),
    (3, False, 0, "cpu"),  # no CUDA: every local rank trains on the CPU
    (0, True, 1, "cuda:0"),
    (5, True, 8, "cuda:5"),
])
def test_each_worker_uses_the_gpu_of_its_local_rank(local_rank: int, cuda: bool, count: int,
                                                    want: str) -> None:
    got = choose_device(local_rank=local_rank, cuda_available=cuda, device_count=count)
    assert got == torch.device(want)


def test_more_workers_than_gpus_is_one_clear_error_naming_the_fix() -> None:
    with pytest.raises(ConfigError) as err:
        choose_device(local_rank=2, cuda_available=True, device_count=2)
    assert "LOCAL_RANK=2" in err.value.problem and "--nproc-per-node" in err.value.fix


@pytest.mark.parametrize(("cuda", "requested", "want"), [
    (False, None, GLOO),
    (True, None, MIXED),  # NCCL for CUDA tensors, gloo for the runtime's CPU ones
    (True, "", MIXED),
    (True, "gloo", GLOO),  # several workers sharing one GPU
    (True, " NCCL ", MIXED),
    (False, "gloo", GLOO),
])
def test_groups_use_nccl_exactly_when_cuda_is_there_unless_told(
    cuda: bool, requested: str | None, want: str
) -> None:
    assert choose_backend(cuda_available=cuda, requested=requested) == want


@pytest.mark.parametrize(("cuda", "requested"), [(False, "nccl"), (True, "mpi"), (True, "nccl2")])
def test_a_backend_that_cannot_work_is_refused_naming_the_variable(
    cuda: bool, requested: str
) -> None:
    with pytest.raises(ConfigError) as err:
        choose_backend(cuda_available=cuda, requested=requested)
    assert BACKEND_ENV in err.value.problem and BACKEND_ENV in err.value.fix


def test_only_mixed_groups_count_as_nccl() -> None:
    assert uses_nccl(MIXED) and uses_nccl("nccl")
    assert not uses_nccl(GLOO)


def test_a_machine_without_cuda_trains_on_the_cpu_over_gloo(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a GPU machine
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert worker_device() == torch.device("cpu")
    assert use_worker_device(3) == torch.device("cpu")
    assert backend_from_env({}) == GLOO
    with pytest.raises(ConfigError):
        backend_from_env({BACKEND_ENV: "nccl"})


def test_aborting_with_no_groups_is_a_no_op() -> None:
    assert abort_groups() == 0  # e.g. a notice before the first round formed


def test_a_worker_without_a_gpu_of_its_own_stays_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One GPU, local rank 1: the worker starts (its model may be a CPU one); asking for
    its GPU is what fails, with the fix."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert use_worker_device(1) == torch.device("cpu")
    with pytest.raises(ConfigError, match="no GPU of its own"):
        worker_device()
