"""What ``--launcher ray`` would upload as the job's working directory, sized before Ray zips anything
(``launcher.backends.ray.upload``): the ignore files and ``--ray-exclude`` as Ray applies them, Ray's
own session folders never, and a directory past the limit refused at once with its biggest entries."""

from __future__ import annotations

import time

import pytest

from launcher.backends.ray.upload import PACKAGE_LIMIT, check_working_dir, package_size
from launcher.errors import SyncError

pytestmark = pytest.mark.unit


def _file(path, nbytes: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.truncate(nbytes)  # sparse: its size without the disk


def test_the_size_counts_what_ray_would_pack_and_leaves_out_what_the_ignore_files_and_excludes_name(tmp_path):
    _file(tmp_path / "train.py", 1000)
    _file(tmp_path / "data" / "train.bin", 5000)
    _file(tmp_path / "logs" / "a.log", 300)
    _file(tmp_path / "pkg" / "model.py", 200)
    _file(tmp_path / "pkg" / "cache" / "x.npy", 7000)
    _file(tmp_path / "pkg" / "__pycache__" / "model.pyc", 90)
    _file(tmp_path / "notes.tmp", 40)
    (tmp_path / ".gitignore").write_text("data/\n*.tmp\n")
    (tmp_path / "pkg" / ".rayignore").write_text("cache/\n")  # a nested ignore file, relative to its folder
    size = package_size(str(tmp_path), excludes=["logs"])
    assert size.complete
    assert size.by_entry == {"train.py": 1000, "pkg/": 200 + 7, ".gitignore": 12}  # ignore files are packed too
    assert size.total == 1219


def test_a_ray_session_folder_is_never_uploaded_whatever_the_ignore_files_say(tmp_path):
    _file(tmp_path / "train.py", 10)
    session = tmp_path / "raytmp" / "session_2026-12-06_04-18-55_608956_14701"
    _file(session / "logs" / "raylet.out", 40 << 20)
    (session / "sockets").mkdir()
    (tmp_path / "raytmp" / "session_latest").symlink_to(session)
    size = package_size(str(tmp_path))
    assert size.total == 10 and size.left_out == ["raytmp"]


def test_a_working_directory_past_the_limit_is_refused_at_once_naming_its_biggest_entries(tmp_path):
    _file(tmp_path / "train.py", 3000)
    _file(tmp_path / "dataset" / "shard-0.bin", 30 << 30)  # 48 GB of data beside the code, as a user had it
    _file(tmp_path / "dataset" / "shard-1.bin", 18 << 30)
    _file(tmp_path / ".venv" / "lib" / "torch.so", 900 << 20)
    started = time.monotonic()
    with pytest.raises(SyncError) as refused:
        check_working_dir(str(tmp_path))
    assert time.monotonic() - started < 10  # a walk, nothing zipped
    message = str(refused.value)
    assert f"Ray would upload the working directory {tmp_path} to every node" in message
    assert "holds 48.9 GiB after .gitignore, .rayignore and --ray-exclude (Ray's package limit is 512.0 MiB)" in message
    assert "the biggest: dataset/ 48.0 GiB, .venv/ 900.0 MiB, train.py 2.9 KiB" in message
    assert "--ray-exclude PATTERN or a .rayignore line" in message
    assert check_working_dir(str(tmp_path), excludes=["dataset/", ".venv"]).total == 3000


def test_a_walk_past_the_limit_stops_soon_and_says_the_size_is_at_least_what_it_counted(tmp_path):
    for i in range(50):
        _file(tmp_path / f"part-{i:02d}.bin", 100 << 20)
    ticks = iter(range(1000))
    size = package_size(str(tmp_path), limit=PACKAGE_LIMIT, clock=lambda: next(ticks))  # every look takes 1 s
    assert not size.complete and PACKAGE_LIMIT < size.total < 50 * (100 << 20)
