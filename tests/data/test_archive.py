"""Safe tar extraction: hostile members are refused before anything is written."""

from __future__ import annotations

import io
import os
import tarfile

import pytest

from ckptsdk.data.archive import safe_extract
from ckptsdk.errors import UnsafeArchiveError


def _tar(path, members) -> str:
    """members: (name, kind, payload_or_linkname) with kind in file/dir/sym/hard/fifo."""
    with tarfile.open(path, "w:gz") as tar:
        for name, kind, extra in members:
            info = tarfile.TarInfo(name)
            if kind == "file":
                info.size = len(extra)
                tar.addfile(info, io.BytesIO(extra))
                continue
            info.type = {
                "dir": tarfile.DIRTYPE,
                "sym": tarfile.SYMTYPE,
                "hard": tarfile.LNKTYPE,
                "fifo": tarfile.FIFOTYPE,
            }[kind]
            if kind in ("sym", "hard"):
                info.linkname = extra
            tar.addfile(info)
    return str(path)


def _snapshot(root) -> set[str]:
    return {os.path.join(d, f) for d, dirs, files in os.walk(root) for f in files + dirs}


@pytest.mark.parametrize(
    "members, culprit",
    [
        ([("ok.txt", "file", b"fine"), ("../evil.txt", "file", b"pwned")], "../evil.txt"),
        ([("ok.txt", "file", b"fine"), ("a/../../evil.txt", "file", b"pwned")], "a/../../evil.txt"),
        ([("/tmp/ckptsdk-evil-abs.txt", "file", b"pwned")], "/tmp/ckptsdk-evil-abs.txt"),
        ([("link", "sym", "../outside"), ("link/evil.txt", "file", b"pwned")], "link"),
        ([("passwd", "sym", "/etc/passwd")], "passwd"),
        ([("hard", "hard", "../../outside.txt")], "hard"),
        ([("pipe", "fifo", None)], "pipe"),
    ],
    ids=["dotdot", "nested-dotdot", "absolute", "symlink-dir-out", "symlink-abs", "hardlink-out", "fifo"],
)
def test_hostile_archives_are_refused_and_nothing_is_written(tmp_path, members, culprit):
    archive = _tar(tmp_path / "evil.tar.gz", members)
    target = tmp_path / "sandbox" / "target"
    target.mkdir(parents=True)
    before = _snapshot(tmp_path)
    with pytest.raises(UnsafeArchiveError) as info:
        safe_extract(archive, str(target))
    assert info.value.member == culprit
    assert _snapshot(tmp_path) == before  # not even the harmless members were extracted
    assert not os.path.exists("/tmp/ckptsdk-evil-abs.txt")


def test_a_benign_archive_with_an_inner_symlink_extracts(tmp_path):
    archive = _tar(
        tmp_path / "ok.tar.gz",
        [
            ("d", "dir", None),
            ("d/a.txt", "file", b"A"),
            ("d/link", "sym", "a.txt"),
        ],
    )
    names = safe_extract(archive, str(tmp_path / "out"))
    assert names == ["d", "d/a.txt", "d/link"]
    assert (tmp_path / "out" / "d" / "link").read_bytes() == b"A"
    assert safe_extract(archive, str(tmp_path / "out")) == names  # again, over the first copy
    assert sorted(os.listdir(tmp_path / "out")) == ["d"]  # no staging folder left behind
