"""The core's include graph keeps its rooms: dependencies point down, and no backend
includes another backend's files.

Floors, lowest first: common/ (types, status, settings) <- rendezvous/ (the Store) <-
net/ (sockets, the authenticated hello, connection set-up, liveness: what tcp, shm and
the engine share) <- backends/ (the interfaces at its top, cuda/ shared by the GPU
backends, one folder per backend) <- engine/ <- capi/, python/. A backend folder
includes its own files, the interfaces and registry at backends/'s top, the floors below,
and cuda/ when it runs on GPUs; never another backend's folder (shared code gets a room
of its own, as net/ and cuda/ are)."""

import re
from pathlib import Path

CSRC = Path(__file__).resolve().parents[2] / "csrc"
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
# What each floor may include, by the first folder of the included path.
FLOORS = {
    "common": {"common"},
    "rendezvous": {"common", "rendezvous"},
    "net": {"common", "rendezvous", "net"},
    "backends": {"common", "rendezvous", "net", "backends"},
    "engine": {"common", "rendezvous", "net", "backends", "engine"},
    "capi": {"common", "rendezvous", "net", "backends", "engine", "capi"},
    "python": {"common", "rendezvous", "net", "backends", "engine", "capi", "python"},
}
GPU_BACKENDS = {"nccl", "staged"}
SHARED_ROOMS = {"cuda"}  # folders under backends/ that are not backends


def _includes():
    for path in sorted(CSRC.rglob("*")):
        if path.suffix not in (".h", ".cc", ".in") or not path.is_file():
            continue
        rel = path.relative_to(CSRC)
        for inc in INCLUDE.findall(path.read_text(errors="replace")):
            if "/" in inc:
                yield rel, inc


def test_every_include_points_down_the_floors():
    bad = []
    for rel, inc in _includes():
        floor, target = rel.parts[0], inc.split("/")[0]
        if floor not in FLOORS:
            bad.append(f"{rel}: its folder {floor}/ is in no floor of this test")
        elif target in FLOORS and target not in FLOORS[floor]:
            bad.append(f"{rel} includes {inc}: {floor}/ may not include {target}/")
    assert not bad, "\n".join(bad)


def test_no_backend_includes_another_backends_files():
    bad = []
    for rel, inc in _includes():
        if rel.parts[0] != "backends" or len(rel.parts) < 3:
            continue
        mine = rel.parts[1]
        parts = inc.split("/")
        if parts[0] != "backends" or len(parts) < 3 or parts[1] == mine:
            continue
        if parts[1] in SHARED_ROOMS and (mine in GPU_BACKENDS or mine in SHARED_ROOMS):
            continue
        bad.append(f"{rel} includes {inc}: backend {mine} reaches into {parts[1]}/")
    assert not bad, "\n".join(bad)


def test_the_checker_sees_a_crossing(tmp_path, monkeypatch):
    """The scan finds an include of another backend's file and an upward include."""
    root = tmp_path / "csrc"
    (root / "backends" / "shm").mkdir(parents=True)
    (root / "net").mkdir()
    (root / "backends" / "shm" / "x.cc").write_text('#include "backends/tcp/hello.h"\n')
    (root / "net" / "y.cc").write_text('#include "engine/engine.h"\n')
    monkeypatch.setattr(__import__(__name__), "CSRC", root)
    found = {(str(rel), inc) for rel, inc in _includes()}
    assert found == {("backends/shm/x.cc", "backends/tcp/hello.h"),
                     ("net/y.cc", "engine/engine.h")}
    try:
        test_no_backend_includes_another_backends_files()
    except AssertionError as e:
        assert "reaches into tcp/" in str(e)
    else:
        raise AssertionError("the crossing went unseen")
    try:
        test_every_include_points_down_the_floors()
    except AssertionError as e:
        assert "net/ may not include engine/" in str(e)
    else:
        raise AssertionError("the upward include went unseen")
