"""replica_transfer's pure parts and replica_state's order: who moves what, and every byte once."""

from __future__ import annotations

import pytest
import torch

from elastic_rt.errors import ReplicaMismatchError
from elastic_rt.sampler import ElasticSampler
from elastic_rt.worker.train_state import TrainState
from elastic_rt.worker.trainers.meta import TrainMeta
from elastic_rt.worker.trainers.replica_state import Outline, named_tensors, receive_into
from elastic_rt.worker.trainers.replica_transfer import (
    Agreement,
    chunks,
    fingerprint,
    plan,
    planned_bytes,
    senders,
)


@pytest.mark.parametrize(("standings", "expected"), [
    ([(7, 11), (7, 11), (7, 11)], Agreement(step=7, holders=(0, 1, 2), receivers=())),
    ([(7, 11), (7, 11), (-1, 0)], Agreement(step=7, holders=(0, 1), receivers=(2,))),
    ([(7, 11), (-1, 0), (6, 3)], Agreement(step=7, holders=(0,), receivers=(1, 2))),
    ([(6, 5), (7, 11), (7, 11)], Agreement(step=7, holders=(1, 2), receivers=(0,))),
    ([(7, 11), (7, 12), (7, 11)], Agreement(step=7, holders=(0, 2), receivers=(1,))),
    ([(7, 12), (7, 11), (7, 11)], Agreement(step=7, holders=(0,), receivers=(1, 2))),
    ([(-1, 0), (-1, 0)], Agreement(step=-1, holders=(), receivers=())),
])  # fmt: skip
def test_plan_keeps_the_holders_of_the_newest_step_and_sends_to_the_others(
        standings: list[tuple[int, int]], expected: Agreement) -> None:
    assert plan(standings) == expected
    assert plan(standings).is_settled == (not expected.receivers)


@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 1000])
def test_chunks_cover_every_byte_of_uneven_tensors_exactly_once(chunk_bytes: int) -> None:
    sizes = [0, 5, 64, 129, 1, 300]
    seen = [[0] * size for size in sizes]
    for index, start, end in chunks(sizes, chunk_bytes):
        assert 0 < end - start <= chunk_bytes
        for byte in range(start, end):
            seen[index][byte] += 1
    assert all(count == 1 for row in seen for count in row)


def test_planned_bytes_are_what_each_rank_sends_and_receives() -> None:
    sizes, chunk = [0, 5, 64, 129, 1, 300], 64
    agreement = Agreement(step=3, holders=(0, 2), receivers=(1, 3))
    sent = {0: 0, 2: 0}
    pieces = chunks(sizes, chunk)
    for (_, start, end), sender in zip(pieces, senders(pieces, agreement.holders)):
        sent[sender] += (end - start) * 2  # once per receiver
    got = {r: planned_bytes(sizes, agreement, r, chunk_bytes=chunk) for r in range(5)}
    assert got == {0: sent[0], 1: sum(sizes), 2: sent[2], 3: sum(sizes), 4: 0}
    assert sent[0] + sent[2] == 2 * sum(sizes)
    settled = Agreement(step=3, holders=(0, 1), receivers=())
    assert planned_bytes(sizes, settled, 0, chunk_bytes=chunk) == 0


def test_senders_share_the_bytes_when_big_and_small_tensors_alternate() -> None:
    sizes = [1000, 4] * 6  # weights and biases: by count, every weight would go to holder 0
    pieces = chunks(sizes, 1000)
    load = {0: 0, 1: 0, 2: 0}
    for (_, start, end), sender in zip(pieces, senders(pieces, (0, 1, 2))):
        load[sender] += end - start
    assert max(load.values()) - min(load.values()) <= 1000  # within one chunk


def test_fingerprint_is_equal_for_equal_states_and_tells_a_changed_element() -> None:
    a = [torch.arange(12.0).view(3, 4), torch.ones(5, dtype=torch.int64), torch.tensor(3.0)]
    b = [t.clone() for t in a]
    assert fingerprint(a) == fingerprint(b)
    b[0][2, 1] += 1e-6
    assert fingerprint(a) != fingerprint(b)
    assert fingerprint([a[0].t()]) != fingerprint([a[0]])  # another shape
    assert 0 <= fingerprint(a) < 2 ** 63


def test_fingerprint_reads_a_sample_of_a_large_tensor_whole_or_not() -> None:
    big = torch.randn(1 << 20)
    assert fingerprint([big]) == fingerprint([big.clone()])
    assert fingerprint([big[::2]]) == fingerprint([big[::2].contiguous()])


def _state(seed: int) -> TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    return TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01),
                      extras={"seen": seed})


def _trained() -> TrainState:
    state = _state(0)
    for _ in range(3):
        state.model(torch.randn(8, 4)).sum().backward()
        state.optimizer.step()
    return state


def test_a_fresh_state_filled_in_outline_order_equals_the_trained_one() -> None:
    trained, fresh = _trained(), _state(1)
    meta = TrainMeta.capture(step=3, sampler=ElasticSampler(16, global_batch_size=4, seed=0),
                             state=trained)
    outline = Outline.of(trained, meta)
    received = receive_into(fresh, outline)  # allocates fresh's AdamW state first
    for target, (_, source) in zip(received, named_tensors(trained), strict=True):
        target.detach().copy_(source)  # what transfer() does, byte for byte
    assert [n for n, _ in named_tensors(fresh)] == [n for n, _ in named_tensors(trained)]
    for (name, got), (_, want) in zip(named_tensors(fresh), named_tensors(trained)):
        assert torch.equal(got, want), name
    assert fresh.optimizer.state_dict()["param_groups"] == \
        trained.optimizer.state_dict()["param_groups"]
    assert TrainMeta.decode(outline.meta) == meta
    first = next(fresh.model.parameters())
    assert fresh.optimizer.state[first]["step"].device.type == "cpu"
    behind = receive_into(fresh, outline)  # a rank that fell behind keeps its tensors
    assert [t.data_ptr() for t in behind] == [t.data_ptr() for t in received]


def test_a_receiver_built_otherwise_is_told_which_tensor_differs() -> None:
    trained = _trained()
    outline = Outline.of(trained, TrainMeta(step=3, sampler={}))
    model = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.BatchNorm1d(3))
    other = TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters()))
    with pytest.raises(ReplicaMismatchError, match=r"model\.0\.weight is \(3, 4\)"):
        receive_into(other, outline)
