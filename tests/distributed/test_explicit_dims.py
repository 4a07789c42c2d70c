"""Members with an explicit channel-axis dim (``@d``, fused 3-D experts) are refused by the sharded path.

A world of one rank in this process (gloo, a HashStore) is enough: the decision reads global metadata only.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_pat.core.spec import Cluster, resolve_clusters
from lightning_pat.parallel.executors.routing import route

pytestmark = [pytest.mark.distributed]


@pytest.fixture
def mesh():
    if dist.is_initialized():
        pytest.skip("a process group is initialized already")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_sharded_path_refuses_a_member_on_an_explicit_dim_naming_cluster_and_member(mesh):
    params = {
        "experts.gate_up_proj": distribute_tensor(torch.randn(4, 12, 8), mesh, [Shard(0)]),
        "experts.down_proj": distribute_tensor(torch.randn(4, 8, 6), mesh, [Shard(0)]),
    }
    channels = Cluster("mlp", ["experts.gate_up_proj@1[0/2]", "experts.gate_up_proj@1[1/2]"], ["experts.down_proj@2"])
    experts = Cluster("experts", ["experts.gate_up_proj", "experts.down_proj"])
    resolved = resolve_clusters(params, [channels, experts])
    routes = route(resolved, params)
    assert routes["mlp"][0] == "materializing"
    assert "experts.gate_up_proj" in routes["mlp"][1]
    assert "dim 1" in routes["mlp"][1]
    assert routes["experts"][0] == "sharded"  # whole experts are dim 0 writers: the sharded path serves them
    with pytest.raises(ValueError, match=r"Cluster 'mlp': executor='sharded' cannot serve this cluster: member "
                       r"'experts.gate_up_proj' has its channel axis on dim 1 \(set with `@1`"):  # fmt: skip
        route(resolved, params, executor="sharded")
