"""GPU tensor parallelism placed by Ray: bundles, rank -> GPU assignment (functions), the real run on GPUs."""

import pytest
import torch

from cluster.deploy.app import build_app
from cluster.config import RdserveConfig
from cluster.replica.placement import rank_gpu_ids, tp_bundles, tp_placement_options, uses_gpu_placement
from cluster.deploy.serve_config import deployment_options


def _cfg(device: str, tp_size: int, num_cpus: float = 1.0) -> RdserveConfig:
    return RdserveConfig.model_validate({"engine": {"device": device, "tp_size": tp_size},
                                         "serve": {"num_cpus_per_replica": num_cpus}})


def test_one_gpu_bundle_per_rank_with_the_replica_in_bundle_zero():
    assert tp_bundles(4, 2.0) == [{"CPU": 2.0, "GPU": 1.0}, {"GPU": 1.0}, {"GPU": 1.0}, {"GPU": 1.0}]
    assert tp_bundles(1, 1.0) == [{"CPU": 1.0, "GPU": 1.0}]
    with pytest.raises(ValueError, match="tp_size"):
        tp_bundles(0, 1.0)


def test_placement_only_for_cuda_tensor_parallelism():
    assert tp_placement_options(_cfg("cuda", 8)) == {"placement_group_bundles": tp_bundles(8, 1.0),
                                                      "placement_group_strategy": "STRICT_PACK"}
    assert tp_placement_options(_cfg("cuda", 1)) == {}
    assert tp_placement_options(_cfg("cpu", 4)) == {}
    assert uses_gpu_placement(_cfg("cuda:1", 2))


def test_engine_deployment_carries_the_bundles():
    (engine,) = [d for d in deployment_options(_cfg("cuda", 4, 2.0)) if d["name"] == "EngineReplica"]
    assert engine["placement_group_bundles"] == tp_bundles(4, 2.0)
    assert engine["placement_group_strategy"] == "STRICT_PACK"
    # the replica actor (rank 0) must fit bundle 0: its CPUs and one GPU
    assert engine["ray_actor_options"] == {"num_cpus": 2.0, "num_gpus": 1.0}
    build_app(_cfg("cuda", 4, 2.0))  # Serve accepts the combination when binding


def test_rank_r_gets_bundle_r_gpu():
    assert rank_gpu_ids([["3"], [5], ["0"]]) == ["3", "5", "0"]
    with pytest.raises(ValueError, match="bundle 1 holds 2 GPUs"):
        rank_gpu_ids([["0"], ["1", "2"]])
    with pytest.raises(ValueError, match="bundle 0 holds 0 GPUs"):
        rank_gpu_ids([[]])
    with pytest.raises(ValueError, match="share a GPU"):
        rank_gpu_ids([["1"], ["1"]])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a GPU (two, for TP2 pinned by rank)")
def test_tp2_ranks_pinned_to_given_gpus_on_cuda(tiny_model_dirs):
    from workers.tp.executor import TPExecutor

    model = tiny_model_dirs["tied_gqa2"]
    ex = TPExecutor(str(model), 2, num_slots=16, device="cuda", gpus=["0", "1"])  # rank 1 sees only GPU 1
    try:
        hidden = torch.randn(3, ex.config.hidden_size, device=ex.device)
        expected = hidden @ ex.lm_head_weight.T
        torch.testing.assert_close(ex.logits(hidden)[:, :expected.shape[1]], expected, rtol=1e-4, atol=1e-4)
    finally:
        ex.close()
