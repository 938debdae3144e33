"""bench ps's gloo side coalesced as DDP coalesces: its buckets are torch's, its mean is the per-tensor one."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


import numpy as np
import pytest
import torch
import torch.distributed as dist

from bench import ps


def _shapes():
    from poseidon_aio.plan.models import vgg19

    return {
        "vgg19": [list(s.shape) for s in vgg19()],
        "transformer": ps._transformer_shapes(),
        "64MiB": [[16 * ps.MiB]],
    }


@pytest.mark.parametrize("case", ["vgg19", "transformer", "64MiB"])
def test_ddp_buckets_match_torch_reducer(case):
    shapes = _shapes()[case]
    tensors = [torch.empty(s) for s in shapes]
    n = len(tensors)
    # DDP's reducer rebuilds buckets over its parameters in gradient-ready order (their reverse here): the
    # tensors in that order with their indices, as Reducer::rebuild_buckets passes them; 1 MiB then 25 MiB.
    expected, _ = dist._compute_bucket_assignment_by_size(
        tensors[::-1], [dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * ps.MiB], [False] * n, list(reversed(range(n)))
    )
    assert ps.ddp_buckets(shapes) == [list(b) for b in expected]
    assert sorted(i for b in ps.ddp_buckets(shapes) for i in b) == list(range(n))


def test_coalesced_mean_equals_per_tensor(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        shapes = [[3, 5], [300_000], [7], [200_000], [2, 2, 2]]
        rng = np.random.default_rng(0)
        grads = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
        a = [torch.from_numpy(g.copy()) for g in grads]
        b = [torch.from_numpy(g.copy()) for g in grads]
        buckets = ps.ddp_buckets(shapes)
        assert len(buckets) > 1 and any(len(x) > 1 for x in buckets)
        ps._gloo_mean(dist, a, 1)
        ps._gloo_coalesced_mean(dist, ps._flat_buckets(torch, b, buckets)[0], 1)
        for x, y, g in zip(a, b, grads):
            np.testing.assert_array_equal(x.numpy(), y.numpy())
            np.testing.assert_array_equal(y.numpy(), g)
        # world 4 divides: the mean of 4 equal contributions scaled by 1/4 here
        ps._gloo_coalesced_mean(dist, ps._flat_buckets(torch, b, buckets)[0], 4)
        for y, g in zip(b, grads):
            np.testing.assert_allclose(y.numpy(), g / 4, rtol=1e-6)
    finally:
        dist.destroy_process_group()


def test_flat_bucket_views_cover_the_flat_buffers():
    shapes = [[3, 5], [300_000], [7], [200_000], [2, 2, 2]]
    tensors = [torch.zeros(s) for s in shapes]
    plan, views = ps._flat_buckets(torch, tensors, ps.ddp_buckets(shapes))
    for flat, pairs in plan:
        if not pairs:  # a bucket of one: the tensor itself
            assert any(flat.data_ptr() == t.data_ptr() for t in tensors)
        else:
            assert sum(v.numel() for v, _ in pairs) == flat.numel()
            assert all(v.shape == t.shape and v.data_ptr() != t.data_ptr() for v, t in pairs)
    assert [v is None for v in views] == [any(b == [i] for b in ps.ddp_buckets(shapes)) for i in range(len(shapes))]
