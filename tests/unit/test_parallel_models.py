"""The parallel model's single-process pieces: stage split, seeded weights, reference loop."""

from __future__ import annotations

import copy

import torch

from elastic_rt.layout import Layout
from elastic_rt.harness import parallel_models as pm


def test_stages_cover_every_block_once_in_order() -> None:
    for pp in range(1, pm.DEPTH + 1):
        blocks = [i for stage in range(pp) for i in pm.stage_blocks(pm.DEPTH, pp, stage)]
        assert blocks == list(range(pm.DEPTH))
        assert all(len(pm.stage_blocks(pm.DEPTH, pp, s)) >= 1 for s in range(pp))


def test_a_stage_holds_the_full_models_weights_under_the_full_names() -> None:
    full = pm.MLP(seed=3).state_dict()
    stage = pm.MLP(seed=3, blocks=pm.stage_blocks(pm.DEPTH, 2, 1)).state_dict()
    assert set(stage) == {k for k in full if k.startswith(("blocks.2.", "blocks.3."))}
    for name, value in stage.items():
        assert torch.equal(value, full[name])


def test_another_seed_gives_other_weights() -> None:
    first, second = pm.MLP(seed=0), pm.MLP(seed=1)
    key = "blocks.0.up.weight"
    assert not torch.equal(first.state_dict()[key], second.state_dict()[key])


def test_reference_training_is_deterministic_and_learns() -> None:
    runs = []
    for _ in range(2):
        trainer = pm.ReferenceTrainer()
        losses = [trainer.step(pm.make_batch(step % 2)) for step in range(6)]
        runs.append((losses, trainer.model.state_dict()))
    (losses, params), (losses_again, params_again) = runs
    assert losses == losses_again
    assert all(torch.equal(params[name], params_again[name]) for name in params)
    assert losses[-1] < losses[0]


def test_reference_state_round_trips_model_and_momentum() -> None:
    trained = pm.ReferenceTrainer()
    trained.step(pm.make_batch(0))
    fresh = pm.ReferenceTrainer(seed=1)
    # A copy, as a checkpoint would give: loading may keep the very tensors it is handed.
    fresh.load_state_dict(copy.deepcopy(trained.state_dict()))
    x, y = pm.make_batch(1)
    assert trained.step((x, y)) == fresh.step((x, y))
    for (name, a), (_, b) in zip(trained.model.named_parameters(), fresh.model.named_parameters()):
        assert torch.equal(a, b), name


def test_loss_of_the_pieces_sums_to_the_loss_of_the_batch() -> None:
    x, y = pm.make_batch(0)
    out = pm.MLP()(x)
    whole = pm.loss_fn(out, y, len(x))
    parts = pm.loss_fn(out[:5], y[:5], len(x)) + pm.loss_fn(out[5:], y[5:], len(x))
    torch.testing.assert_close(whole, parts)


def test_parse_layout_reads_missing_axes_as_one() -> None:
    assert pm.parse_layout("dp2xpp2") == Layout(dp=2, pp=2)
    assert pm.parse_layout("tp2") == Layout(dp=1, tp=2)
