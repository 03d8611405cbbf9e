"""The example's model at the sizes the recovery bench builds: layers, not one wide layer."""

from __future__ import annotations

import torch

from scripts.examples.elastic_train import make_model


def test_depth_one_is_the_two_layer_model_the_tests_compare_against() -> None:
    model = make_model(4, 8)
    assert [k for k in model.state_dict()] == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_each_extra_depth_adds_one_hidden_layer_of_the_same_width() -> None:
    model = make_model(4, 8, depth=3)
    shapes = [tuple(m.weight.shape) for m in model.modules()
              if isinstance(m, torch.nn.Linear)]
    assert shapes == [(8, 4), (8, 8), (8, 8), (1, 8)]
    assert make_model(4, 8, depth=3)(torch.ones(2, 4)).shape == (2, 1)
