import numpy as np

from shardfeed.service.datasets.index import Members
from shardfeed.service.read.planner import merge_blocks, plan_pieces


def members(offsets, sizes, found=None):
    n = len(offsets)
    return Members(position=np.arange(n), sample=np.arange(n), field=np.zeros(n, np.int32),
                   shard=np.zeros(n, np.int32), offset=np.array(offsets, np.int64),
                   size=np.array(sizes, np.int64),
                   found=np.ones(n, bool) if found is None else np.array(found), row=np.arange(n))


def test_members_are_split_at_block_boundaries():
    p = plan_pieces(members([10, 1000, 2048, 5000], [20, 2000, 1024, 0], [True, True, True, True]), 1024)
    rows = list(zip(p.member.tolist(), p.block.tolist(), p.start.tolist(), p.end.tolist()))
    assert rows == [(0, 0, 10, 30), (1, 0, 1000, 1024), (1, 1, 0, 1024), (1, 2, 0, 952), (2, 2, 0, 1024)]


def test_missing_members_have_no_pieces():
    p = plan_pieces(members([0, 100], [50, 50], [False, True]), 1024)
    assert p.member.tolist() == [1]


def test_nearby_blocks_merge_into_runs_no_longer_than_the_limit():
    assert merge_blocks([0, 1, 2, 5, 7, 20], gap_blocks=1, max_blocks=100) == [(0, 2), (5, 7), (20, 20)]
    assert merge_blocks([0, 1, 2, 3, 4], gap_blocks=0, max_blocks=2) == [(0, 1), (2, 3), (4, 4)]
    assert merge_blocks([], gap_blocks=1, max_blocks=4) == []


def test_runs_do_not_bridge_blocks_that_are_already_cached():
    cached = {3}
    assert merge_blocks([2, 4, 6], gap_blocks=1, max_blocks=10, bridgeable=lambda b: b not in cached) == \
        [(2, 2), (4, 6)]
