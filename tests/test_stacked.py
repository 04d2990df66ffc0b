"""Packed per-block buffers: stacking consecutive slices is a view with torch.stack/cat's values;
anything else is copied as torch would."""

import pytest
import torch

from loca.core import stacked

pytestmark = pytest.mark.unit


def _blocks(n=5, shape=(4, 3), seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen, dtype=torch.float64) for _ in range(n)]


def test_pack_stack_is_a_view_equal_to_torch_stack():
    blocks = _blocks()
    packed = stacked.pack(blocks, [torch.device("cpu")] * 5, torch.float64)
    for i in ([0, 1, 2, 3, 4], [1, 2, 3], [2]):
        view = stacked.stack([packed[j] for j in i])
        assert torch.equal(view, torch.stack([blocks[j] for j in i]))
        assert view.untyped_storage().data_ptr() == packed[0].untyped_storage().data_ptr()


def test_columns_side_by_side_cat_is_a_view_equal_to_torch_cat():
    blocks = _blocks()
    packed = stacked.pack(blocks, [torch.device("cpu")] * 5, torch.float64, dim=1)
    assert all(torch.equal(p, b) for p, b in zip(packed, blocks, strict=True))
    for i in ([0, 1, 2, 3, 4], [2, 3]):
        view = stacked.cat([packed[j] for j in i], dim=1)
        assert torch.equal(view, torch.cat([blocks[j] for j in i], dim=1))
        assert view.untyped_storage().data_ptr() == packed[0].untyped_storage().data_ptr()


def test_not_consecutive_or_separate_tensors_are_copied_correctly():
    blocks = _blocks()
    packed = stacked.pack(blocks, [torch.device("cpu")] * 5, torch.float64)
    for picked in ([packed[3], packed[1]], [packed[1], packed[1]], [packed[0], packed[1], packed[3]], blocks):
        out = stacked.stack(picked)
        assert torch.equal(out, torch.stack(picked))
        assert out.untyped_storage().data_ptr() != packed[0].untyped_storage().data_ptr()
    every_other = stacked.stack(packed[::2])  # equally spaced: still a view (stride of two blocks)
    assert torch.equal(every_other, torch.stack(packed[::2])) and every_other._base is not None
    # rows stacked as dim-0 slices cannot be joined along dim 1 without a copy
    assert torch.equal(stacked.cat(packed[:2], dim=1), torch.cat(packed[:2], dim=1))


def test_assign_writes_each_block_in_place():
    blocks = _blocks()
    values = torch.stack(_blocks(seed=1))
    cpu = [torch.device("cpu")] * 5
    for target in (stacked.pack(blocks, cpu, torch.float64), [b.clone() for b in blocks]):
        before = [t.data_ptr() for t in target]
        stacked.assign(target[1:4], values[1:4])
        assert [t.data_ptr() for t in target] == before
        assert all(torch.equal(target[i], values[i]) for i in (1, 2, 3))
        assert torch.equal(target[0], blocks[0]) and torch.equal(target[4], blocks[4])


def test_pack_groups_runs_of_devices():
    blocks = _blocks(n=4)
    devices = [torch.device("cpu")] * 4
    packed = stacked.pack(blocks, devices, torch.float32)
    assert all(p.dtype == torch.float32 for p in packed)
    assert len({p.untyped_storage().data_ptr() for p in packed}) == 1
