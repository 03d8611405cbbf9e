"""Split a state dict into tensors (for DCP) and plain values (for the JSON manifest).

DCP would store non-tensor leaves (``lr``, ``betas``, a step counter) as pickles and
load them back with ``torch.load(weights_only=False)``, which runs code from storage.
So we never hand it one: tensors (including DTensors) go to DCP under their dotted
key, as ``model.state_dict()`` names them; every other leaf is encoded as tagged JSON
and kept in the manifest. Only JSON-able values (None, bool, int, float, str, lists,
tuples, dicts of those, dtypes) are accepted; anything else is a :class:`ConfigError`
at save time, not a surprise at load time.

An object with ``state_dict()`` and ``load_state_dict()`` (a module, an optimizer) is
flattened through its ``state_dict()``; after a load its ``load_state_dict()`` is called
with the filled dict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from elastic_rt.errors import CheckpointMismatchError, ConfigError

Setter = Callable[[Any], None]


@dataclass
class FlatState:
    """One state dict, flattened. ``tensors`` are the caller's own objects (no copy)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)
    setters: dict[str, Setter] = field(default_factory=dict)
    statefuls: list[tuple[Any, dict[str, Any]]] = field(default_factory=list)

    def check_objects(self, encoded: Mapping[str, Any], source: str) -> None:
        """Raise CheckpointMismatchError if the checkpoint lacks one of our plain values."""
        missing = sorted(set(self.setters) - set(encoded))
        if missing:
            raise CheckpointMismatchError(
                f"checkpoint {source} has no value for {_few(missing)}",
                "Load a checkpoint of this model, or pass a state with the same keys.",
            )

    def finish_load(self, encoded: Mapping[str, Any], source: str) -> None:
        """Put the manifest's plain values back, then call ``load_state_dict``s."""
        self.check_objects(encoded, source)
        for key, setter in self.setters.items():
            setter(decode(encoded[key]))
        for obj, state in self.statefuls:
            obj.load_state_dict(state)


def _few(keys: list[str]) -> str:
    more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
    return ", ".join(repr(k) for k in keys[:3]) + more


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor) or _is_stateful(value):
        return True
    if isinstance(value, Mapping):
        return any(_has_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_tensor(v) for v in value)
    return False


def flatten(state: Mapping[str, Any]) -> FlatState:
    """Flatten ``state`` into dotted keys.

    Raises:
        ConfigError: a key is not str/int, or two paths give the same dotted key.
    """
    flat = FlatState()
    _walk(state, "", flat)
    return flat


def _walk(node: Any, prefix: str, flat: FlatState) -> None:
    if _is_stateful(node) and not isinstance(node, torch.Tensor):
        inner = node.state_dict()
        flat.statefuls.append((node, inner))
        node = inner
    items = node.items() if isinstance(node, Mapping) else enumerate(node)
    for key, value in items:
        if not isinstance(key, (str, int)):
            raise ConfigError(
                f"state key {key!r} under {prefix or 'the top level'!r} is a "
                f"{type(key).__name__}", "Use str or int keys in checkpointed state.",
            )
        fqn = f"{prefix}.{key}" if prefix else str(key)
        if fqn in flat.tensors or fqn in flat.objects:
            raise ConfigError(f"two state entries map to the key {fqn!r}",
                              "Rename one of them.")
        if isinstance(value, torch.Tensor):
            flat.tensors[fqn] = value
        elif _has_tensor(value):
            _walk(value, fqn, flat)
        else:
            flat.objects[fqn] = value
            flat.setters[fqn] = _setter(node, key, fqn)


def _setter(parent: Any, key: Any, fqn: str) -> Setter:
    def put(value: Any) -> None:
        if isinstance(parent, tuple):
            if parent[key] != value:
                raise CheckpointMismatchError(
                    f"state value {fqn!r} sits in a tuple and differs from the checkpoint",
                    "Keep changing plain values in dicts or lists, not tuples.",
                )
            return
        parent[key] = value

    return put


def encode(value: Any, key: str) -> Any:
    """Tagged JSON for a plain value: containers and dtypes keep their type.

    Raises:
        ConfigError: the value cannot be stored without pickle.
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return {"t": "dtype", "v": str(value).removeprefix("torch.")}
    if isinstance(value, (list, tuple)):
        kind = "list" if isinstance(value, list) else "tuple"
        return {"t": kind, "v": [encode(v, key) for v in value]}
    if isinstance(value, Mapping):
        return {"t": "dict", "v": [[encode(k, key), encode(v, key)] for k, v in value.items()]}
    raise ConfigError(
        f"state value {key!r} is a {type(value).__name__}, which cannot be stored "
        "without pickle",
        "Convert it to a tensor or to JSON-able values, or pass it in extra=.",
    )


def decode(value: Any) -> Any:
    """Inverse of :func:`encode`.

    Raises:
        ValueError: ``value`` is not something :func:`encode` writes.
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if not isinstance(value, dict) or set(value) != {"t", "v"}:
        raise ValueError(f"{str(value)[:60]} is not a tagged value")
    kind, inner = value["t"], value["v"]
    if kind in ("list", "tuple") and isinstance(inner, list):
        items = [decode(v) for v in inner]
        return items if kind == "list" else tuple(items)
    if kind == "dict" and isinstance(inner, list):
        return dict(_pair(p) for p in inner)
    dtype = getattr(torch, inner, None) if kind == "dtype" and isinstance(inner, str) else None
    if isinstance(dtype, torch.dtype):
        return dtype
    raise ValueError(f"unknown tagged value {str(value)[:60]}")


def _pair(pair: Any) -> tuple[Any, Any]:
    if not (isinstance(pair, list) and len(pair) == 2):
        raise ValueError(f"dict entry {str(pair)[:60]} is not a [key, value] pair")
    key = decode(pair[0])
    try:
        hash(key)
    except TypeError:
        raise ValueError(f"dict key {str(key)[:60]} is not hashable") from None
    return key, decode(pair[1])


def check_encoded(value: Any, key: str) -> None:
    """Raise ValueError naming ``key`` unless ``value`` decodes (see :func:`decode`)."""
    try:
        decode(value)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"objects entry {key!r}: {exc}") from None


def encode_objects(objects: Mapping[str, Any]) -> dict[str, Any]:
    """Encode every plain leaf; see :func:`encode`."""
    return {key: encode(value, key) for key, value in objects.items()}
