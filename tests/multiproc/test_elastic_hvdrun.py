"""spark-hvdrun's elastic mode end to end: workers as real processes training a numpy
ObjectState with hvd.elastic.run, hosts from a discovery script."""

import io
import json
import re
import signal
import socket
import subprocess
import sys

import pytest

import test_hosts

from spark_hvd.exceptions import InvalidArgumentError
from spark_hvd.runner import launch as launch_mod
from spark_hvd.runner._elastic_launch import ElasticOptions

from _ranks import wait_gone
from test_hosts import sshd  # noqa: F401 - a fixture (this module gets its own sshd)
from test_hvdrun import ENV, TIMEOUT_S, script

# Every worker trains STEPS steps (and on, with T_GROW_TO, until the job has that many
# ranks), committing every 5; each step adds the allreduced sum of rank+1 to the total.
TRAIN = """
import json, os, signal, time
import numpy as np
import spark_hvd as hvd
import spark_hvd.elastic

STEPS = int(os.environ["T_STEPS"])
GROW_TO = int(os.environ.get("T_GROW_TO", "0"))  # at step 5 rank 0 sets the hosts file to
GROW_HOSTS = os.environ.get("T_GROW_HOSTS", f"localhost:{GROW_TO}")  # these, trains to GROW_TO
KILL_AT = int(os.environ.get("T_KILL_AT", "0"))  # rank 1 SIGKILLs itself at this step, once
SHRINK_HOSTS = os.environ.get("T_SHRINK_HOSTS")  # ... after setting the hosts file to these
HOSTS, MARK = os.environ.get("T_HOSTS", ""), os.environ.get("T_MARK", "")

def set_hosts(hosts):
    with open(HOSTS + ".tmp", "w") as f:
        f.write(hosts.replace(",", "\\n") + "\\n")
    os.replace(HOSTS + ".tmp", HOSTS)

resumed = []
hvd.init()
state = spark_hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, step=0, total=0.0)
state.register_reset_callbacks([lambda: resumed.append(state.step)])

@spark_hvd.elastic.run
def train(state):
    while state.step < STEPS or hvd.size() < GROW_TO:
        state.total += float(hvd.allreduce(np.full(3, hvd.rank() + 1.0), op=hvd.Sum, name="x")[0])
        state.step += 1
        if state.step == 5 and GROW_TO and hvd.rank() == 0:
            set_hosts(GROW_HOSTS)
        if state.step == KILL_AT and hvd.rank() == 1 and not os.path.exists(MARK):
            open(MARK, "w").close()
            if SHRINK_HOSTS:
                set_hosts(SHRINK_HOSTS)
            os.kill(os.getpid(), signal.SIGKILL)
        if state.step % 5 == 0:
            state.commit()
        time.sleep(0.01)

train(state)
print("final", json.dumps({"step": state.step, "total": state.total, "size": hvd.size(),
                           "resumed": resumed, "host": os.environ["SPARK_HVD_HOSTNAME"]}),
      flush=True)
"""


@pytest.fixture
def job(tmp_path):
    """``run(*flags, slots=None, env=ENV, **T_vars)`` -> (returncode, finals by worker,
    stderr): spark-hvdrun FLAGS python TRAIN, with a discovery script printing
    localhost:<slots> when ``slots`` is given."""
    train = tmp_path / "train.py"
    train.write_text(TRAIN)
    hosts, discover = tmp_path / "hosts", tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)

    def run(*flags, slots=None, env=ENV, **variables):
        env = dict(env, T_HOSTS=str(hosts), T_MARK=str(tmp_path / "killed"),
                   **{f"T_{k.upper()}": str(v) for k, v in variables.items()})
        if slots is not None:
            hosts.write_text(f"localhost:{slots}\n")
            flags += ("--host-discovery-script", str(discover))
        proc = subprocess.run([sys.executable, "-m", "spark_hvd.runner", *flags, sys.executable,
                               str(train)], env=env, capture_output=True, timeout=TIMEOUT_S)
        finals = {}
        for line in proc.stdout.decode().splitlines():
            m = re.fullmatch(r"\[w(\d+)\] final (.*)", line)
            if m:
                finals[int(m.group(1))] = json.loads(m.group(2))
        return proc.returncode, finals, proc.stderr.decode()

    return run


def epochs(err):
    """(epoch, ranks) of each epoch the coordinator logged."""
    return [(int(e), int(n)) for e, n in re.findall(r"^spark-hvdrun: elastic: epoch (\d+): "
                                                    r"(\d+) ranks", err, re.M)]


def test_a_host_that_grows_gets_a_worker_that_joins(job):
    code, finals, err = job("-np", "2", "--max-np", "4", slots=2, steps=20, grow_to=3)
    assert code == 0, err
    assert "spark-hvdrun: elastic: hosts now localhost:3 (were localhost:2)" in err
    assert "spark-hvdrun: elastic: worker 2 started on localhost" in err
    assert epochs(err)[0] == (1, 2) and epochs(err)[-1][1] == 3, err
    assert sorted(finals) == [0, 1, 2], err
    assert same_state(finals.values())
    final = finals[0]
    assert final["size"] == 3 and final["step"] >= 20


def same_state(finals):
    """Whether every worker ended with the same state and size."""
    return len({(f["step"], f["total"], f["size"]) for f in finals}) == 1


@test_hosts.pytestmark
def test_a_host_found_later_gets_a_worker_over_ssh(job, sshd):
    code, finals, err = job("-np", "2", "--max-np", "3", "--network-interface", "127.0.0.1",
                            "--ssh-port", str(sshd.port), "-i", sshd.key, slots=2,
                            env=sshd.env(), steps=20, grow_to=3,
                            grow_hosts=f"localhost:2,{test_hosts.HOST}:1")
    assert code == 0, err
    assert f"worker 2 started on {test_hosts.HOST}" in err
    assert sorted(finals) == [0, 1, 2] and same_state(finals.values()), err
    assert finals[2]["host"] == test_hosts.HOST and finals[0]["host"] == socket.gethostname()
    assert finals[0]["size"] == 3


def test_survivors_of_a_killed_worker_resume_from_the_last_commit(job):
    # No replacement: the host's cool-down outlasts the job.
    code, finals, err = job("-np", "3", "--min-np", "2", "--blacklist-cooldown-range", "60",
                            "60", steps=30, kill_at=12)
    assert code == 0, err
    assert epochs(err) == [(1, 3), (2, 2)], err
    assert "failure 1 on localhost: was killed by signal 9 (SIGKILL); no new worker there " \
           "for 60 s" in err
    assert sorted(finals) == [0, 2], err
    for final in finals.values():
        # Steps 1-10 at 3 ranks (sum 6), back to the commit of step 10, 11-30 at 2 (sum 3).
        assert final == {"step": 30, "total": 6 * 10 + 3 * 20, "size": 2, "resumed": [10],
                         "host": socket.gethostname()}
    assert "spark-hvdrun: elastic: done: the 2 workers of epoch 2 exited 0" in err


def test_a_failed_slot_gets_a_new_worker_after_its_cool_down(job):
    """Fixed slots (-np 3, no discovery script): the killed worker's slot cools down for
    0.5 s, then a new worker starts there and joins; the job ends at 3 ranks again."""
    code, finals, err = job("-np", "3", "--min-np", "2", "--blacklist-cooldown-range", "0.5",
                            "0.5", steps=30, kill_at=12, grow_to=3)
    assert code == 0, err
    assert epochs(err)[:2] == [(1, 3), (2, 2)] and epochs(err)[-1][1] == 3, err
    assert "no new worker there for 0.5 s" in err
    assert "spark-hvdrun: elastic: worker 3 started on localhost" in err
    assert sorted(finals) == [0, 2, 3] and same_state(finals.values()), err
    assert finals[3]["size"] == 3


def test_reset_limit_ends_the_job(job):
    code, finals, err = job("-np", "3", "--min-np", "2", "--reset-limit", "0", steps=30,
                            kill_at=12)
    assert code == 1, err
    assert "elastic job failed: reset limit reached: the job re-formed 1 times, more than " \
           "--reset-limit 0" in err
    assert err.rstrip().endswith("spark-hvdrun: the elastic job failed; stopped every worker")
    assert finals == {}


def test_fewer_than_min_np_for_the_elastic_timeout_ends_the_job(job):
    code, finals, err = job("-np", "2", "--min-np", "2", "--elastic-timeout", "3", slots=2,
                            steps=30, kill_at=12, shrink_hosts="localhost:1")
    assert code == 1, err
    assert "hosts now localhost:1 (were localhost:2)" in err
    assert "elastic job failed: only 1 worker after waiting 3 s (--elastic-timeout 3), fewer " \
           "than --min-np 2" in err
    assert finals == {}


def test_a_signal_to_the_launcher_ends_every_worker():
    launcher = subprocess.Popen(
        [sys.executable, "-m", "spark_hvd.runner", "-np", "2", "--min-np", "1",
         *script("import os, time; print('ready', os.getpid(), flush=True); time.sleep(120)")],
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        lines = [launcher.stdout.readline().decode() for _ in range(2)]
        assert sorted(line.split()[0] for line in lines) == ["[w0]", "[w1]"]
        pids = [int(line.split()[-1]) for line in lines]
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(TIMEOUT_S) == 128 + signal.SIGTERM
        assert wait_gone(pids, 10) == []
    finally:
        launcher.kill()
        launcher.wait()
        launcher.stdout.close()
        launcher.stderr.close()


def test_cli_argument_errors_exit_2():
    cases = [
        (["-np", "2", "--reset-limit", "1"], "--reset-limit applies to elastic mode only"),
        (["-np", "2", "--min-np", "1", "--mpi"], "needs the gloo controller: drop --mpi"),
        (["-np", "2", "--min-np", "3"], "--min-np <= -np <= --max-np"),
    ]
    for flags, message in cases:
        proc = subprocess.run([sys.executable, "-m", "spark_hvd.runner", *flags, "true"],
                              env=ENV, capture_output=True, timeout=TIMEOUT_S)
        assert proc.returncode == 2 and "spark-hvdrun: error: " in proc.stderr.decode()
        assert message in proc.stderr.decode(), proc.stderr.decode()


def _script(tmp_path, body, mode=0o755):
    path = tmp_path / "discover.sh"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(mode)
    return str(path)


@pytest.mark.parametrize("np, options, hosts, message", [
    (2, dict(min_np=1, max_np=1), None, "--min-np <= -np <= --max-np; got --min-np=1, -np=2, "
                                        "--max-np=1"),
    (2, dict(min_np=0), None, "--min-np must be an int >= 1"),
    (2, dict(min_np=1, reset_limit=-1), None, "--reset-limit must be >= 0"),
    (2, dict(min_np=1, cooldown_range_s=(5.0, 1.0)), None, "0 <= LOW <= HIGH"),
    (3, dict(min_np=1), "localhost:2", "-np 3 is more than the 2 slots given by -H"),
    (2, dict(discovery_script="/nonexistent/discover.sh"), None, "no such file"),
    (2, dict(discovery_script="{mode:0o644}echo localhost:2"), None, "(chmod +x it)"),
    (2, dict(discovery_script="{}echo localhost:2"), "localhost:2", "either -H or "
                                                                   "--host-discovery-script"),
    (2, dict(discovery_script="{}echo oops >&2; exit 3"), None,
     "--host-discovery-script failed: {script} exited with code 3: oops"),
    (2, dict(discovery_script="{}echo localhost:x"), None, "printed 'localhost:x': slots of "
                                                           "'localhost' must be an int"),
], ids=["sizes", "min", "reset-limit", "cooldown", "slots", "missing", "not-executable",
        "both-hosts", "script-fails", "script-output"])
def test_launch_checks_elastic_arguments_before_starting(tmp_path, np, options, hosts,
                                                         message):
    script_arg = options.get("discovery_script", "")
    if script_arg.startswith("{"):
        spec, _, body = script_arg[1:].partition("}")
        mode = int(spec.split(":")[1], 8) if spec else 0o755
        options = dict(options, discovery_script=_script(tmp_path, body, mode))
        message = message.format(script=options["discovery_script"])
    with pytest.raises(InvalidArgumentError) as e:
        launch_mod.launch(["true"], np, hosts=hosts, elastic=ElasticOptions(**options),
                          stdout=io.BytesIO(), stderr=io.BytesIO())
    assert message in str(e.value)


# Worker 1 sleeps; worker 0 takes a slot away from the discovered host, then waits for
# worker 1's supervisor (its parent) to be gone and exits 0.
IGNORES_REMOVAL = """
import os, sys, time
here = sys.argv[1]
def put(name, text):
    with open(f"{here}/{name}.tmp", "w") as f:
        f.write(text)
    os.replace(f"{here}/{name}.tmp", f"{here}/{name}")
if os.environ["SPARK_HVD_ELASTIC_WORKER"] == "1":
    put("w1.pid", str(os.getppid()))
    time.sleep(60)
while not os.path.exists(f"{here}/w1.pid"):
    time.sleep(0.02)
pid = int(open(f"{here}/w1.pid").read())
put("hosts", "localhost:1\\n")
while os.path.exists(f"/proc/{pid}"):
    time.sleep(0.02)
print("worker 1 is gone")
"""


def test_a_worker_that_does_not_leave_is_ended_after_the_grace(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    out, err = io.BytesIO(), io.BytesIO()
    options = ElasticOptions(discovery_script=_script(tmp_path, f"cat {hosts}"),
                             discovery_interval_s=0.2, leave_grace_s=0.5)
    code = launch_mod.launch([sys.executable, "-c", IGNORES_REMOVAL, str(tmp_path)], 2,
                             elastic=options, stdout=out, stderr=err)
    said = err.getvalue().decode()
    assert code == 0, said
    assert out.getvalue().decode() == "[w0] worker 1 is gone\n"
    for line in ["hosts now localhost:1 (were localhost:2)",
                 "worker 1 on localhost is to leave (localhost has fewer slots)",
                 "worker 1 on localhost did not leave within 0.5 s: SIGTERM",
                 "worker 1 on localhost left (was killed by signal 15 (SIGTERM))",
                 "done: every worker exited 0"]:
        assert f"spark-hvdrun: elastic: {line}\n" in said, said
