"""Faults for real on the box: a host's cable pulled in the middle of an allreduce (under
spark-hvdrun, spark.run and run_elastic), a Spark Worker SIGKILLed during a
TorchEstimator fit, and a host whose link runs at a tenth of the others'.

Every test puts the box back as it found it (links up, caps off, the Worker started
again and its executor back), so the order of the tests does not matter. Times are
the machine's wall clock, which the hosts share.
"""

import glob
import http.server
import json
import os
import re
import subprocess
import sys
import threading
import time

import cloudpickle
import pytest

import box_fit
import rank_cut
import spark_hvd.spark
from _box_procs import cmdline
from _box_spark import wait_executors
from spark_hvd.exceptions import RankFailedError
from spark_hvd.runner import _elastic
from spark_hvd.spark import _driver
from test_box_hvdrun import hosts_arg

cloudpickle.register_pickle_by_value(sys.modules[__name__])

HERE = os.path.dirname(os.path.abspath(__file__))
DETECT_S = 10.0  # the bound: survivors raise within this at the default settings
WAIT_S = 120.0   # for things that take a few seconds on an idle machine


def wait_for(what: str, done, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while not (result := done()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(0.05)
    return result


def running(out_dir: str, n: int) -> dict:
    """{rank: host} once ``n`` ranks have marked ``running-<rank>@<host>``, else {}."""
    marks = [os.path.basename(p)[len("running-"):].split("@")
             for p in glob.glob(os.path.join(out_dir, "running-*"))]
    return {int(r): h for r, h in marks} if len(marks) >= n else {}


def failures(out_dir: str) -> dict:
    out = {}
    for path in glob.glob(os.path.join(out_dir, "failed-*.json")):
        with open(path) as f:
            record = json.load(f)
        out[record["rank"]] = record
    return out


@pytest.fixture
def unplug(box):
    """unplug(host) pulls ``host``'s cable and returns the time; every cable goes back in
    at the end of the test."""
    cut = []

    def pull(host):
        box.link(host, False)
        cut.append(host)
        return time.time()
    yield pull
    for host in cut:
        box.link(host, True)


# -- a host cut off under spark-hvdrun -----------------------------------------------

@pytest.fixture(scope="module")
def hvdrun_cut(box, tmp_path_factory):
    """8 ranks, 2 per host, allreducing 4 MiB in a loop; once every rank runs, host3's
    cable is pulled. What each rank raised, the cut's time and host3's ranks."""
    out = str(tmp_path_factory.mktemp("hvdrun_cut"))
    victim = box.names[2]
    n = 2 * len(box.hosts)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "spark_hvd.runner", "--network-interface", box.driver_addr,
         "-np", str(n), "-H", hosts_arg(box, 2), sys.executable,
         os.path.join(HERE, "rank_cut.py"), out], env=box.env(),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        where = wait_for("every rank allreducing", lambda: running(out, n))
        box.link(victim, False)
        t_cut = time.time()
        try:
            survivors = [r for r, h in where.items() if h != victim]
            got = wait_for("every survivor failing",
                           lambda: (f := failures(out)) and set(survivors) <= set(f) and f)
        finally:
            open(os.path.join(out, "release"), "w").close()
            box.link(victim, True)
        launcher.wait(WAIT_S)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    return {"t_cut": t_cut, "failed": got, "victim": victim,
            "victim_ranks": sorted(r for r, h in where.items() if h == victim),
            "survivors": sorted(survivors)}


def test_a_cut_host_fails_every_survivor_with_peer_lost_within_10_s(hvdrun_cut):
    """Every survivor raises PeerLostError within 10 s of the cut at the default settings,
    naming exactly the cut host's ranks. (Measured 8.1-8.3 s with the heartbeat ring;
    before it, 5.7-5.9 s, and in 2 cuts of 5 the survivors named only the first of the
    host's ranks past the timeout.)"""
    cut = hvdrun_cut
    for r in cut["survivors"]:
        f = cut["failed"][r]
        assert f["error"] == "PeerLostError", f
        assert f["time"] - cut["t_cut"] <= DETECT_S, (f"rank {r} raised "
                                                      f"{f['time'] - cut['t_cut']:.1f} s after "
                                                      f"the cut: {f}")
        assert f["ranks"] == cut["victim_ranks"], (f"{cut['victim']} ran ranks "
                                                   f"{cut['victim_ranks']}: {f}")


# -- a host cut off under spark.run and run_elastic ------------------------------------

def test_spark_run_fails_with_the_survivors_peer_lost_error(spark, box, unplug, tmp_path):
    """spark.run of 8 ranks (2 per host); a host's cable is pulled: the run raises
    RankFailedError whose root failure is a survivor's PeerLostError naming exactly the
    ranks of that host, within 17 s (the driver waits 2 s for the reports of ranks named lost).
    The cable goes back in and the executor of that host stays usable."""
    out, n, victim = str(tmp_path), 2 * len(box.hosts), box.names[2]
    outcome = {}

    def launch():
        try:
            spark_hvd.spark.run(rank_cut.allreduce_until_failure, args=(out,), num_proc=n,
                                verbose=0)
        except Exception as e:
            outcome.update(error=e, time=time.time())

    job = threading.Thread(target=launch, daemon=True)
    job.start()
    where = wait_for("every rank allreducing", lambda: running(out, n))
    t_cut = unplug(victim)
    job.join(WAIT_S)
    box.link(victim, True)
    assert not job.is_alive(), "spark.run did not end"
    victim_ranks = sorted(r for r, h in where.items() if h == victim)
    err = outcome.get("error")
    assert isinstance(err, RankFailedError), repr(err)
    text = str(err)
    m = re.search(r"PeerLostError: (?:control )?allreduce on rank (\d+) lost ranks? ([\d,]+)",
                  text)
    assert m, text
    named = [int(r) for r in m.group(2).split(",")]
    assert int(m.group(1)) not in victim_ranks and named == victim_ranks, (victim_ranks, text)
    assert err.cause == "collective", (err.cause, text)
    # the survivors' detection, then the driver's short wait for the reports of the ranks
    # they named lost (LOST_REPORT_S: the cut ones cannot report), with 5 s of room
    bound = DETECT_S + _driver.LOST_REPORT_S + 5
    assert outcome["time"] - t_cut <= bound, (outcome["time"] - t_cut, bound)
    wait_executors(spark, box, box.names)


def test_run_elastic_goes_on_without_a_cut_host(spark, box, unplug, tmp_path):
    """An elastic worker per host allreduces and commits each step; the cable of a host
    running one is pulled: the others form a new epoch without it and train 20 more
    steps. The cut worker's rendezvous connection stays open until TCP keepalive gives
    up (~25 s); the coordinator leaves it out sooner, once the survivors' requests name
    it lost and it has not asked for NAMED_LOST_GRACE_S, and the driver then waits
    LOST_REPORT_S, not kill grace + REPORT_WAIT_S, for its report (38 s after the cut
    before; 16 s at load 12)."""
    out, n = str(tmp_path), len(box.hosts)
    outcome = {}

    def launch():
        try:
            outcome["results"] = spark_hvd.spark.run_elastic(
                rank_cut.train_elastic, args=(out,), num_proc=n, min_num_proc=n // 2,
                start_timeout=WAIT_S, elastic_timeout=WAIT_S, verbose=1)
        except Exception as e:
            outcome["error"] = e

    job = threading.Thread(target=launch, daemon=True)
    job.start()
    where = wait_for("every worker training", lambda: running(out, n))
    victim = sorted(set(where.values()))[-1]
    left = n - list(where.values()).count(victim)
    t_cut = unplug(victim)
    job.join(2 * WAIT_S)
    took = time.time() - t_cut
    print(f"run_elastic returned {took:.1f} s after the cut")
    box.link(victim, True)
    assert not job.is_alive(), "run_elastic did not end with the host cut off"
    # detection, the grace, 20 steps of the new epoch, the lost worker's report wait
    bound = DETECT_S + _elastic.NAMED_LOST_GRACE_S + _driver.LOST_REPORT_S + 10
    assert took <= bound, (took, bound)
    assert "error" not in outcome, repr(outcome.get("error"))
    results = outcome["results"]
    assert sorted(r["rank"] for r in results) == list(range(left)), results
    assert all(r["size"] == left and r["host"] != victim for r in results), results
    assert all(r["resets"][0][1] == n and r["resets"][-1][1] == left for r in results)
    wait_executors(spark, box, box.names)


# -- a Spark Worker SIGKILLed during a fit ----------------------------------------------

def test_a_fit_restarts_from_its_checkpoint_when_a_worker_is_killed(spark, box, digits,
                                                                    reference_fit, tmp_path):
    """A 2-rank fit with max_restarts=1 (on the undisturbed fit's data): after epoch 0
    (rank 0 has checkpointed it) every rank waits; the test SIGKILLs the Worker of a host
    running ranks, whose executor and ranks die with it, and lets the others go on. They
    lose their peers, the fit launches again on the remaining hosts from epoch 1, and the
    model's accuracy on the held-out digits is the undisturbed fit's within 0.02."""
    train, _ = digits
    marks = tmp_path / "marks"
    marks.mkdir()
    est = box_fit.estimator(reference_fit["store"], str(marks), num_proc=box_fit.RANKS,
                            pause_after=0,
                            max_restarts=1, run_id="killed_worker")
    outcome = {}

    def fit():
        try:
            outcome["model"] = est.fit(train)
        except Exception as e:
            outcome["error"] = e

    job = threading.Thread(target=fit, daemon=True)
    job.start()
    try:
        wait_for("every rank paused after epoch 0",
                 lambda: len(glob.glob(str(marks / "paused-*"))) == box_fit.RANKS, 2 * WAIT_S)
        first = box_fit.launches(str(marks))[0]
        victim = sorted(first.values())[-1]
        box.services.kill_worker(victim)
        wait_for(f"the ranks on {victim} gone with its Worker",
                 lambda: not [p for p in box.pids(victim) if "_child" in cmdline(p)], WAIT_S)
    finally:
        (marks / "go").touch()
    job.join(4 * WAIT_S)
    box.services.start_worker(victim)
    wait_executors(spark, box, box.names)
    assert not job.is_alive(), "the fit did not end"
    assert "error" not in outcome, repr(outcome.get("error"))
    runs = box_fit.launches(str(marks))
    assert sorted(runs) == [0, 1], runs  # a second launch, resumed at epoch 1
    assert sorted(runs[1]) == list(range(box_fit.RANKS)), runs
    assert victim not in runs[1].values(), runs
    accuracy = box_fit.local_accuracy(outcome["model"])
    assert abs(accuracy - reference_fit["accuracy"]) <= 0.02, (accuracy, reference_fit)


# -- a slow host --------------------------------------------------------------------------

class _Payload(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


FETCH_THEN_ALLREDUCE = """
import sys, urllib.request
import numpy as np
import spark_hvd as hvd
hvd.init()
data = urllib.request.urlopen(sys.argv[1], timeout=300).read()
hvd.allreduce(np.array([float(len(data))]), op=hvd.Sum, name="after_the_data")
hvd.shutdown()
"""


def test_a_host_at_a_tenth_of_the_bandwidth_is_named_by_the_stall_warning(box):
    """Every rank reads 5 MB from a server beside the driver before its allreduce; the
    hosts' links run at 100 Mbit/s, the last host's at 10: its 2 ranks submit ~7 s after
    the others (which take ~1 s), and the stall warning at 3 s names exactly them."""
    _Payload.body = b"\0" * 5_000_000
    server = http.server.ThreadingHTTPServer((box.driver_addr, 0), _Payload)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    slow = box.names[-1]
    for h in box.names:
        box.cap(h, "10mbit" if h == slow else "100mbit")
    try:
        n = 2 * len(box.hosts)
        proc = subprocess.run(
            [sys.executable, "-m", "spark_hvd.runner", "--network-interface", box.driver_addr,
             "-np", str(n), "-H", hosts_arg(box, 2), sys.executable, "-c",
             FETCH_THEN_ALLREDUCE, f"http://{box.driver_addr}:{server.server_port}/"],
            env=box.env(dict(os.environ, SPARK_HVD_STALL_CHECK_TIME_S="3")),
            capture_output=True, text=True, timeout=WAIT_S)
    finally:
        server.shutdown()
        for h in box.names:
            box.cap(h, None)
    assert proc.returncode == 0, proc.stderr
    warnings = re.findall(r"tensor 'after_the_data'.* but not yet by ranks \[([^\]]*)\]",
                          proc.stdout + proc.stderr)
    assert warnings, proc.stderr
    slow_ranks = [r for r in range(n) if r // 2 == box.names.index(slow)]
    assert [sorted(int(r) for r in w.split(",")) for w in warnings] == [slow_ranks], warnings
