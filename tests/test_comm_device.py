"""The communication layer refuses tensors that are not on the mesh's device (issue 11, item 7).

NCCL refuses a CPU tensor; gloo takes one, so on the CPU the bug stays hidden.  The check is always on, and
its strict mode (PODSCALE_STRICT_DEVICE=1, set for the whole suite by conftest.py, inherited by spawned
workers) also refuses tensors allocated on torch's default device, the CPU on a GPU mesh: the bug of LAMB /
LARS's trust-ratio all-reduce (``torch.zeros(2, n, dtype=torch.float64)`` then all-reduced) is caught here."""
import os

import pytest
import torch

from podscale.runtime import comm
from podscale.runtime.mesh import Mesh


def test_the_suite_runs_in_strict_mode():
    assert comm.strict_devices_requested()  # (conftest.py sets it for every test and worker)


def test_a_tensor_off_the_mesh_device_is_refused():
    mesh = Mesh.build(torch.device("meta"), dp=1)  # a mesh whose device is not where the tensor lives
    t = torch.zeros(3, device="cpu")
    with pytest.raises(comm.CommDeviceError) as err:
        comm.all_reduce(t, mesh, "dp")
    msg = str(err.value)
    assert "\n" not in msg and "all_reduce on axis dp" in msg and "on cpu" in msg and "device=mesh.device" in msg
    with pytest.raises(comm.CommDeviceError, match="all_gather"):
        comm.all_gather(torch.empty(3, device="meta"), t, mesh, "dp")
    with pytest.raises(comm.CommDeviceError, match="reduce_scatter"):
        comm.reduce_scatter(torch.empty(3, device="meta"), t, mesh, "dp")
    with pytest.raises(comm.CommDeviceError, match="broadcast"):
        comm.broadcast(t, 0, mesh, "dp")


def test_strict_mode_catches_the_trust_ratio_bug():
    mesh = Mesh.build(torch.device("cpu"), dp=1)  # (enables the strict mode in this process)
    n = 4
    # LAMB/LARS's pattern: per-tensor squared norms in a float64 buffer made without a device, all-reduced
    sq = torch.zeros(2, n, dtype=torch.float64)
    sq[0, 1] += 3.0
    with pytest.raises(comm.CommDeviceError) as err:
        comm.all_reduce(sq, mesh, "dp")
    msg = str(err.value)
    assert "\n" not in msg and "default device" in msg and "torch.float64" in msg and comm.STRICT_ENV in msg
    # a dtype conversion keeps the record; naming the device clears it
    with pytest.raises(comm.CommDeviceError):
        comm.all_reduce(sq.to(torch.float32), mesh, "dp")
    for ok in (torch.zeros(2, n, dtype=torch.float64, device=mesh.device), sq.to(mesh.device),
               torch.tensor([1.0], device=mesh.device), torch.linalg.vector_norm(torch.ones(3, device=mesh.device))):
        comm.all_reduce(ok, mesh, "dp")  # placed on the mesh's device: accepted
    with pytest.raises(comm.CommDeviceError):
        comm.all_reduce(torch.tensor([1.0, 2.0]), mesh, "dp")
    assert os.environ[comm.STRICT_ENV] == "1"
