"""A ZeRO checkpoint written at one (dp, stage) loads at another and training continues exactly:
stage 3 on dp=4 -> stage 1 on dp=2 -> stage 0 (the replicated strategy) on one process; and the
checkpoint exports to one consolidated file of natural-shape tensors."""
import math

import torch

from conftest import shakespeare
from podscale.runtime.launcher import launch
from podscale.train import checkpoint
from zero_workers import checkpoint_chain, resume_and_step, zero_config

GLOBAL_BATCH = 16


def test_reshard_stage3_dp4_to_stage1_dp2_to_stage0(tmp_path):
    path = shakespeare()
    a = zero_config(path, 6, GLOBAL_BATCH, 4, "fp32", 4, 3)
    cont = launch(checkpoint_chain, (a, str(tmp_path / "a"), 3, 3), nproc=4)[0]["losses"]
    ck_a = checkpoint.latest(tmp_path / "a")
    assert ck_a is not None and ck_a.name == "step_00000003"

    b = zero_config(path, 6, GLOBAL_BATCH, 8, "fp32", 2, 1)
    res_b = launch(resume_and_step, (b, str(ck_a), 2, str(tmp_path / "b")), nproc=2)[0]
    # The first step after loading sees the same weights, optimizer state and batch; only the order in
    # which per-rank losses/gradients are summed differs (dp 4 vs 2), so agreement is to rounding.
    for got, want in zip(res_b["losses"], cont[3:5]):
        assert math.isclose(got, want, rel_tol=1e-6), (res_b["losses"], cont)

    c = zero_config(path, 6, GLOBAL_BATCH, 16, "fp32", 1, 0)
    res_c = resume_and_step(c, res_b["saved"], 1)
    assert math.isclose(res_c["losses"][0], cont[5], rel_tol=1e-6), (res_c["losses"], cont)

    # consolidated export: natural shapes, same values the replicated strategy loaded
    out = checkpoint.export(res_b["saved"], tmp_path / "model.pt")
    exported = torch.load(out, weights_only=True)["model"]
    for name, t in res_c["loaded"].items():
        assert exported[name].shape == t.shape, name
        assert torch.equal(exported[name], t), name
    # tied embedding and head stay one tensor
    assert torch.equal(exported["wte.weight"], exported["lm_head.weight"])


def test_nvme_checkpoint_reshards_both_ways(tmp_path):
    """ZeRO-Infinity state (optimizer and parameters on NVMe, the step streamed under the next forward)
    saves mid-run and loads at stage 1 without offload and back into NVMe offload: the next steps' losses
    equal the continuous run's."""
    path = shakespeare()
    swap = tmp_path / "swap"
    swap.mkdir()
    nv = {"offload_optimizer": "nvme", "offload_param": "nvme", "nvme_path": str(swap), "nvme_block_mb": 0.1}
    a = zero_config(path, 6, GLOBAL_BATCH, 8, "fp32", 2, 3, **nv)
    cont = launch(checkpoint_chain, (a, str(tmp_path / "a"), 3, 3), nproc=2)[0]["losses"]
    ck_a = checkpoint.latest(tmp_path / "a")
    b = zero_config(path, 6, GLOBAL_BATCH, 8, "fp32", 2, 1)
    res_b = launch(resume_and_step, (b, str(ck_a), 2), nproc=2)[0]
    res_c = launch(resume_and_step, (a, str(ck_a), 2), nproc=2)[0]
    for got in (res_b["losses"], res_c["losses"]):
        for g, want in zip(got, cont[3:5]):
            assert math.isclose(g, want, rel_tol=1e-6), (got, cont)
    assert not list(swap.glob("*.swp"))
