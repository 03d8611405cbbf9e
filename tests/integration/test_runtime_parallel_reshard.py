"""The runtime-parallel family across layouts, in real gloo processes: a checkpoint saved
from any cut loads into any other, and a lost rank's layout is re-planned from the
survivors and grows back when a new node comes.

Both use the harness of ``test_runtime_parallel`` (``_rounds``) and compare every parameter
and AdamW first moment with one float64 process at 1e-5 (``_check``).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest

from elastic_rt.layout import Layout, ModelLimits, plan_layout
from tests.fixtures.torchdist import run_workers
from tests.integration.test_runtime_parallel import _check, _rounds

pytestmark = pytest.mark.slow

_MATRIX = [
    ({"dp": 1, "pp": 2, "tp": 2}, 2),  # pp2xtp2
    ({"dp": 4, "shard": 4}, 1),  # fsdp4
    ({"dp": 2, "tp": 2, "shard": 2}, 1),  # fsdp2xtp2
    ({"dp": 2, "pp": 2}, 1),  # pp2xdp2
    ({"dp": 1, "pp": 4}, 1),  # pp4
    ({"dp": 2, "pp": 2, "shard": 2}, 1),  # pp2xfsdp2
    ({"dp": 1, "tp": 4}, 1),  # tp4
    ({"dp": 4, "shard": 2}, 1),  # hsdp2x2
    ({"dp": 2, "pp": 2}, 1),  # dp2xpp2
    ({"dp": 1, "pp": 3}, 1),  # pp3: rank 3 leaves
    ({"dp": 1, "pp": 2}, 1),  # pp2: rank 2 leaves
    ({"dp": 2, "tp": 2}, 1),  # tp2xdp2: ranks 2 and 3 come back holding nothing
]


def test_a_checkpoint_of_each_cut_loads_into_the_next_whatever_its_layout(
        tmp_path: Any) -> None:
    """The reshard matrix, one checkpoint per arrow, every round starting from nothing::

        pp2xtp2 -> fsdp4 -> fsdp2xtp2 -> pp2xdp2 -> pp4 -> pp2xfsdp2 -> tp4 -> hsdp2x2
        -> dp2xpp2 -> pp3 -> pp2 -> tp2xdp2

    Tensor-parallel DTensors and FSDP / HSDP pieces (``_StridedShard`` included) are joined
    and re-cut by name into pipeline stages, shards and tensor pieces of other degrees, and
    back; 4 ranks shrink to 3 and 2, and grow back to 4 with two ranks holding nothing."""
    results = run_workers(partial(_rounds, from_checkpoint=True, rejoin=True), 4,
                          args=(_MATRIX, {}, None, f"file://{tmp_path}/ckpt", 0), timeout_s=240)
    _check(results, 13)
    for rank, result in enumerate(results):
        want = ["init"] + ["checkpoint" if rank < Layout.from_dict(spec).world_size
                           else "sat out" for spec, _ in _MATRIX[1:]]
        assert [_kind(source) for source in result["sources"]] == want, rank


def _kind(source: str) -> str:
    """A restore's source without the checkpoint's name (``checkpoint <name>``)."""
    return "checkpoint" if source.startswith("checkpoint ") else source


# The 4-rank layouts, the limits that allow them (the planner's 3-rank layout then), and the
# worker lost: the last, or one in the middle, which renumbers the survivors after it
# (the rendezvous keeps their order) while the newcomer comes back last.
_KILLED = {
    "pp2xdp2": ({"dp": 2, "pp": 2}, ModelLimits(max_pp=2), 1),
    "tp2xdp2": ({"dp": 2, "tp": 2}, ModelLimits(tp_options=(1, 2)), 3),
    "fsdp2xtp2": ({"dp": 2, "tp": 2, "shard": 2},
                  ModelLimits(tp_options=(1, 2), max_shard=4), 1),
    "pp2xfsdp2": ({"dp": 2, "pp": 2, "shard": 2}, ModelLimits(max_pp=2, max_shard=4), 3),
}


@pytest.mark.parametrize("name", list(_KILLED))
def test_a_lost_rank_is_replanned_from_the_survivors_and_a_newcomer_grows_it_back(
        name: str) -> None:
    # A worker is lost after step 2 (between rounds: what the runtime sees after a
    # SIGKILL), the 3 survivors train 2 steps in the planner's 3-rank layout (dp3, or
    # fsdp3 where sharding is allowed), and the worker comes back holding nothing, as rank
    # 3 of the 4-rank layout. No checkpoint. An FSDP piece has one holder, so the sharded
    # layouts take the lost worker's piece from the copy its holder keeps (of step 2, sent
    # as the worker finished it: nothing is done again); the others keep no copies: what
    # the survivors hold is all there is.
    layout, limits, lost = _KILLED[name]
    is_sharded = layout.get("shard", 1) > 1
    three = plan_layout(3, limits)
    assert three == (Layout(dp=3, shard=3) if is_sharded else Layout(dp=3))
    rounds = [(layout, 2), (three.to_dict(), 2), (layout, 2)]
    stayed = [w for w in range(4) if w != lost]
    members = [[0, 1, 2, 3], stayed, stayed + [lost]]
    results = run_workers(partial(_rounds, rejoin=True, members=members), 4,
                          args=(rounds, {}, None, None, 1 if is_sharded else 0),
                          timeout_s=120)
    _check(results, 6)
    again = "peer copies" if is_sharded else "survivors"
    for worker in stayed:
        assert results[worker]["sources"] == ["init", again, "survivors"]
    assert results[lost]["sources"] == ["init", "sat out", "survivors"]
