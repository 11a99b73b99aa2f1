"""Mesh, instrumented collectives, the data-parallel wrapper's overlap, and the launchers."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from podscale.runtime.launcher import launch
from podscale.runtime.mesh import Mesh, MeshError, check_shape
from runtime_workers import buckets_launch_during_backward, collectives_on_a_2x2_mesh


def test_mesh_coordinates_are_row_major_with_tp_innermost():
    mesh = Mesh(sizes={"pp": 2, "dp": 2, "ep": 1, "tp": 2}, rank=5)
    assert mesh.coords() == {"pp": 1, "dp": 0, "ep": 0, "tp": 1}
    assert mesh.group_ranks("tp") == [4, 5]
    assert mesh.group_ranks("dp") == [5, 7]
    assert mesh.group_ranks("pp") == [1, 5]
    assert mesh.group_ranks("dp", "tp") == [4, 5, 6, 7]
    assert all(mesh.rank_of(**mesh.coords(r)) == r for r in range(8))
    assert mesh.local_rank("dp", "tp") == 1


def test_mesh_shape_errors_state_the_fix():
    with pytest.raises(MeshError, match=r"make pp\*dp\*ep\*tp equal the number of processes \(4\)"):
        check_shape({"pp": 1, "dp": 3, "ep": 1, "tp": 1}, 4)
    with pytest.raises(MeshError, match="unknown mesh axis 'xp'"):
        check_shape({"xp": 2}, 2)


def test_collectives_on_a_2x2_mesh():
    res = launch(collectives_on_a_2x2_mesh, (), nproc=4)
    for r, out in res.items():
        tp0 = r - r % 2
        assert out["tp_ranks"] == [tp0, tp0 + 1]
        assert out["tp_sum"] == tp0 + tp0 + 1
        assert out["dp_sum"] == (r % 2) + (r % 2 + 2)
        assert out["world_sum"] == 6
        scale = (tp0 + 1) + (tp0 + 2)  # full tensors of the tp pair were scaled by rank + 1
        half = (r % 2) * 4
        assert out["rs"] == [float(i * scale) for i in range(half, half + 4)]
        assert out["ag"] == [float(i * scale) for i in range(8)]
        peer = tp0 + 1 - r % 2
        assert out["a2a"] == ([float(tp0)] * 1 + [float(peer)] * 2 if r % 2 == 0
                              else [float(peer)] * 3 + [float(r)] * 2)
        st = out["stats"]
        # ring all-reduce of 4 bytes over 2 ranks puts 2*(n-1)/n*4 = 4 bytes on the wire per call
        assert st["tp/all_reduce"] == {**st["tp/all_reduce"], "calls": 1, "bytes": 4}
        assert st["dp+tp/all_reduce"]["bytes"] == 2 * 3 * 4 // 4
        assert st["tp/reduce_scatter"]["bytes"] == 16 and st["tp/all_gather"]["bytes"] == 16
        assert all(s["busy_s"] > 0 for s in st.values())
        assert out["large"] == {"tp": {"ag": True, "rs": True}, "dp+tp": {"ag": True, "rs": True}}
        # the backend is recorded with each group when the mesh creates it (picks the in-place path)
        assert out["backends"] == {"tp": "gloo", "dp": "gloo", "dp+tp": "gloo"}


def test_gradient_buckets_go_on_the_wire_during_backward():
    res = launch(buckets_launch_during_backward, (), nproc=2)
    for out in res.values():
        assert out["buckets"] == 6
        assert out["launched_before_end"] >= 4  # layers 6..2 were reduced while layer 1 computed
        assert out["same_on_all"]


def test_podscale_launch_runs_a_script_with_a_loopback_rendezvous(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(f"""
        import json, os, sys, psutil
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        t = torch.ones(1) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        agent = psutil.Process(os.getppid())
        listening = sorted({{c.laddr.ip for p in [agent, psutil.Process()] for c in p.net_connections("tcp")
                            if c.status == psutil.CONN_LISTEN}})
        out = {{"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item(), "args": sys.argv[1:],
               "listening": listening, "master": os.environ["MASTER_ADDR"]}}
        (open(r"{tmp_path}" + f"/rank{{dist.get_rank()}}.json", "w")).write(json.dumps(out))
        dist.destroy_process_group()
    """))
    out = subprocess.run([sys.executable, "-m", "podscale", "launch", "-n", "2", str(script), "--flag", "x"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    for r in range(2):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert (got["world"], got["sum"], got["args"]) == (2, 3.0, ["--flag", "x"])
        assert got["master"] == "127.0.0.1"
        assert got["listening"] and set(got["listening"]) == {"127.0.0.1"}, got["listening"]


def test_podscale_launch_binds_each_worker_to_its_own_cores(tmp_path):
    """``podscale launch --bind-cores``: every worker's script runs as ``__main__`` with its own arguments and folder
    on ``sys.path``, pinned to its local rank's slice of the cores, one thread per core."""
    (tmp_path / "helper_mod.py").write_text("VALUE = 7\n")
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(f"""
        import json, os, sys
        import torch
        import helper_mod
        if __name__ == "__main__":
            out = {{"cores": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads(), "args": sys.argv[1:],
                   "value": helper_mod.VALUE}}
            (open(r"{tmp_path}" + "/rank" + os.environ["LOCAL_RANK"] + ".json", "w")).write(json.dumps(out))
    """))
    out = subprocess.run([sys.executable, "-m", "podscale", "launch", "-n", "2", "--bind-cores", str(script), "--k", "v"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    cpus = sorted(os.sched_getaffinity(0))
    per = len(cpus) // 2
    for r in range(2):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert (got["args"], got["value"]) == (["--k", "v"], 7)
        if per:
            assert got["cores"] == cpus[r * per:(r + 1) * per]
            assert got["threads"] == per or "OMP_NUM_THREADS" in os.environ
        else:
            assert got["cores"] == cpus


def test_train_with_no_config_uses_the_standard_library_corpus(tmp_path, capfd):
    """``podscale train`` without a config, through its entry point in this process (test_train_cli.py runs
    the command line as a subprocess); its two workers bound to a core each where there are two."""
    from podscale.cli import main
    capfd.readouterr()
    code = main(["train", "--steps", "4", "--out-dir", str(tmp_path), "--set", "run.eval_every=0",
                 "--set", "run.sample_tokens=16", "--set", "model.n_layer=1", "--set", "parallel.bind_cores=true"])
    out = capfd.readouterr()
    assert code == 0, out.err[-2000:]
    assert "podscale: done: 4 steps" in out.out
    cores = len(os.sched_getaffinity(0))
    assert ("local ranks bound to " + f"{cores // 2} core(s) each" in out.out) == (cores >= 2)
    rows = [json.loads(x) for x in (tmp_path / "gpt-small" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert (tmp_path / "gpt-small" / "sample.txt").stat().st_size > 0


def _bind_in_child(local_rank: int, local_world: int, queue) -> None:
    from podscale.runtime.process import bind_local_cores
    queue.put((bind_local_cores(local_rank, local_world), sorted(os.sched_getaffinity(0))))


def test_bind_local_cores_gives_each_local_rank_its_own_slice_of_the_cores():
    """Each local rank gets the next equal, contiguous slice of the process's affinity mask, and more local ranks
    than cores bind nothing (run in forked children: binding is process-wide)."""
    import multiprocessing
    cpus = sorted(os.sched_getaffinity(0))
    ctx = multiprocessing.get_context("fork")
    seen = {}
    for world in (1, 2, len(cpus), len(cpus) + 1):
        for rank in range(world):
            queue = ctx.Queue()
            child = ctx.Process(target=_bind_in_child, args=(rank, world, queue))
            child.start()
            seen[rank, world] = queue.get(timeout=60)
            child.join(60)
            assert child.exitcode == 0
    for (rank, world), (bound, affinity) in seen.items():
        per = len(cpus) // world
        if per == 0:
            assert bound is None and affinity == cpus
        else:
            assert bound == affinity == cpus[rank * per:(rank + 1) * per]
    assert seen[0, 1][0] == cpus


def test_python_api(tmp_path):
    from conftest import shakespeare
    from runtime_workers import python_api_trains
    res = launch(python_api_trains, (shakespeare(),), nproc=2)
    assert res[0] == res[1]
    assert res[0][-1] < res[0][0]


def test_forked_workers_see_the_parents_environment_at_each_launch(monkeypatch):
    """Workers fork from a server that imported torch once; each launch still hands them the parent's
    environment as it is at that launch (a variable set, changed or removed after the server started) and
    the agent's own variables (RANK differs per worker)."""
    from runtime_workers import environment_and_imports
    names = ["PODSCALE_T_SET", "PODSCALE_T_GONE"]
    monkeypatch.setenv("PODSCALE_T_SET", "first")
    monkeypatch.setenv("PODSCALE_T_GONE", "here")
    first = launch(environment_and_imports, (names,), nproc=2)
    monkeypatch.setenv("PODSCALE_T_SET", "second")
    monkeypatch.delenv("PODSCALE_T_GONE")
    second = launch(environment_and_imports, (names,), nproc=2)
    assert [first[r]["env"] for r in (0, 1)] == [{"PODSCALE_T_SET": "first", "PODSCALE_T_GONE": "here"}] * 2
    assert [second[r]["env"] for r in (0, 1)] == [{"PODSCALE_T_SET": "second", "PODSCALE_T_GONE": None}] * 2
    assert {second[r]["rank"] for r in (0, 1)} == {"0", "1"}
    me = os.getpid()  # the elastic agent runs in this process: forked workers' parent is the fork server
    assert first[0]["parent"] == first[1]["parent"] == second[0]["parent"] != me
    spawned = launch(environment_and_imports, (names,), nproc=2, start_method="spawn")
    assert spawned[0]["env"]["PODSCALE_T_SET"] == "second" and spawned[0]["parent"] == me
    # the objects a forked worker inherits (the server's imports of torch and podscale) are frozen out of its
    # garbage collections: a full collection walks only the worker's own (unfrozen, ~300k: 0.25-0.5 s each)
    for res in (first[0], second[1]):
        assert res["gc_frozen"] > 100_000 and res["gc_tracked"] < 10_000, res


def test_forked_workers_write_to_the_launching_process_streams(capfd):
    """A worker forked from the server writes to the standard output and error the launching process has
    at this launch (here: the test's capture, which did not exist when the server started)."""
    from runtime_workers import print_and_return
    launch(print_and_return, ("warm",), nproc=2)  # the server is running before this capture starts
    capfd.readouterr()
    assert launch(print_and_return, ("hello from a worker",), nproc=2) == {0: 0, 1: 1}
    out = capfd.readouterr()
    assert out.out.count("hello from a worker") == 2 and out.err.count("hello from a worker") == 2
