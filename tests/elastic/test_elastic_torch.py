"""TorchState + ElasticSampler in a real elastic job: 3 workers, one is SIGKILLed mid-epoch,
the other two roll back to the last commit, re-form at 2 and finish the training; and 2
workers that take in a third mid-epoch."""

import signal

from elastic_harness import records_of, run_job

SAMPLES, BATCH, EPOCHS, KILL_EPOCH, KILL_BATCH = 96, 4, 3, 1, 3


def assert_each_sample_once(out):
    """Every sample of every epoch went into the committed model exactly once: what each
    worker trained and committed (a lost worker's committed batches included)."""
    per_epoch = {e: [] for e in range(EPOCHS + 1)}  # the last: the final commit's, empty
    for records in out.records.values():
        for r in records:
            if r["kind"] == "commit":
                per_epoch[r["epoch"]].extend(r["indices"])
    assert per_epoch.pop(EPOCHS) == []
    for epoch, indices in per_epoch.items():
        assert sorted(indices) == list(range(SAMPLES)), (epoch, sorted(indices))


def test_torch_state_survives_a_lost_worker(tmp_path):
    out = run_job("torch_worker.py", 3, str(tmp_path), min_np=2, max_np=3, timeout_s=90,
                  args=["--samples", str(SAMPLES), "--batch-size", str(BATCH),
                        "--epochs", str(EPOCHS), "--kill-epoch", str(KILL_EPOCH),
                        "--kill-batch", str(KILL_BATCH), "--kill-rank", "1", "--kill-size", "3"])
    why = out.describe()
    assert out.killed is not None, why
    survivors = sorted(w for w in out.codes if w != out.killed)
    assert out.codes[out.killed] == -signal.SIGKILL, why
    assert all(out.codes[w] == 0 for w in survivors), why
    assert sorted(out.results) == survivors, why
    assert any(line.startswith("epoch 2: 2 ranks") for line in out.log), why

    # The survivors end as the 2 ranks of one job, with the same parameters.
    final = [out.results[w] for w in survivors]
    assert sorted(r["rank"] for r in final) == [0, 1] and {r["size"] for r in final} == {2}, why
    assert final[0]["params"] == final[1]["params"], why
    assert final[0]["step"] == final[1]["step"], why

    # Each survivor reset once, into the 2-rank epoch, and went on from the last commit:
    # its first step after the reset follows the last step every rank committed.
    for w in survivors:
        records = out.records[w]
        resets = [r for r in records if r["kind"] == "reset"]
        assert [r["size"] for r in resets] == [2], (w, resets, why)
        before = [r for r in records[:records.index(resets[0])] if r["kind"] == "commit"]
        after = [r for r in records[records.index(resets[0]):] if r["kind"] == "commit"]
        assert resets[0]["step"] == before[-1]["step"] > 0, (w, resets, before[-1])
        assert after[0]["step"] == before[-1]["step"] + 1, (w, before[-1], after[0])
        # Training goes on from where it was: the loss right after the reset is near the
        # last committed one (not back at the start), and ends well below both.
        start = next(r for r in records if r["kind"] == "start")
        assert after[0]["loss"] < 0.5 * before[0]["loss"], (before[0], after[0])
        assert after[0]["loss"] <= 1.5 * before[-1]["loss"], (before[-1], after[0])
        assert out.results[w]["loss"] < 0.5 * after[0]["loss"], (after[0], out.results[w])
        assert start["size"] == 3

    assert_each_sample_once(out)
    # The lost worker had committed part of the epoch it died in.
    lost_part = [i for r in out.records[out.killed] if r["kind"] == "commit"
                 and r["epoch"] == KILL_EPOCH for i in r["indices"]]
    assert len(lost_part) == KILL_BATCH * BATCH, lost_part


def test_torch_state_takes_in_a_joining_worker(tmp_path):
    """2 workers train; a third starts once they have, and asks to join: at their next
    commit (at the latest after step ``wait``, where they wait for it) the job re-forms with
    all three, which finish together."""
    batch = 3  # a step of 2 ranks takes 6 samples: what is left of an epoch splits in 3
    wait = SAMPLES // (2 * batch) + 4  # epoch 1, batch 4
    out = run_job("torch_worker.py", 2, str(tmp_path), min_np=2, max_np=3, late=1,
                  start_late=lambda: bool(records_of(str(tmp_path), 0)), timeout_s=90,
                  args=["--samples", str(SAMPLES), "--batch-size", str(batch), "--epochs",
                        str(EPOCHS), "--kill-size", "0", "--grow-at-step", str(wait)])
    why = out.describe()
    assert out.codes == {0: 0, 1: 0, 2: 0}, why
    assert any(line.startswith("epoch 2: 3 ranks (workers 0, 1, 2)") for line in out.log), why
    final = [out.results[w] for w in range(3)]
    assert [r["rank"] for r in final] == [0, 1, 2] and {r["size"] for r in final} == {3}, why
    assert final[0]["params"] == final[1]["params"] == final[2]["params"], why
    # The old ranks kept their state (no failure, nothing to restore) and reset once; the
    # new worker starts from it: its first step is the one after the interrupting commit
    # (its first commit may be an epoch's end, when the interrupt came at its last batch).
    resets = {w: [(r["size"], r["step"]) for r in out.records[w] if r["kind"] == "reset"]
              for w in (0, 1)}
    grown_at = resets[0][0][1]
    assert resets == {0: [(3, grown_at)], 1: [(3, grown_at)]} and 0 < grown_at <= wait, resets
    joined = [r for r in out.records[2] if r["kind"] == "commit" and r["indices"]]
    assert joined[0]["step"] == grown_at + 1 and joined[0]["size"] == 3, joined[0]
    assert_each_sample_once(out)
