"""`--fresh` deletes only a run directory podscale created (issue 11, item 1)."""
import pytest

from podscale.cli import main
from podscale.train import rundir


def _snapshot(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _fails_touching_nothing(folder, capsys, argv, *words):
    before = _snapshot(folder)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("podscale: error: ") and "\n" not in err, err
    for w in words:
        assert w in err, (w, err)
    assert _snapshot(folder) == before


@pytest.mark.parametrize("name", ["..", ".", "a/b", "../x", "/etc"])
def test_name_that_is_a_path_is_refused(tmp_path, monkeypatch, capsys, name):
    # the issue's scenario: an empty folder holding one file, run.name=.. with the default out_dir
    (tmp_path / "precious.txt").write_text("keep me")
    monkeypatch.chdir(tmp_path)
    _fails_touching_nothing(tmp_path, capsys, ["train", "--set", f"run.name='{name}'", "--set", "run.steps=1",
                                               "--set", "parallel.nproc=1", "--fresh"], "run.name")
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_issue_scenario_from_the_command_line(tmp_path, monkeypatch, capsys):
    """The issue's command line, run through the command's entry point in this process (exit code 2, one
    line on standard error, nothing touched); test_config_errors.py runs a refused ``podscale train`` as a
    subprocess of its own, end to end."""
    (tmp_path / "precious.txt").write_text("keep me")
    monkeypatch.chdir(tmp_path)
    code = main(["train", "--set", "run.name=..", "--set", "run.steps=1", "--set", "parallel.nproc=1", "--fresh"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "run.name" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["precious.txt"]


def test_fresh_refuses_a_folder_podscale_did_not_create(tmp_path, monkeypatch, capsys):
    user = tmp_path / "runs" / "mine"
    user.mkdir(parents=True)
    (user / "notes.txt").write_text("mine")
    monkeypatch.chdir(tmp_path)
    _fails_touching_nothing(tmp_path, capsys, ["train", "--name", "mine", "--steps", "1", "--nproc", "1",
                                               "--fresh"], "'runs/mine'", rundir.MARKER, "delete it yourself")
    assert (user / "notes.txt").read_text() == "mine"


def test_fresh_refuses_a_run_dir_that_links_outside_out_dir(tmp_path, monkeypatch, capsys):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / rundir.MARKER).write_text("planted")  # even a marker behind a link does not count
    (elsewhere / "data.bin").write_text("x")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "linked").symlink_to(elsewhere)
    monkeypatch.chdir(tmp_path)
    _fails_touching_nothing(tmp_path, capsys, ["train", "--name", "linked", "--steps", "1", "--nproc", "1",
                                               "--fresh"], "outside run.out_dir")
    assert (elsewhere / "data.bin").exists()


def test_fresh_deletes_only_a_marked_run_dir(tmp_path):
    run = rundir.resolve_run_dir(tmp_path / "runs", "r1")
    rundir.prepare(run, fresh=False)
    assert (run / rundir.MARKER).is_file()
    (run / "metrics.jsonl").write_text("{}")
    rundir.prepare(run, fresh=True)  # marked: deleted and created again, marked again
    assert sorted(p.name for p in run.iterdir()) == [rundir.MARKER]
    # an existing folder podscale did not create is used as it is, never marked
    other = tmp_path / "runs" / "by-hand"
    other.mkdir()
    rundir.prepare(other, fresh=False)
    assert not (other / rundir.MARKER).exists()
    with pytest.raises(rundir.RunDirError, match="no .podscale-run marker"):
        rundir.prepare(other, fresh=True)
    assert other.is_dir()
    # a file where the run directory should be
    (tmp_path / "runs" / "file").write_text("x")
    with pytest.raises(rundir.RunDirError, match="no .podscale-run marker"):
        rundir.prepare(tmp_path / "runs" / "file", fresh=True)
    with pytest.raises(rundir.RunDirError, match="not a folder"):
        rundir.prepare(tmp_path / "runs" / "file", fresh=False)
