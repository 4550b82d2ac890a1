"""KerasState and the elastic callbacks in a real elastic job: 2 workers fit a model, one is
SIGKILLed, the other rolls back to its last commit and finishes alone (min 1)."""

import signal

from elastic_harness import run_job


def test_keras_state_survives_a_lost_worker(tmp_path):
    out = run_job("keras_worker.py", 2, str(tmp_path), min_np=1, max_np=2, timeout_s=120)
    why = out.describe()
    assert out.killed == 1, why
    assert out.codes == {0: 0, 1: -signal.SIGKILL}, why
    assert any(line.startswith("epoch 2: 1 ranks") for line in out.log), why
    result = out.results[0]
    assert (result["rank"], result["size"], result["epoch"]) == (0, 1, 3), why

    # The survivor came back to its last commit: the weights (and optimizer step) it
    # recorded there are the ones it had after the reset.
    records = out.records[0]
    reset = next(i for i, r in enumerate(records) if r["kind"] == "reset")
    last = records[reset - 1]
    assert last["kind"] == "commit" and last["size"] == 2 and last["epoch"] == 1, last
    assert records[reset]["size"] == 1, records[reset]
    assert records[reset]["weights"] == last["weights"], (last, records[reset])
    assert records[reset]["epoch"] == 1  # fit resumed at the interrupted epoch
    steps_at_2 = [r["weights"][-1] for r in records[:reset] if r["kind"] == "commit"]
    assert steps_at_2 == list(range(1, len(steps_at_2) + 1)), steps_at_2
    # Epoch 1 again (8 batches at 1 rank), then epoch 2: the optimizer counts on.
    after = [r for r in records[reset + 1:] if r["kind"] == "commit"]
    assert [r["weights"][-1] for r in after] == list(range(last["weights"][-1] + 1,
                                                           last["weights"][-1] + 17)), after
    assert result["loss"] < 0.5 * 1.0 and result["weights"] == after[-1]["weights"]

    assert result["tf_state"] == [[[1.0, 2.0], 3], [7.0, 8.0], 5], result
    assert result["graph_failure"] == ["PeerLostError", "rank 3 lost"], result
