"""Unit and property tests for elastic_rt.sampler.ElasticSampler."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset

from elastic_rt.errors import ConfigError
from elastic_rt.sampler import ElasticSampler, share_bounds


def _world(state: dict[str, int], dp_size: int, **kwargs: Any) -> list[ElasticSampler]:
    """A freshly re-formed world: every rank builds a sampler and loads the shared state."""
    ranks = []
    for dp_rank in range(dp_size):
        sampler = ElasticSampler(
            state["dataset_len"], global_batch_size=state["global_batch_size"], **kwargs
        )
        sampler.load_state_dict(json.loads(json.dumps(state)))
        sampler.set_world(dp_rank, dp_size)
        ranks.append(sampler)
    return ranks


def test_first_permutation_is_pinned_across_processes_and_platforms() -> None:
    # Every rank must compute the same permutation; a change here breaks resuming old runs.
    sampler = ElasticSampler(10, global_batch_size=10, seed=0)
    assert sampler.global_batch() == [3, 8, 7, 5, 0, 1, 2, 4, 6, 9]


def test_epochs_and_seeds_get_different_permutations() -> None:
    a = ElasticSampler(100, global_batch_size=100, seed=1)
    first = a.global_batch()
    a.advance()
    assert a.epoch == 1 and a.position == 0 and a.step == 1
    assert a.global_batch() != first and sorted(a.global_batch()) == list(range(100))
    assert ElasticSampler(100, global_batch_size=100, seed=2).global_batch() != first


def test_no_shuffle_goes_in_index_order() -> None:
    sampler = ElasticSampler(5, global_batch_size=2, shuffle=False)
    assert list(sampler) == [[0, 1], [2, 3], [4]]


def test_shares_are_contiguous_and_differ_by_at_most_one() -> None:
    assert [share_bounds(10, r, 4) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert [share_bounds(2, r, 4) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]


def test_last_batch_is_smaller_unless_drop_last() -> None:
    keep = ElasticSampler(10, global_batch_size=4, seed=3)
    drop = ElasticSampler(10, global_batch_size=4, seed=3, drop_last=True)
    assert [len(b) for b in keep] == [4, 4, 2] and len(keep) == 3
    assert [len(b) for b in drop] == [4, 4] and len(drop) == 2
    for _ in range(2):
        drop.advance()
    assert drop.epoch == 1 and drop.position == 0


def test_iterating_does_not_advance_and_keeps_the_split_it_was_made_with() -> None:
    sampler = ElasticSampler(12, global_batch_size=6, seed=0)
    sampler.set_world(0, 2)
    batches = iter(sampler)
    sampler.set_world(1, 3)  # a later world change does not leak into the old iterator
    first = next(batches)
    assert first == ElasticSampler(12, global_batch_size=6, seed=0).global_batch()[:3]
    assert sampler.position == 0 and sampler.step == 0
    assert len(sampler) == 2


def test_micro_batches_cut_the_local_batch_for_gradient_accumulation() -> None:
    sampler = ElasticSampler(20, global_batch_size=10, micro_batch_size=2, shuffle=False)
    sampler.set_world(0, 3)
    assert sampler.local_batch() == [0, 1, 2, 3]
    assert sampler.micro_batches() == [[0, 1], [2, 3]]
    sampler.set_world(1, 2)
    assert sampler.micro_batches() == [[5, 6], [7, 8], [9]]
    assert sum(sampler.loss_scale(m) for m in sampler.micro_batches()) == sampler.loss_scale()


def test_a_rank_without_samples_still_gets_one_empty_micro_batch_and_zero_scale() -> None:
    sampler = ElasticSampler(3, global_batch_size=2, micro_batch_size=1, shuffle=False)
    sampler.set_world(2, 3)
    assert sampler.local_batch() == []
    assert sampler.micro_batches() == [[]]
    assert sampler.loss_scale() == 0.0


def test_loss_scale_makes_the_mean_of_rank_means_the_global_mean() -> None:
    sampler = ElasticSampler(7, global_batch_size=7, shuffle=False)
    losses = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 100.0]
    total = 0.0
    for dp_rank in range(3):  # shares 3, 2, 2
        sampler.set_world(dp_rank, 3)
        local = [losses[i] for i in sampler.local_batch()]
        total += sum(local) / len(local) * sampler.loss_scale()
    assert math.isclose(total / 3, sum(losses) / 7)


def test_state_dict_is_json_and_resumes_the_same_batches() -> None:
    a = ElasticSampler(50, global_batch_size=8, seed=7)
    for _ in range(3):
        a.advance()
    state = json.loads(json.dumps(a.state_dict()))
    assert state == {
        "seed": 7, "epoch": 0, "position": 24, "step": 3, "global_batch_size": 8,
        "dataset_len": 50,
    }
    b = ElasticSampler(50, global_batch_size=8, seed=99)
    b.load_state_dict(state)
    assert list(b) == list(a) and b.step == 3


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"dataset_len": 51}, "dataset_len 51"),
        ({"global_batch_size": 4}, "global_batch_size 4"),
        ({"position": 50}, "out of range"),
        ({"epoch": -1}, "out of range"),
        ({"position": -8}, "out of range"),
    ],
)
def test_load_state_dict_rejects_a_state_that_does_not_fit(
    change: dict[str, int], match: str
) -> None:
    sampler = ElasticSampler(50, global_batch_size=8)
    state = {**sampler.state_dict(), "position": 8, **change}
    with pytest.raises(ConfigError, match=match) as info:
        sampler.load_state_dict(state)
    assert info.value.fix
    assert sampler.position == 0  # unchanged after a refused load


def test_load_state_dict_names_missing_keys() -> None:
    state = ElasticSampler(5, global_batch_size=2).state_dict()
    del state["position"]
    with pytest.raises(ConfigError, match="lacks position"):
        ElasticSampler(5, global_batch_size=2).load_state_dict(state)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"dataset_len": 0, "global_batch_size": 1},
        {"dataset_len": 4, "global_batch_size": 0},
        {"dataset_len": 4, "global_batch_size": 2, "micro_batch_size": 0},
        {"dataset_len": 4, "global_batch_size": 5, "drop_last": True},
    ],
)
def test_bad_sizes_are_config_errors(kwargs: dict[str, int]) -> None:
    with pytest.raises(ConfigError):
        ElasticSampler(**kwargs)  # type: ignore[arg-type]


def test_set_world_rejects_a_rank_outside_the_world() -> None:
    with pytest.raises(ValueError):
        ElasticSampler(4, global_batch_size=2).set_world(2, 2)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_sample_is_used_exactly_once_per_epoch_whatever_the_world_does(
    data: st.DataObject,
) -> None:
    n = data.draw(st.integers(1, 60), label="dataset_len")
    b = data.draw(st.integers(1, 16), label="global_batch_size")
    drop_last = data.draw(st.booleans(), label="drop_last")
    assume(not (drop_last and b > n))
    kwargs = {
        "seed": data.draw(st.integers(0, 2**32), label="seed"),
        "shuffle": data.draw(st.booleans(), label="shuffle"),
        "drop_last": drop_last,
        "micro_batch_size": data.draw(st.none() | st.integers(1, 5), label="micro_batch_size"),
    }
    reference = ElasticSampler(n, global_batch_size=b, **kwargs)  # type: ignore[arg-type]
    ranks = _world(reference.state_dict(), data.draw(st.integers(1, 20)), **kwargs)
    used: list[int] = []
    while ranks[0].epoch == 0:
        if data.draw(st.integers(0, 3), label="re-form?") == 0:
            ranks = _reform(ranks, data.draw(st.integers(1, 20), label="new dp_size"), kwargs)
        global_batch = reference.global_batch()
        locals_ = [r.local_batch() for r in ranks]
        assert all(r.global_batch() == global_batch for r in ranks)
        assert sum(locals_, []) == global_batch
        assert max(map(len, locals_)) - min(map(len, locals_)) <= 1
        for r, local in zip(ranks, locals_):
            micro = r.micro_batches()
            assert sum(micro, []) == local and micro
            assert all(len(m) <= (kwargs["micro_batch_size"] or len(local)) for m in micro)
        _check_loss_scale(ranks, global_batch)
        used += global_batch
        for r in ranks + [reference]:
            r.advance()
    full = n - n % b if drop_last else n
    assert len(used) == full and len(set(used)) == full and set(used) <= set(range(n))
    assert all(r.step == reference.step and r.position == 0 for r in ranks)


def _reform(
    ranks: list[ElasticSampler], dp_size: int, kwargs: dict[str, Any]
) -> list[ElasticSampler]:
    """Survivors keep their sampler objects; joiners load the state through JSON."""
    state = json.loads(json.dumps(ranks[0].state_dict()))
    survivors = ranks[:dp_size]
    for dp_rank, sampler in enumerate(survivors):
        sampler.set_world(dp_rank, dp_size)
    joiners = _world(state, dp_size, **kwargs)[len(survivors):]
    return survivors + joiners


def _check_loss_scale(ranks: list[ElasticSampler], global_batch: list[int]) -> None:
    loss = {i: float((i * 7919) % 13) for i in global_batch}
    ddp_mean = 0.0
    for r in ranks:
        for micro in r.micro_batches():
            if micro:
                ddp_mean += sum(loss[i] for i in micro) / len(micro) * r.loss_scale(micro)
    ddp_mean /= len(ranks)
    assert math.isclose(ddp_mean, sum(loss.values()) / len(global_batch), abs_tol=1e-9)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 40),
    b=st.integers(1, 12),
    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=12),
)
def test_global_batches_do_not_depend_on_the_world_history(
    n: int, b: int, sizes: list[int]
) -> None:
    plain = ElasticSampler(n, global_batch_size=b, seed=5)
    elastic = ElasticSampler(n, global_batch_size=b, seed=5)
    for step in range(3 * n):  # several epochs
        size = sizes[step % len(sizes)]
        elastic.set_world(step % size, size)
        assert elastic.global_batch() == plain.global_batch()
        assert (elastic.epoch, elastic.position) == (plain.epoch, plain.position)
        plain.advance()
        elastic.advance()


class _IndexDataset(Dataset[int]):
    def __len__(self) -> int:
        return 23

    def __getitem__(self, index: int) -> int:
        return index


def _collate(batch: list[int]) -> torch.Tensor:
    # Accepts an empty share, which the default collate function does not.
    return torch.tensor(batch, dtype=torch.long)


def test_works_as_a_dataloader_batch_sampler_with_worker_processes() -> None:
    state = ElasticSampler(23, global_batch_size=5, seed=11).state_dict()
    used: list[int] = []
    # 2 ranks for two steps, then a re-form to 6 ranks (more than a 5-sample batch) to the end.
    for dp_size, steps in ((2, 2), (6, None)):
        ranks = _world(state, dp_size, seed=11)
        loaders = [
            iter(DataLoader(_IndexDataset(), batch_sampler=r, num_workers=2, collate_fn=_collate))
            for r in ranks
        ]
        for _ in range(steps or len(ranks[0])):
            batches = [next(loader) for loader in loaders]
            assert torch.cat(batches).tolist() == ranks[0].global_batch()
            used += ranks[0].global_batch()
            for r in ranks:
                r.advance()
        del loaders  # shuts the worker processes down
        state = ranks[0].state_dict()
    assert sorted(used) == list(range(23))
    assert state["epoch"] == 1 and state["step"] == 5


@given(n=st.integers(0, 300), weights=st.lists(st.integers(1, 50), min_size=1, max_size=8))
def test_weighted_shares_cover_the_batch_once_in_proportion(n: int, weights: list[int]) -> None:
    bounds = [share_bounds(n, r, len(weights), tuple(weights)) for r in range(len(weights))]
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous, no overlap
    total = sum(weights)
    for (start, end), weight in zip(bounds, weights):
        assert abs((end - start) - n * weight / total) < 1 + 1e-9


def test_a_straggler_gets_a_smaller_share_until_the_world_changes() -> None:
    sampler = ElasticSampler(100, global_batch_size=12, shuffle=False)
    sampler.set_world(2, 3)
    sampler.set_weights((3, 3, 1))  # rank 2 is a third as fast
    assert sampler.local_batch() == [10, 11] and sampler.weights == (3, 3, 1)
    with pytest.raises(ValueError):
        sampler.set_weights((1, 1))
    sampler.set_world(1, 2)
    assert sampler.weights is None and sampler.local_batch() == list(range(6, 12))


def test_advanced_is_the_state_after_the_step_in_progress_and_leaves_the_sampler_alone() -> None:
    # a record of a step taken inside it (a peer copy) needs the position after it
    sampler = ElasticSampler(10, global_batch_size=4, seed=3)
    sampler.advance()
    before = sampler.state_dict()
    after = sampler.advanced()
    assert sampler.state_dict() == before
    sampler.advance()
    assert after.state_dict() == sampler.state_dict()
    assert after.advanced().state_dict()["epoch"] == 1  # 10 samples: the third batch rolls it
