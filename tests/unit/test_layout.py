"""Unit tests for elastic_rt.layout: plans, rank <-> coordinates, groups, replicas."""

from __future__ import annotations

import ast
import json

import pytest

from elastic_rt.errors import ConfigError
from elastic_rt.layout import (
    Coords,
    Layout,
    ModelLimits,
    has_replica_for_every_shard,
    plan_layout,
)

LIMITS = [
    ModelLimits(),
    ModelLimits(max_pp=4),
    ModelLimits(tp_options=(1, 2, 4)),
    ModelLimits(max_pp=2, tp_options=(2, 4)),
    ModelLimits(max_pp=4, tp_options=(1, 2), min_dp=2),
    ModelLimits(max_pp=4, tp_options=(1, 2), max_params_per_rank=300, n_params=1000),
]


@pytest.mark.parametrize("world_size", range(1, 17))
def test_default_limits_plan_pure_data_parallelism(world_size: int) -> None:
    assert plan_layout(world_size) == Layout(dp=world_size)


@pytest.mark.parametrize("limits", LIMITS, ids=str)
@pytest.mark.parametrize("world_size", range(1, 17))
def test_plan_fills_the_world_exactly_and_is_the_best_candidate(
    world_size: int, limits: ModelLimits
) -> None:
    try:
        layout = plan_layout(world_size, limits)
    except ConfigError:
        assert not _candidates(world_size, limits)
        return
    assert layout.world_size == world_size
    assert layout.pp <= limits.max_pp and layout.tp in limits.tp_options
    assert layout.dp >= limits.min_dp
    best = min(_candidates(world_size, limits), key=lambda c: (-c[0], c[1], c[2]))
    assert (layout.dp, layout.pp, layout.tp) == best


def _candidates(world_size: int, limits: ModelLimits) -> list[tuple[int, int, int]]:
    """Brute force over every (dp, pp, tp), independent of the planner's loop."""
    found = []
    for dp in range(1, world_size + 1):
        for pp in range(1, world_size + 1):
            for tp in range(1, world_size + 1):
                if dp * pp * tp != world_size or pp > limits.max_pp:
                    continue
                if tp not in limits.tp_options or dp < limits.min_dp:
                    continue
                if limits.n_params and limits.max_params_per_rank:
                    if limits.n_params / (pp * tp) > limits.max_params_per_rank:
                        continue
                found.append((dp, pp, tp))
    return found


def test_memory_limit_forces_model_parallelism() -> None:
    limits = ModelLimits(max_pp=4, tp_options=(1, 2), max_params_per_rank=300, n_params=1000)
    # 1000 params need >= 4 shards of <= 300: pp=2 x tp=2 beats pp=4 x tp=1 (smaller pp).
    assert plan_layout(8, limits) == Layout(dp=2, pp=2, tp=2)


def test_equal_dp_prefers_smaller_pp_over_smaller_tp() -> None:
    assert plan_layout(4, ModelLimits(max_pp=2, tp_options=(2,))) == Layout(dp=2, pp=1, tp=2)


def test_plan_is_deterministic_whatever_the_tp_option_order() -> None:
    a = plan_layout(12, ModelLimits(max_pp=3, tp_options=(4, 2), min_dp=2))
    b = plan_layout(12, ModelLimits(max_pp=3, tp_options=(2, 4), min_dp=2))
    assert a == b == Layout(dp=6, pp=1, tp=2)


def test_config_error_names_the_world_and_the_fix_when_nothing_fits() -> None:
    with pytest.raises(ConfigError) as info:
        plan_layout(7, ModelLimits(tp_options=(2,)))
    assert "7 ranks" in info.value.problem
    assert "relax the model limits" in info.value.fix
    assert str(info.value) == info.value.one_line()


def test_memory_that_no_split_fits_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="no layout"):
        plan_layout(4, ModelLimits(max_pp=2, max_params_per_rank=10, n_params=1000))


@pytest.mark.parametrize("world_size", [0, -3])
def test_non_positive_world_size_is_a_config_error(world_size: int) -> None:
    with pytest.raises(ConfigError, match="world_size"):
        plan_layout(world_size)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_pp": 0},
        {"min_dp": 0},
        {"tp_options": ()},
        {"tp_options": (1, 0)},
        {"max_params_per_rank": 10},
        {"n_params": 10},
        {"max_params_per_rank": 0, "n_params": 10},
    ],
)
def test_bad_model_limits_are_config_errors(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        ModelLimits(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [{"dp": 0}, {"dp": 2, "pp": 0}, {"dp": 2, "tp": -1}, {"dp": 1.5}])
def test_bad_layout_degrees_are_config_errors(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        Layout(**bad)  # type: ignore[arg-type]


LAYOUTS = [Layout(1), Layout(4), Layout(2, 2, 1), Layout(2, 1, 2), Layout(3, 2, 2), Layout(1, 4, 2)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_rank_and_coords_round_trip_in_pp_dp_tp_order(layout: Layout) -> None:
    seen = []
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        assert layout.rank_of(*c) == rank
        assert rank == (c.pp * layout.dp + c.dp) * layout.tp + c.tp
        seen.append(tuple(c))
    # Walking ranks in order walks the mesh in ("pp", "dp", "tp") order, tp innermost.
    assert seen == sorted(seen)


def test_coords_of_a_known_rank() -> None:
    assert Layout(dp=3, pp=2, tp=2).coords(9) == Coords(pp=1, dp=1, tp=1)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("axis", ["pp", "dp", "tp"])
def test_groups_share_all_other_coordinates_and_partition_the_world(
    layout: Layout, axis: str
) -> None:
    groups = layout.all_groups(axis)
    assert sorted(r for g in groups for r in g) == list(range(layout.world_size))
    for group in groups:
        assert len(group) == getattr(layout, axis)
        coords = [layout.coords(r)._asdict() for r in group]
        assert [c[axis] for c in coords] == list(range(len(group)))
        others = {tuple(v for k, v in c.items() if k != axis) for c in coords}
        assert len(others) == 1
        for rank in group:
            assert layout.group_ranks(axis, rank) == group


def test_known_groups_of_a_hybrid_layout() -> None:
    layout = Layout(dp=2, pp=2, tp=2)
    assert layout.all_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.all_groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.all_groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_out_of_range_ranks_coords_and_axes_are_value_errors() -> None:
    layout = Layout(dp=2, pp=2)
    with pytest.raises(ValueError):
        layout.coords(4)
    with pytest.raises(ValueError):
        layout.coords(-1)
    with pytest.raises(ValueError):
        layout.rank_of(0, 2, 0)
    with pytest.raises(ValueError, match="unknown axis"):
        layout.group_ranks("ep", 0)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_dict_form_round_trips_through_json(layout: Layout) -> None:
    assert Layout.from_dict(json.loads(json.dumps(layout.to_dict()))) == layout


def test_from_dict_defaults_and_rejects_unknown_keys() -> None:
    assert Layout.from_dict({"dp": 4}) == Layout(4, 1, 1)
    with pytest.raises(ValueError):
        Layout.from_dict({"dp": 2, "ep": 2})
    with pytest.raises(ValueError):
        Layout.from_dict({"pp": 2})


def test_str_names_every_axis() -> None:
    assert str(Layout(dp=2, pp=2)) == "dp2xpp2xtp1"
    assert Layout(dp=3, pp=2, tp=4).world_size == 24


def test_replica_survives_when_one_dp_copy_of_every_shard_is_left() -> None:
    layout = Layout(dp=2, pp=2, tp=2)  # dp groups: [0,2] [1,3] [4,6] [5,7]
    assert has_replica_for_every_shard(layout, set())
    assert has_replica_for_every_shard(layout, {0, 3, 4, 7})
    assert not has_replica_for_every_shard(layout, {0, 2})
    assert not has_replica_for_every_shard(layout, {5, 7, 1})


def test_no_replica_without_data_parallelism() -> None:
    assert not has_replica_for_every_shard(Layout(dp=1, pp=2), {1})
    assert has_replica_for_every_shard(Layout(dp=1, pp=2), {99})


def test_layout_module_does_not_import_torch() -> None:
    import elastic_rt.layout as layout_module

    tree = ast.parse(open(layout_module.__file__, encoding="utf-8").read())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert imported and not [name for name in imported if name.startswith("torch")]


# the shard axis (FSDP / HSDP) -------------------------------------------------------


@pytest.mark.parametrize("world_size,expected", [
    (1, Layout(dp=1)), (2, Layout(dp=2, shard=2)), (3, Layout(dp=3)), (4, Layout(dp=4, shard=2)),
    (6, Layout(dp=6, shard=2)),
])
def test_max_shard_of_a_node_plans_hsdp_where_it_divides_the_world(
    world_size: int, expected: Layout
) -> None:
    assert plan_layout(world_size, ModelLimits(max_shard=2)) == expected


@pytest.mark.parametrize("world_size", range(1, 9))
def test_a_large_max_shard_plans_fsdp_over_every_rank(world_size: int) -> None:
    layout = plan_layout(world_size, ModelLimits(max_shard=64))
    assert (layout.dp, layout.shard, layout.replicas) == (world_size, world_size, 1)


def test_memory_limit_counts_the_shards() -> None:
    limits = ModelLimits(max_shard=4, max_params_per_rank=300, n_params=1000)
    assert plan_layout(4, limits) == Layout(dp=4, shard=4)
    with pytest.raises(ConfigError, match="max_shard"):
        plan_layout(3, ModelLimits(max_shard=2, max_params_per_rank=300, n_params=1000))


def test_shard_does_not_divide_dp_is_refused() -> None:
    with pytest.raises(ConfigError, match="does not divide"):
        Layout(dp=4, shard=3)
    with pytest.raises(ConfigError, match="does not divide"):
        Layout(dp=2, pp=2, tp=2, shard=4)


SHARD_LIMITS = [
    ModelLimits(max_pp=2, tp_options=(1, 2), max_shard=4),
    ModelLimits(max_pp=4, tp_options=(1, 2), max_shard=2, max_params_per_rank=150, n_params=1000),
    ModelLimits(max_pp=2, tp_options=(2,), max_shard=8, max_params_per_rank=100, n_params=1000),
    ModelLimits(max_pp=3, tp_options=(1, 2, 4), min_dp=2, max_shard=3),
]


@pytest.mark.parametrize("limits", SHARD_LIMITS, ids=str)
@pytest.mark.parametrize("world_size", range(1, 17))
def test_plan_with_max_shard_is_the_best_of_every_dp_pp_tp_shard(
    world_size: int, limits: ModelLimits
) -> None:
    found = [(dp, pp, tp, shard) for dp, pp, tp in _candidates(world_size, ModelLimits(
                 max_pp=limits.max_pp, tp_options=limits.tp_options, min_dp=limits.min_dp))
             for shard in range(1, min(dp, limits.max_shard) + 1) if dp % shard == 0
             and limits.fits_memory(pp, tp, shard)]
    try:
        layout = plan_layout(world_size, limits)
    except ConfigError:
        assert not found
        return
    best = min(found, key=lambda c: (-c[0], c[1], c[2], -c[3]))
    assert (layout.dp, layout.pp, layout.tp, layout.shard) == best


def test_memory_limit_shards_the_parts_of_model_parallel_layouts() -> None:
    # 1000 params, 150 per rank: pp2 x tp2 alone holds 250; sharding each part 2 ways fits.
    limits = ModelLimits(max_pp=2, tp_options=(1, 2), max_shard=2, max_params_per_rank=150,
                         n_params=1000)
    layout = plan_layout(8, limits)
    assert layout == Layout(dp=2, pp=2, tp=2, shard=2) and str(layout) == "pp2xfsdp2xtp2"
    # ties on dp, pp and tp go to the largest shard: least memory per rank
    assert plan_layout(8, ModelLimits(max_pp=2, tp_options=(2,), max_shard=4,
                                      min_dp=4)) == Layout(dp=4, tp=2, shard=4)


def test_sharded_model_parallel_layouts_name_every_axis() -> None:
    assert str(Layout(dp=2, tp=2, shard=2)) == "fsdp2xtp2"
    assert str(Layout(dp=2, pp=2, shard=2)) == "pp2xfsdp2"
    assert str(Layout(dp=4, pp=2, tp=2, shard=2)) == "pp2xhsdp2x2xtp2"
    assert str(Layout(dp=4, pp=1, tp=1, shard=4)) == "fsdp4"


def test_sharded_parts_have_their_own_copies_and_replicas() -> None:
    layout = Layout(dp=4, pp=2, tp=2, shard=2)  # rank = (pp * 4 + dp) * 2 + tp
    assert layout.copies(1, 1) == [[9, 11], [13, 15]]
    assert layout.copies(0, 0) == [[0, 2], [4, 6]]
    assert layout.shard_groups()[:4] == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert layout.replicate_groups()[:2] == [[0, 4], [2, 6]]
    assert sorted(r for g in layout.shard_groups() for r in g) == list(range(16))
    assert sorted(r for g in layout.replicate_groups() for r in g) == list(range(16))
    assert [layout.shard_index(r) for r in (0, 1, 2, 3, 4)] == [0, 0, 1, 1, 0]
    assert Layout.from_dict(json.loads(json.dumps(layout.to_dict()))) == layout
    # a piece survives while one replica of it, in its own (pp, tp) part, is left
    assert has_replica_for_every_shard(layout, {0, 2, 9, 11})
    assert not has_replica_for_every_shard(layout, {0, 4})
    assert not has_replica_for_every_shard(Layout(dp=2, tp=2, shard=2), {3})


def test_hsdp_groups_shard_within_and_replicate_across() -> None:
    layout = Layout(dp=6, shard=3)
    assert str(layout) == "hsdp2x3" and str(Layout(dp=4, shard=4)) == "fsdp4"
    assert layout.shard_groups() == [[0, 1, 2], [3, 4, 5]]
    assert layout.replicate_groups() == [[0, 3], [1, 4], [2, 5]]
    assert [layout.shard_index(r) for r in range(6)] == [0, 1, 2, 0, 1, 2]
    assert Layout.from_dict(json.loads(json.dumps(layout.to_dict()))) == layout
    assert "shard" not in Layout(dp=2).to_dict()  # manifests of replicated layouts unchanged


def test_a_piece_of_an_hsdp_state_survives_while_one_replica_of_it_is_left() -> None:
    layout = Layout(dp=4, shard=2)
    assert has_replica_for_every_shard(layout, {2, 3})
    assert has_replica_for_every_shard(layout, {0, 3})
    assert not has_replica_for_every_shard(layout, {1, 3})
    assert not has_replica_for_every_shard(Layout(dp=4, shard=4), {2})
