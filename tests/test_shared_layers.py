"""The real nodes' unpacked image layers held once on the machine (``nodes/sharedlayers.py``), checked
here on directories and ``ctr`` output, without containerd."""
from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

from clusters.embedded.nodes import sharedlayers

LISTING = """\
KEY                                                                     PARENT                                                                  KIND
sha256:aaa                                                                                                                                      Committed
sha256:bbb                                                              sha256:aaa                                                              Committed
3f1c0e                                                                  sha256:bbb                                                              Active
sha256:ccc                                                                                                                                      Committed
"""


def test_the_committed_snapshots_are_read_with_their_parents_and_the_active_ones_left_out() -> None:
    assert sharedlayers.committed_chains(LISTING) == {"sha256:aaa": "", "sha256:bbb": "sha256:aaa",
                                                      "sha256:ccc": ""}


def test_a_views_directories_come_top_first_from_an_overlay_or_alone_from_a_bind_mount() -> None:
    overlay = [{"Type": "overlay", "Source": "overlay",
                "Options": ["index=off", "lowerdir=/var/lib/s/7/fs:/var/lib/s/3/fs"]}]
    assert sharedlayers.lower_directories(overlay) == ["/var/lib/s/7/fs", "/var/lib/s/3/fs"]
    bind = [{"Type": "bind", "Source": "/var/lib/s/3/fs", "Options": ["ro", "rbind"]}]
    assert sharedlayers.lower_directories(bind) == ["/var/lib/s/3/fs"]


def test_the_directories_mounts_are_made_of_include_overlay_layers_and_bound_directories() -> None:
    mountinfo = (
        "25 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
        "90 25 0:51 / /run/c/rootfs rw,relatime - overlay overlay "
        "rw,lowerdir=/var/lib/s/7/fs:/var/lib/s/3/fs,upperdir=/var/lib/s/9/fs,workdir=/var/lib/s/9/work\n"
        "91 25 0:52 / /run/d/rootfs rw - overlay overlay rw,lowerdir+=/var/lib/s/5/fs,datadir+=/var/lib/s/6/fs\n"
        "92 25 254:0 /work/x/var-lib/s/4/fs /run/e/rootfs ro,relatime - ext4 /dev/vda rw\n"
    )
    assert sharedlayers.mounted_directories(mountinfo) == {
        "/var/lib/s/7/fs", "/var/lib/s/3/fs", "/var/lib/s/9/fs", "/var/lib/s/5/fs", "/var/lib/s/6/fs",
        "/run/e/rootfs"}


def _tree(root: Path, files: dict[str, bytes], mtime_ns: int = 1_600_000_000 * 10**9) -> None:
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        os.utime(path, ns=(mtime_ns, mtime_ns))


def test_a_later_nodes_files_become_links_to_the_first_nodes_and_read_the_same(tmp_path: Path) -> None:
    files = {"usr/bin/ray": b"#!/usr/bin/python3\n" * 300, "etc/os-release": b"bookworm\n", "empty": b""}
    first, later = tmp_path / "n1", tmp_path / "n2"
    _tree(first, files)
    _tree(later, files)
    os.symlink("ray", later / "usr/bin/ray2")
    os.symlink("ray", first / "usr/bin/ray2")

    done = sharedlayers.link_identical_files(first, later)

    assert (done.files, done.differing) == (3, 0)
    assert done.bytes >= len(files["usr/bin/ray"])
    for name, data in files.items():
        assert os.path.samefile(first / name, later / name)
        assert (later / name).read_bytes() == data
    assert os.readlink(later / "usr/bin/ray2") == "ray"  # a symbolic link stays one
    assert sorted(p.name for p in (later / "usr/bin").iterdir()) == ["ray", "ray2"]  # nothing staged is left
    again = sharedlayers.link_identical_files(first, later)
    assert (again.files, again.bytes) == (0, 0)  # a second run finds them shared


def test_a_file_that_differs_in_size_time_or_mode_or_is_missing_on_the_first_node_is_kept(tmp_path: Path) -> None:
    first, later = tmp_path / "n1", tmp_path / "n2"
    _tree(first, {"size": b"12345", "time": b"same", "mode": b"same"})
    _tree(later, {"size": b"1234", "mode": b"same", "only-here": b"x"})
    _tree(later, {"time": b"same"}, mtime_ns=1_700_000_000 * 10**9)
    os.chmod(later / "mode", 0o600)

    done = sharedlayers.link_identical_files(first, later)

    assert (done.files, done.differing) == (0, 4)
    for name in ("size", "time", "mode", "only-here"):
        assert os.stat(later / name).st_nlink == 1
    assert (later / "size").read_bytes() == b"1234"


def test_sharing_one_nodes_pull_links_that_node_alone_to_the_first_copy(tmp_path: Path, monkeypatch) -> None:
    """At ``up``, after node 2 pulled: node 1 holds the first copy, node 2's files become links to it,
    and node 3's (pulled already, say) are left for its own turn."""
    files = {"usr/bin/ray": b"ray" * 100}
    stores = {}
    for name in ("n1", "n2", "n3"):
        _tree(tmp_path / name / "sha256:aaa", files)
        stores[name] = {"sha256:aaa": tmp_path / name / "sha256:aaa"}
    monkeypatch.setattr(sharedlayers, "snapshot_directories", lambda node, pid: stores[node.name])
    monkeypatch.setattr(sharedlayers, "_in_use", lambda pid: set())
    nodes = [SimpleNamespace(name=name) for name in ("n1", "n2", "n3")]
    pids = {"n1": 1, "n2": 2, "n3": 3}

    done = sharedlayers.share(nodes, pids, only="n2")

    assert (done.snapshots, done.files) == (1, 1)
    ray = Path("sha256:aaa/usr/bin/ray")
    assert os.path.samefile(tmp_path / "n1" / ray, tmp_path / "n2" / ray)
    assert not os.path.samefile(tmp_path / "n1" / ray, tmp_path / "n3" / ray)
    assert sharedlayers.share(nodes, pids).files == 1  # every later node: n3's turn, n2's already shared
    assert os.path.samefile(tmp_path / "n1" / ray, tmp_path / "n3" / ray)
