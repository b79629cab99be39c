"""The disk tier touches only what it created: store-root marker, junk entries, writer-identified
temp files, sizes checked before reading, one capacity across processes, a read-only root."""

import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import time

import pytest

from kvstrata.cli import main
from kvstrata.place.disk import DiskTier
from kvstrata.place.disk_root import MARKER, OWN_FILES, TEMP_MAX_AGE_S, StoreRootError, new_temp


def test_a_directory_that_is_not_a_store_is_refused_and_untouched(tmp_path):
    (tmp_path / "notes.kv").write_bytes(b"mine")
    (tmp_path / ".tmp-x").write_bytes(b"mine too")
    with pytest.raises(StoreRootError, match=f"not empty and has no {MARKER}"):
        DiskTier(tmp_path, 1 << 20)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-x", "notes.kv"]
    DiskTier(tmp_path / "new" / "deep", 1 << 20)  # a new or empty directory becomes a store
    assert (tmp_path / "new" / "deep" / MARKER).is_file()
    with pytest.raises(StoreRootError, match="not a directory"):
        DiskTier(tmp_path / "notes.kv", 1 << 20)


@pytest.mark.parametrize("action", ["stats", "verify", "gc"])
def test_root_empty_string_cannot_reach_the_current_directory(tmp_path, monkeypatch, capsys, action):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.kv").write_bytes(b"mine")
    (tmp_path / ".tmp-x").write_bytes(b"mine too")
    cfg = tmp_path / "s.toml"
    cfg.write_text("[store]\nroot = \"\"\n")
    assert main(["store", action, "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "the current directory" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-x", "notes.kv", "s.toml"]


def junk(root):
    """Every kind of entry the tier did not create, each under a name it might look at."""
    (root / "dir.kv").mkdir()
    os.symlink(root / "dir.kv", root / "linkdir.kv")
    os.symlink(root / "nowhere", root / "dangling.kv")
    os.mkfifo(root / "fifo.kv")
    (root / "my notes.kv").write_bytes(b"not a key")
    (root / "README").write_text("hello")
    (root / "zeros.kv").write_bytes(b"\0" * 12)  # a key name, but no entry header
    with open(root / "huge.kv", "wb") as f:  # 8 GB, sparse: must never be read whole
        f.truncate(8 << 30)
    return {p.name for p in root.iterdir()} - set(OWN_FILES)


def test_junk_entries_are_skipped_reported_and_never_followed_read_or_deleted(tmp_path):
    DiskTier(tmp_path, 1 << 20).put("real", b"value")
    names = junk(tmp_path)
    d = DiskTier(tmp_path, 1 << 20)  # open does not abort on any of them
    assert d.keys() == ["real"] and d.get("real") == b"value"
    assert set(d.describe()["skipped"]) == names - {"real.kv"}
    for key in ("dir", "linkdir", "dangling", "fifo", "zeros", "huge"):
        assert d.get(key) is None  # a miss; the FIFO does not block, the 8 GB file is not read
        assert d.put(key, b"mine now") is False  # never overwritten
        d.delete(key)  # never deleted
    assert d.stats.skipped == 18 and d.stats.corrupt == 0  # get, put and delete of 6 junk names
    assert {p.name for p in tmp_path.iterdir()} - set(OWN_FILES) == names
    assert (tmp_path / "huge.kv").stat().st_size == 8 << 30 and (
        tmp_path / "zeros.kv"
    ).read_bytes() == b"\0" * 12
    assert d.nbytes() == (tmp_path / "real.kv").stat().st_size  # junk holds none of the capacity


@pytest.mark.parametrize("action", ["stats", "verify", "gc"])
def test_store_commands_report_junk_and_leave_it(tmp_path, capsys, action):
    cfg = tmp_path / "s.toml"
    cfg.write_text(f"[store]\nroot = '{tmp_path / 'kv'}'\n")
    assert main(["store", "stats", "--config", str(cfg)]) == 0
    names = junk(tmp_path / "kv")
    capsys.readouterr()
    assert main(["store", action, "--config", str(cfg)]) == 0
    out = json.loads(capsys.readouterr().out)
    skipped = out["global"]["skipped"] if action == "stats" else out["skipped"]
    assert set(skipped) == names and skipped["fifo.kv"] == "not a regular file"
    assert {p.name for p in (tmp_path / "kv").iterdir()} >= names


def test_sizes_are_checked_against_the_header_before_reading(tmp_path):
    d = DiskTier(tmp_path, 1 << 20)
    d.put("short", b"x" * 100)
    path = tmp_path / "short.kv"
    path.write_bytes(path.read_bytes()[:-1])  # ours, cut: counted corrupt, removed
    assert d.get("short") is None and d.stats.corrupt == 1 and not path.exists()
    d.put("liar", b"x")
    with open(tmp_path / "liar.kv", "wb") as f:  # ours, rewritten: a header claiming 8 GB, sparse 8 GB
        f.write(b"KVSD" + struct.pack("<HHdQ", 1, 0, 0.0, 8 << 30))
        f.truncate(24 + (8 << 30))
    assert d.get("liar") is None and d.stats.corrupt == 2 and not (tmp_path / "liar.kv").exists()


@pytest.mark.parametrize("magic", [b"KVSD", b"KVSR"])
def test_a_foreign_file_with_our_magic_is_left_alone(tmp_path, magic):
    """Ownership is the ledger's word alone: a `<hex>.kv` file the store did not write is never read
    as a record, replaced or deleted, whatever bytes it starts with (whole header or not)."""
    d = DiskTier(tmp_path, 1 << 20)
    d.put("mine", b"value")
    whole = (tmp_path / "mine.kv").read_bytes()
    foreign = {"ab12.kv": magic + b"\0" * 40, "cd34.kv": magic + whole[4:]}  # damaged-looking, and whole
    for name, data in foreign.items():
        (tmp_path / name).write_bytes(data)
    for d in (d, DiskTier(tmp_path, 1 << 20)):  # this process, and a new one reconciling the root
        for name in foreign:
            key = name[:-3]
            assert d.get(key) is None and d.put(key, b"other") is False
            d.delete(key)
        assert d.stats.corrupt == 0 and sorted(d.keys()) == ["mine"] and d.get("mine") == b"value"
        assert all((tmp_path / n).read_bytes() == data for n, data in foreign.items())
        assert set(d.describe()["skipped"]) == set(foreign)
    assert main(["store", "gc", "--config", _cfg(tmp_path)]) == 0
    assert all((tmp_path / n).read_bytes() == data for n, data in foreign.items())


def _cfg(root) -> str:
    cfg = root.parent / f"{root.name}.toml"
    cfg.write_text(f"[store]\nroot = '{root}'\nretention_hours = 0\n")
    return str(cfg)


def test_a_root_from_before_the_ledger_keeps_its_whole_entries(tmp_path):
    d = DiskTier(tmp_path, 1 << 20)
    d.put("old", b"value")
    d.ledger.close()
    (tmp_path / ".kvstrata-owned").unlink()  # as a store written by an earlier build left it
    (tmp_path / "cut.kv").write_bytes(b"KVSD" + b"\0" * 10)  # not whole: not adopted, not deleted
    again = DiskTier(tmp_path, 1 << 20)
    assert again.keys() == ["old"] and again.get("old") == b"value" and (tmp_path / "cut.kv").exists()


def test_temp_files_are_reaped_only_when_their_writer_is_gone_or_they_are_old(tmp_path):
    DiskTier(tmp_path, 1 << 20)
    fd, live = new_temp(tmp_path)  # this process is alive: an in-flight write
    os.close(fd)
    dead_pid = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    ).stdout.strip()
    dead = live.replace(f"-tmp-{os.getpid()}-", f"-tmp-{dead_pid}-")
    old = re.sub(r"-[0-9a-f]{12}-", "-000000000000-", live, count=1)  # this live writer, but an hour old
    for p in (dead, old):
        open(p, "wb").close()
    os.utime(old, (time.time() - TEMP_MAX_AGE_S - 60,) * 2)
    (tmp_path / ".tmp-x").write_bytes(b"someone else's")
    DiskTier(tmp_path, 1 << 20)
    assert os.path.exists(live) and not os.path.exists(dead) and not os.path.exists(old)
    assert (tmp_path / ".tmp-x").read_bytes() == b"someone else's"


CHURN = """
import sys
from kvstrata.place.disk import DiskTier
d = DiskTier(sys.argv[1], 1 << 30)
ok = [d.put(f"k{i % 7}", bytes([i % 256]) * 65536) for i in range(int(sys.argv[2]))]
print(sum(ok))
"""

OPENS = """
import sys
from kvstrata.place.disk import DiskTier
for _ in range(int(sys.argv[2])):
    DiskTier(sys.argv[1], 1 << 30).nbytes()
"""


def test_a_writers_in_flight_temp_files_survive_concurrent_opens(tmp_path):
    DiskTier(tmp_path, 1 << 30)
    writer = subprocess.Popen(
        [sys.executable, "-c", CHURN, str(tmp_path), "300"], stdout=subprocess.PIPE, text=True
    )
    openers = [subprocess.Popen([sys.executable, "-c", OPENS, str(tmp_path), "60"]) for _ in range(2)]
    opened_here = 0
    while writer.poll() is None and opened_here < 200:  # bounded: at most 200 opens in this process
        DiskTier(tmp_path, 1 << 30)
        opened_here += 1
    out, _ = writer.communicate(timeout=300)
    assert writer.returncode == 0 and out.strip() == "300"  # every put landed: no temp file pulled away
    assert all(p.wait(timeout=300) == 0 for p in openers)
    assert not list(tmp_path.glob(".kvstrata-tmp-*"))


FILL = """
import sys
from kvstrata.place.disk import DiskTier
d = DiskTier(sys.argv[1], 5 << 20)
print(sum(d.put(f"{sys.argv[2]}{i}", b"x" * (1 << 20)) for i in range(8)))
"""


def test_two_processes_share_one_capacity(tmp_path):
    DiskTier(tmp_path, 5 << 20)
    procs = [
        subprocess.Popen([sys.executable, "-c", FILL, str(tmp_path), tag], stdout=subprocess.PIPE, text=True)
        for tag in ("a", "b")
    ]
    accepted = sum(int(p.communicate(timeout=300)[0]) for p in procs)
    on_disk = sum(p.stat().st_size for p in tmp_path.glob("*.kv"))
    assert accepted == 4 and on_disk <= 5 << 20  # 8 MiB offered by two writers into a 5 MiB tier
    assert DiskTier(tmp_path, 5 << 20).nbytes() == on_disk


READ_ONLY = """
import os, sys
from kvstrata.place.disk import DiskTier
if os.geteuid() == 0:  # root writes through mode bits: drop to nobody (after the imports it cannot reach)
    os.setgid(65534)
    os.setuid(65534)
try:
    DiskTier(sys.argv[1], 1 << 20)
except ValueError as e:
    print(e)
"""


def test_a_read_only_root_is_a_clear_error_at_open():
    root = tempfile.mkdtemp(prefix="kvstrata-ro-")
    try:
        os.chmod(root, 0o755)
        DiskTier(root, 1 << 20)
        os.chmod(root, 0o555)
        out = subprocess.run(
            [sys.executable, "-c", READ_ONLY, root], capture_output=True, text=True, timeout=120
        )
        assert "is not writable" in out.stdout, out.stderr[-2000:]
    finally:
        os.chmod(root, 0o755)
        for p in os.listdir(root):
            os.unlink(os.path.join(root, p))
        os.rmdir(root)
