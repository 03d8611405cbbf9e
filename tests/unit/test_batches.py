"""The loader path: DataLoader batches over the ElasticSampler stay exact through re-splits,
retried steps, epoch ends and checkpoint resumes."""

from __future__ import annotations

import json
from collections import Counter
from typing import NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import Dataset, IterableDataset

from elastic_rt.errors import ConfigError
from elastic_rt.sampler import ElasticSampler
from elastic_rt.worker.batches import BatchSource, LoaderOptions, check_dataset, to_device


class _Indices(Dataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


def _collate(batch: list[int]) -> torch.Tensor:
    return torch.tensor(batch, dtype=torch.long)


class _Rank:
    """One data-parallel rank: its sampler and its batch source."""

    def __init__(self, n: int, state: dict[str, int], dp_rank: int, dp_size: int,
                 options: LoaderOptions, **sampler_args: object) -> None:
        self.sampler = ElasticSampler(n, **sampler_args)  # type: ignore[arg-type]
        self.sampler.load_state_dict(state)
        self.sampler.set_world(dp_rank, dp_size)
        self.source = BatchSource(_Indices(n), self.sampler, options)

    def step_indices(self) -> list[int]:
        return sum((batch.tolist() for batch, _ in self.source.next_step()), [])


def _world(n: int, state: dict[str, int], dp_size: int, options: LoaderOptions,
           **sampler_args: object) -> list[_Rank]:
    return [_Rank(n, state, r, dp_size, options, **sampler_args) for r in range(dp_size)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_loader_batches_use_every_sample_once_per_epoch_through_resplits_and_retries(
    data: st.DataObject,
) -> None:
    n = data.draw(st.integers(1, 40), label="dataset_len")
    sampler_args = {
        "global_batch_size": data.draw(st.integers(1, 12), label="global_batch_size"),
        "seed": data.draw(st.integers(0, 1000), label="seed"),
        "micro_batch_size": data.draw(st.none() | st.integers(1, 4), label="micro_batch_size"),
    }
    options = LoaderOptions(collate_fn=_collate)
    reference = ElasticSampler(n, **sampler_args)  # type: ignore[arg-type]
    ranks = _world(n, reference.state_dict(), data.draw(st.integers(1, 6)), options,
                   **sampler_args)
    used: Counter[int] = Counter()
    while reference.epoch < 2:  # across an epoch's end: the loader prefetches past it
        event = data.draw(st.sampled_from(["step", "step", "step", "retry", "re-form"]))
        if event == "re-form":  # survivors keep their source; joiners load a JSON state
            state = json.loads(json.dumps(ranks[0].sampler.state_dict()))
            dp_size = data.draw(st.integers(1, 6), label="dp_size")
            survivors = ranks[:dp_size]
            for dp_rank, r in enumerate(survivors):
                r.sampler.set_world(dp_rank, dp_size)
                r.source.reset()
            ranks = survivors + _world(n, state, dp_size, options,
                                       **sampler_args)[len(survivors):]
            continue
        fetched = [r.step_indices() for r in ranks]
        assert sum(fetched, []) == reference.global_batch()
        if event == "retry":  # the step failed after its batches were read: read again
            for r in ranks:
                r.source.reset()
            continue
        used.update(sum(fetched, []))
        everyone: list[_Rank | ElasticSampler] = [*ranks, reference]
        for who in everyone:
            (who.sampler if isinstance(who, _Rank) else who).advance()
    assert used == Counter({i: 2 for i in range(n)})


def test_worker_processes_prefetch_and_survive_a_resplit_without_losing_a_sample() -> None:
    n, args = 29, {"global_batch_size": 6, "seed": 3, "micro_batch_size": 2}
    options = LoaderOptions(num_workers=2, prefetch_factor=2, collate_fn=_collate)
    sampler = ElasticSampler(n, **args)  # type: ignore[arg-type]
    rank = _Rank(n, sampler.state_dict(), 0, 1, options, **args)
    used: list[int] = []
    for step in range(12):  # two epochs and more
        if step == 3:  # re-split to 2 ranks, then keep rank 0's source (persistent workers)
            workers = rank.source.loader._iterator._workers  # type: ignore[union-attr]
            other = _Rank(n, rank.sampler.state_dict(), 1, 2, options, **args)
            rank.sampler.set_world(0, 2)
            rank.source.reset()
        indices = rank.step_indices() + (other.step_indices() if step >= 3 else [])
        assert sorted(indices) == sorted(sampler.global_batch())
        used += indices
        for s in (rank.sampler, sampler) + ((other.sampler,) if step >= 3 else ()):
            s.advance()
    assert rank.source.loader._iterator._workers == workers  # type: ignore[union-attr]
    assert Counter(used[: 5 * 6 - 1]) == Counter(range(n))  # epoch 0: every sample once
    rank.source.close()
    other.source.close()


def test_an_iterable_dataset_is_refused_with_the_alternative() -> None:
    class Stream(IterableDataset[int]):
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(range(3))

    with pytest.raises(ConfigError, match="not map-style.*Pass a map-style dataset"):
        check_dataset(Stream())


def test_loader_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="num_workers"):
        LoaderOptions(num_workers=-1)
    with pytest.raises(ConfigError, match="prefetch_factor"):
        LoaderOptions(prefetch_factor=4)


class _Pair(NamedTuple):
    x: torch.Tensor
    label: str


def test_batches_reach_the_model_device_through_nested_containers() -> None:
    batch = {"pair": _Pair(torch.ones(2), "a"), "rest": [torch.zeros(1), (torch.ones(3), 7)]}
    moved = to_device(batch, torch.device("meta"))  # any non-CPU device takes the same path
    assert isinstance(moved["pair"], _Pair) and moved["pair"].label == "a"
    assert moved["pair"].x.device.type == "meta"
    assert [t.device.type for t in (moved["rest"][0], moved["rest"][1][0])] == ["meta", "meta"]
    assert moved["rest"][1][1] == 7 and isinstance(moved["rest"][1], tuple)


def test_cpu_batches_for_a_cpu_model_are_passed_as_they_are() -> None:
    batch = (torch.ones(2), torch.zeros(2))
    assert to_device(batch, torch.device("cpu")) is batch
