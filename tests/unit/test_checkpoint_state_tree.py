"""Splitting state into tensors and JSON-safe plain values."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from elastic_rt.checkpoint.state_tree import decode, encode, encode_objects, flatten
from elastic_rt.errors import CheckpointMismatchError, ConfigError


@pytest.mark.parametrize("value", [None, True, 3, 2.5, "s", [1, (2, 3)], (0.9, 0.999),
                                   {"a": [1], 4: "int key"}, torch.bfloat16, [], {}])
def test_plain_values_survive_json_with_their_types(value: object) -> None:
    assert decode(json.loads(json.dumps(encode(value, "k")))) == value


def test_values_that_need_pickle_are_refused_at_save_time() -> None:
    with pytest.raises(ConfigError, match="'k' is a object, which cannot be stored"):
        encode_objects({"k": object()})


def test_flatten_uses_dotted_keys_and_keeps_the_callers_tensors() -> None:
    weight = torch.ones(2)
    flat = flatten({"model": {"w": weight}, "opt": {"groups": [{"lr": 0.1, "p": [0]}]},
                    "buffers": [torch.zeros(1), 7]})
    assert flat.tensors["model.w"] is weight
    assert set(flat.tensors) == {"model.w", "buffers.0"}
    assert flat.objects == {"opt": {"groups": [{"lr": 0.1, "p": [0]}]}, "buffers.1": 7}


def test_finish_load_puts_plain_values_back_and_calls_load_state_dict() -> None:
    model = torch.nn.Linear(2, 2)
    state: dict[str, Any] = {"model": model, "meta": {"epoch": 0, "t": torch.zeros(1)}}
    flat = flatten(state)
    flat.tensors["model.weight"].fill_(3.0)
    flat.finish_load(encode_objects({"meta.epoch": 4}), "src")
    assert state["meta"]["epoch"] == 4
    assert torch.all(model.weight == 3.0)


def test_finish_load_names_a_missing_plain_value() -> None:
    flat = flatten({"epoch": 1, "w": torch.zeros(1)})
    with pytest.raises(CheckpointMismatchError, match="no value for 'epoch'"):
        flat.finish_load({}, "src")


def test_a_key_that_is_not_str_or_int_is_refused() -> None:
    with pytest.raises(ConfigError, match="is a tuple"):
        flatten({("a", "b"): torch.zeros(1)})  # type: ignore[dict-item]
