"""Disk faults degrade to misses: a full file system (a small real tmpfs), a read-only one and a
ledger that cannot be opened are counted refusals or one clear line -- never a raise into serving,
a traceback per block, or a chat that stops answering."""

import errno
import io
import logging
import subprocess
import sys
from contextlib import contextmanager

import pytest

from kvstrata.models.tiny import byte_tokenizer
from kvstrata.place.chat import chat
from kvstrata.place.disk import DiskTier
from kvstrata.place.memory import MemoryTier
from kvstrata.place.prefix_server import PrefixServer
from kvstrata.place.store import KVStore


@contextmanager
def small_fs(path, kib: int):
    """A real tmpfs of `kib` KiB at `path` (needs mount rights: root, or a user namespace)."""
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"cannot mount a test tmpfs (these tests need mount rights): {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_disk_is_a_counted_refusal_logged_once(tmp_path, caplog):
    with small_fs(tmp_path / "fs", 256) as root:
        tier = DiskTier(root, 1 << 30)  # the capacity is far above what the file system holds
        with caplog.at_level(logging.WARNING, logger="kvstrata.store"):
            results = [tier.put(f"b{i}", bytes([i]) * 40_000) for i in range(20)]
        assert results[0] and not all(results) and not any(results[results.index(False):])
        failed = results.count(False)
        assert tier.stats.refused == failed and tier.faults.counts() == {"write_ENOSPC": failed}
        assert len(caplog.records) == 1 and "write failure" in caplog.text  # once, with a count
        assert not list(root.glob(".kvstrata-tmp-*"))  # no half-written temp file left behind
        written = [f"b{i}" for i, ok in enumerate(results) if ok]
        assert all(tier.get(k) == bytes([int(k[1:])]) * 40_000 for k in written)
        tier.delete(written[0])  # space freed: writes work again, and the ledger agrees
        assert tier.put("again", b"x" * 40_000)
        reopened = DiskTier(root, 1 << 30)
        assert sorted(reopened.keys()) == sorted(written[1:] + ["again"])
        assert reopened.nbytes() == tier.nbytes()


def test_a_read_only_file_system_is_a_counted_refusal(tmp_path):
    with small_fs(tmp_path / "fs", 512) as root:
        tier = DiskTier(root, 1 << 30)
        assert tier.put("kept", b"v" * 1000)
        subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True)
        assert tier.put("new", b"w" * 1000) is False and tier.faults.counts() == {"write_EROFS": 1}
        assert tier.get("kept") == b"v" * 1000  # reads still serve
        tier.delete("kept")  # cannot: counted, not raised
        assert tier.faults.counts()["delete_EROFS"] == 1 and tier.get("kept") == b"v" * 1000


def test_reads_that_fail_are_counted_misses(tmp_path, monkeypatch):
    """EIO cannot be made on demand by a tmpfs: this one test injects it at the read."""
    tier = DiskTier(tmp_path, 1 << 20)
    tier.put("k", b"v" * 100)

    def eio(*_):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr("kvstrata.place.disk._read_exactly", eio)
    assert tier.get("k") is None and tier.faults.counts() == {"read_EIO": 1} and tier.stats.errors == 1


def test_chat_keeps_answering_on_a_full_disk(tiny_gemma, tmp_path):
    with small_fs(tmp_path / "fs", 64) as root:
        store = KVStore(DiskTier(root, 1 << 30), MemoryTier(1 << 24))
        server = PrefixServer(tiny_gemma, store, "bf16", block_size=8)
        turns = ["the first question is long enough to fill blocks " * 8, "a follow-up", "and a last"]
        log = chat(tiny_gemma, byte_tokenizer(), server, turns, max_new_tokens=3, out=io.StringIO())
        assert len(log) == 3 and store.global_tier.faults.counts().get("write_ENOSPC", 0) > 0


LEDGER_LINK = """
import sys
from kvstrata.cli import main
sys.exit(main(["store", "stats", "--config", sys.argv[1]]))
"""


def test_a_ledger_that_cannot_be_opened_is_one_line(tmp_path):
    root = tmp_path / "root"
    DiskTier(root, 1 << 20)
    (root / ".kvstrata-ledger").unlink()
    (root / ".kvstrata-ledger").symlink_to(tmp_path / "elsewhere")
    cfg = tmp_path / "s.toml"
    cfg.write_text(f"[store]\nroot = '{root}'\n")
    done = subprocess.run([sys.executable, "-c", LEDGER_LINK, str(cfg)], capture_output=True, text=True)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "capacity ledger" in done.stderr and "Exception ignored" not in done.stderr
    assert not (tmp_path / "elsewhere").exists()
