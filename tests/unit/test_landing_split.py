"""The sampler's split while a join's state lands (``loop.split_of``): who trains the step,
and on what share, must be the same on every rank."""

from __future__ import annotations

from elastic_rt.sampler import ElasticSampler
from elastic_rt.worker.loop import LANDING_WEIGHTS, split_of


def test_a_newcomer_that_trains_while_its_state_lands_gets_a_smaller_share() -> None:
    receiver, holder = LANDING_WEIGHTS
    assert receiver < holder
    weights = (holder, holder, receiver)
    assert [split_of(r, 3, (2,), ()) for r in range(3)] == [(r, 3, weights) for r in range(3)]
    shares = []
    for rank in range(3):
        sampler = ElasticSampler(64, global_batch_size=24, seed=0)
        sampler.set_world(*split_of(rank, 3, (2,), ())[:2])
        sampler.set_weights(split_of(rank, 3, (2,), ())[2])
        shares.append(sampler.local_batch())
    assert sorted(i for share in shares for i in share) == sorted(
        ElasticSampler(64, global_batch_size=24, seed=0).global_batch())
    assert len(shares[2]) < len(shares[0]) == len(shares[1])


def test_a_rank_sitting_out_draws_nothing_and_the_others_split_evenly() -> None:
    assert split_of(0, 3, (1,), (1,)) == (0, 2, None)
    assert split_of(2, 3, (1,), (1,)) == (1, 2, None)
    assert split_of(1, 3, (1,), (1,)) == (1, 3, None)  # its own split, never drawn


def test_with_nothing_landing_or_one_rank_alone_the_split_is_even() -> None:
    assert split_of(1, 3, (), ()) == (1, 3, None)
    assert split_of(0, 1, (0,), ()) == (0, 1, None)
    # two receivers, one sitting out (it kept an older state) and one training
    assert split_of(0, 3, (1, 2), (2,)) == (0, 2, LANDING_WEIGHTS[::-1])
