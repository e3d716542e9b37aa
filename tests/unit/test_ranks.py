"""Worker rank assignment: torchelastic's algorithm (group-rank order, per-role prefix sums)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from coordinator._ranks import GroupRanks, NodeRole, assign_worker_ranks


def _globals(g: GroupRanks) -> list[int]:
    return [g.global_rank(lr) for lr in range(g.local_world_size)]


def _role_ranks(g: GroupRanks) -> list[int]:
    return [g.role_rank(lr) for lr in range(g.local_world_size)]


def test_torchelastic_canonical_case() -> None:
    # api_test.py::test_assign_worker_ranks: roles interleave, walked in group-rank order.
    nodes = [
        NodeRole("ps", 4),
        NodeRole("trainer", 1),
        NodeRole("trainer", 2),
        NodeRole("trainer", 3),
        NodeRole("ps", 5),
    ]
    out = assign_worker_ranks(nodes)

    assert [g.group_rank for g in out] == [0, 1, 2, 3, 4]
    assert [g.role for g in out] == ["ps", "trainer", "trainer", "trainer", "ps"]
    assert [_globals(g) for g in out] == [
        [0, 1, 2, 3],
        [4],
        [5, 6],
        [7, 8, 9],
        [10, 11, 12, 13, 14],
    ]
    assert [_role_ranks(g) for g in out] == [
        [0, 1, 2, 3],
        [0],
        [1, 2],
        [3, 4, 5],
        [4, 5, 6, 7, 8],
    ]
    assert {g.world_size for g in out} == {15}
    assert {g.role: g.role_world_size for g in out} == {"ps": 9, "trainer": 6}
    assert [g.local_world_size for g in out] == [4, 1, 2, 3, 5]


def test_single_node() -> None:
    (g,) = assign_worker_ranks([NodeRole("default", 3)])
    assert g == GroupRanks(
        group_rank=0,
        role="default",
        local_world_size=3,
        base_global_rank=0,
        world_size=3,
        base_role_rank=0,
        role_world_size=3,
    )
    assert _globals(g) == [0, 1, 2]
    assert _role_ranks(g) == [0, 1, 2]


def test_homogeneous_nodes_are_contiguous_blocks() -> None:
    out = assign_worker_ranks([NodeRole("default", 2)] * 3)
    assert [_globals(g) for g in out] == [[0, 1], [2, 3], [4, 5]]
    assert [_role_ranks(g) for g in out] == [[0, 1], [2, 3], [4, 5]]
    assert {(g.world_size, g.role_world_size) for g in out} == {(6, 6)}


def test_no_nodes() -> None:
    assert assign_worker_ranks([]) == []


_nodes = st.lists(
    st.builds(NodeRole, st.sampled_from(["ps", "trainer", "eval"]), st.integers(1, 8)),
    min_size=1,
    max_size=20,
)


@given(_nodes)
def test_ranks_are_permutations(nodes: list[NodeRole]) -> None:
    out = assign_worker_ranks(nodes)
    world = sum(n.local_world_size for n in nodes)

    assert [g.group_rank for g in out] == list(range(len(nodes)))
    assert all(g.world_size == world for g in out)
    assert sorted(r for g in out for r in _globals(g)) == list(range(world))

    for role in {n.role for n in nodes}:
        mine = [g for g in out if g.role == role]
        role_world = sum(g.local_world_size for g in mine)
        assert all(g.role_world_size == role_world for g in mine)
        assert sorted(r for g in mine for r in _role_ranks(g)) == list(range(role_world))


@given(_nodes)
def test_ranks_follow_group_rank_order(nodes: list[NodeRole]) -> None:
    # Global and role ranks both grow with group rank: no reordering by role.
    out = assign_worker_ranks(nodes)
    flat = [r for g in out for r in _globals(g)]
    assert flat == list(range(len(flat)))
    for role in {n.role for n in nodes}:
        flat_role = [r for g in out if g.role == role for r in _role_ranks(g)]
        assert flat_role == list(range(len(flat_role)))
