"""Resets must not leak: 2 workers reset 20 times in a row; after the 20th reset a worker
has no more threads, file descriptors or memory than after the 2nd (within small bounds)."""

from elastic_harness import run_job

RESETS = 20


def test_twenty_resets_leak_nothing(tmp_path):
    out = run_job("leak_worker.py", 2, str(tmp_path), args=["--resets", str(RESETS)],
                  timeout_s=90)
    why = out.describe()
    assert out.codes == {0: 0, 1: 0}, why
    assert any(line.startswith(f"epoch {RESETS + 1}: 2 ranks") for line in out.log), why
    for w in (0, 1):
        rounds = {r["round"]: r for r in out.records[w]}
        assert sorted(rounds) == list(range(RESETS + 1)), (w, sorted(rounds))
        early, late = rounds[2], rounds[RESETS]
        growth = {k: late[k] - early[k] for k in ("threads", "fds", "rss_kb")}
        assert growth["threads"] <= 0, (w, early, late)
        assert growth["fds"] <= 0, (w, early, late)
        assert growth["rss_kb"] < 4096, (w, early, late)  # < 4 MiB over 18 resets
