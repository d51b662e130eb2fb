"""Writes land where they were asked to, replace only regular files, and lose nothing.

A symlink, a FIFO or a device node given as an output is left as it is; names from a case file
never take a plot outside its folder; a result whose final write fails is saved to a rescue file.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import pytest
from conftest import linear_case, needs_torch

from accumcheck import files
from accumcheck.cli import main
from accumcheck.errors import AccumcheckError

pytestmark = needs_torch


def _tree(root: Path) -> dict[str, str]:
    """Every path under ``root`` (links not followed) and what it is."""
    found = {}
    for folder, dirs, names in os.walk(root):
        for name in dirs + names:
            path = Path(folder) / name
            mode = os.lstat(path).st_mode
            found[str(path.relative_to(root))] = stat.filemode(mode)[0]
    return found


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def outputs(tmp_path):
    """A symlink to a file, a FIFO and (where this process may make one) a character device."""
    (tmp_path / "target.json").write_text("keep me\n")
    (tmp_path / "link.json").symlink_to(tmp_path / "target.json")
    os.mkfifo(tmp_path / "fifo")
    try:
        os.mknod(tmp_path / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except (PermissionError, OSError):
        os.symlink("/dev/null", tmp_path / "null")  # a device all the same, reached through a link
    (tmp_path / "lin.toml").write_text(linear_case("lin", 0, 2))
    return tmp_path


@pytest.mark.parametrize("command", [
    ["compare", "--format", "json"], ["sweep", "--accum-steps", "2"], ["train", "--steps", "1"],
    ["show", "REPORT"],
])
@pytest.mark.parametrize("target", ["link.json", "fifo", "null"])
def test_links_fifos_and_devices_are_left_as_they_are(command, target, outputs, capsys):
    before = _tree(outputs)
    if command[0] == "show":
        assert main(["compare", "--case", str(outputs / "lin.toml"), "--format", "json", "--output",
                     str(outputs / "r.json")]) == 0
        command = ["show", str(outputs / "r.json")]
        before = _tree(outputs)
        capsys.readouterr()
    else:
        command = [command[0], "--case", str(outputs / "lin.toml"), *command[1:]]
    code, out, err = _run([*command, "--output", str(outputs / target)], capsys)
    assert code == 2 and "replaces only regular files" in err, (out, err)
    assert "saved to" not in err and not out, (out, err)  # refused before the run, not after it
    assert _tree(outputs) == before
    assert (outputs / "target.json").read_text() == "keep me\n"
    assert stat.S_ISFIFO(os.lstat(outputs / "fifo").st_mode)
    assert stat.S_ISCHR(os.stat(outputs / "null").st_mode)


@pytest.mark.parametrize("name", ["../../escape", "/abs/escape", "..", "a/../../b", "\\\\host\\share"])
def test_names_from_a_case_file_stay_inside_the_plot_folder(name, tmp_path, capsys):
    case = tmp_path / "case.toml"
    case.write_text(linear_case("lin", 0, 2).replace('name = "lin"', f"name = {json.dumps(name)}"))
    plots = tmp_path / "deep" / "er" / "plots"
    code, out, err = _run(["compare", "--case", str(case), "--plot", str(plots)], capsys)
    assert code == 0, (out, err)
    made = {path for path in _tree(tmp_path) if not path.startswith("deep/er/plots/")}
    assert made == {"case.toml", "deep", "deep/er", "deep/er/plots"}
    written = sorted(p.name for p in plots.iterdir())
    assert len(written) == 4 and all(re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9._-]*", p) for p in written), written
    assert not Path("/abs").exists()


def test_a_plot_file_that_is_a_link_is_not_followed(tmp_path, capsys):
    plots = tmp_path / "plots"
    plots.mkdir()
    (tmp_path / "elsewhere.png").write_text("keep me\n")
    (tmp_path / "lin.toml").write_text(linear_case("lin", 0, 2))
    (plots / "lin-torch-N2-scatter.png").symlink_to(tmp_path / "elsewhere.png")
    code, out, err = _run(["compare", "--case", str(tmp_path / "lin.toml"), "--plot", str(plots)], capsys)
    assert code == 2 and "is a symbolic link; accumcheck replaces only regular files" in err, err
    assert "OK: all 2 tensors faithful" in out  # the report came before the plots: not lost
    assert (tmp_path / "elsewhere.png").read_text() == "keep me\n"


def test_write_atomic_refuses_what_appeared_after_the_check(tmp_path):
    """The check before the run and the write after it are apart in time: the write checks again."""
    os.mkfifo(tmp_path / "late")
    with pytest.raises(AccumcheckError, match="is a FIFO"):
        files.write_atomic(tmp_path / "late", "text")
    assert stat.S_ISFIFO(os.lstat(tmp_path / "late").st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["late"]  # no temporary file left behind


@pytest.mark.parametrize("command", [["compare", "--format", "json"],
                                     ["sweep", "--accum-steps", "2", "--format", "json"], ["train", "--steps", "1"]])
def test_a_result_whose_write_fails_is_rescued(command, tmp_path, monkeypatch, capsys):
    (tmp_path / "lin.toml").write_text(linear_case("lin", 0, 2))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)

    def full_disk(path, text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files, "write_atomic", full_disk)
    code, out, err = _run([command[0], "--case", str(tmp_path / "lin.toml"), *command[1:], "--output",
                           str(tmp_path / "r.json")], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    found = re.search(r"No space left on device\); the report was saved to (\S+) instead", err)
    assert found, err
    rescued = Path(found.group(1))
    assert rescued.parent == tmp_path / "tmp"
    assert json.loads(rescued.read_text())["kind"] in ("report", "sweep", "trajectory")
    assert not (tmp_path / "r.json").exists()
