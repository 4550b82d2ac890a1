"""One rank of a fault scenario: ``python fault_worker.py SCENARIO OUTDIR``.

Each rank writes OUTDIR/pid<r> at start and OUTDIR/result<r>.json with what it
saw (error type, message, its ranks and tensor fields, seconds). test_mp_faults.py asserts on them.
"""

import json
import os
import signal
import sys
import time

import numpy as np

import spark_hvd as hvd

OUT = sys.argv[2]


def save(name: str, **record) -> None:
    path = os.path.join(OUT, name)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def wait_file(name: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(os.path.join(OUT, name)) and time.monotonic() < deadline:
        time.sleep(0.01)


def wait_others_entering(n: int, me: int) -> None:
    """Waits until every other rank is about to submit its op (its ``entering`` file): the
    op is theirs to wait in, whether or not they reached the wait itself first (a peer lost
    before the submit fails it all the same)."""
    for r in range(n):
        if r != me:
            wait_file(f"entering{r}", 60)


def attempt(fn, *args, **kwargs) -> dict:
    """Runs one op; returns what happened and when."""
    t0 = time.monotonic()
    try:
        value = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the outcome under test
        return {"error": type(e).__name__, "message": str(e),
                "ranks": list(getattr(e, "ranks", []) or []),
                "tensor": getattr(e, "tensor", None), "at": time.time(),
                "seconds": time.monotonic() - t0}
    return {"error": None, "value": np.asarray(value).tolist(), "at": time.time(),
            "seconds": time.monotonic() - t0}


def kill() -> None:
    """The last rank SIGKILLs itself while the others wait in an allreduce with it."""
    n, me = hvd.size(), hvd.rank()
    hvd.allreduce(np.ones(4), name="warm")
    if me == n - 1:
        wait_others_entering(n, me)
        save("killed_at", at=time.time())
        os.kill(os.getpid(), signal.SIGKILL)
    save(f"entering{me}")
    save(f"result{me}", **attempt(hvd.allreduce, np.ones(4), name="victim"))


def segments() -> dict:
    """This process's open descriptors of memory files and its mappings of shm segments."""
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(("/memfd:", "/dev/shm")):
            fds.append(target)
    with open("/proc/self/maps") as f:
        maps = [line.split(None, 5)[-1].strip() for line in f if "spark_hvd-shm" in line]
    return {"fds": fds, "maps": maps}


def mid_transfer(stop_signal: int, fork_holder: bool = False, mixed: bool = False) -> None:
    """The last rank SIGKILLs (SIGSTOPs) itself while 64 MiB allreduces (mixed: and
    broadcasts, and 16 MiB allgathers) are in flight (the data path: the tcp ring, shm's
    rounds; not the control plane). The others report what they saw, and which segments
    they held then and after shutdown().
    fork_holder: the last rank first forks a child that outlives it holding copies of
    its descriptors, its connections to the peers among them (as a data loader's worker
    would); the child's pid goes to holder_pid for the test to end it."""
    import select
    import threading

    n, me = hvd.size(), hvd.rank()
    if fork_holder and me == n - 1:
        child = os.fork()
        if child == 0:
            select.select([], [], [], 60)  # holds the descriptors until the test kills it
            os._exit(0)
        save("holder_pid", pid=child)
    x = np.ones(16 << 20, np.float32)
    part = x[:4 << 20]
    hvd.allreduce(x, name="big", op=hvd.Sum)

    def loop():
        for _ in range(200):
            hvd.allreduce(x, name="big", op=hvd.Sum)
            if mixed:
                hvd.broadcast(x, 0, name="big.bcast")
                hvd.allgather(part, name="big.gather")
        return 0

    if me == n - 1:
        def die():
            save("killed_at" if stop_signal == signal.SIGKILL else "frozen_at", at=time.time())
            os.kill(os.getpid(), stop_signal)
        threading.Timer(0.3, die).start()
    held = segments()
    result = attempt(loop)
    hvd.shutdown()
    save(f"result{me}", held=held, after=segments(), **result)


def kill_mid_transfer() -> None:
    mid_transfer(signal.SIGKILL, mixed=True)


def kill_forked_mid_transfer() -> None:
    mid_transfer(signal.SIGKILL, fork_holder=True)


def freeze_mid_transfer() -> None:
    mid_transfer(signal.SIGSTOP)


def freeze() -> None:
    """The last rank stops (SIGSTOP) without dying while every rank runs allreduces: the
    heartbeats (or, with them off, SPARK_HVD_TIMEOUT_S) must end the others' wait."""
    import threading

    n, me = hvd.size(), hvd.rank()
    hvd.allreduce(np.ones(4), name="warm")
    if me == n - 1:
        def stop():
            save("frozen_at", at=time.time())
            os.kill(os.getpid(), signal.SIGSTOP)
        threading.Timer(0.5, stop).start()

    def loop():
        for _ in range(1000000):
            hvd.allreduce(np.ones(4), name="loop")
    save(f"result{me}", **attempt(loop))


def never_init() -> None:
    """The last rank ends before it ever calls init(); the others report what init raised."""
    me = int(os.environ["SPARK_HVD_RANK"])
    save(f"pid{me}", pid=os.getpid())
    if me == int(os.environ["SPARK_HVD_SIZE"]) - 1:
        save("ended_at", at=time.time())
        return
    save(f"result{me}", **attempt(hvd.init))


def shutdown_early() -> None:
    """The last rank calls shutdown() while the others have an allreduce pending."""
    n, me = hvd.size(), hvd.rank()
    hvd.allreduce(np.ones(4), name="warm")
    if me == n - 1:
        wait_others_entering(n, me)
        save("shutdown_at", at=time.time())
        hvd.shutdown()
        save(f"result{me}", error=None, shut_down=True)
        return
    save(f"entering{me}")
    save(f"result{me}", **attempt(hvd.allreduce, np.ones(4), name="pending"))


def busy(seconds: float) -> None:
    """Computes in Python, holding the GIL all along (no collective)."""
    end, x = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        x += 1


def stall_warning() -> None:
    """The last rank computes for 12 s holding the GIL (no collective; the heartbeats at
    their defaults: a peer silent for 6 s is lost) before a fresh tensor, then is 3 s late
    for a cached one: the others wait, warned of a stall, and never lose it.  It sleeps 3 s
    first, so that its neighbours have had its beats (every 1 s) and no longer give it the
    start timeout's grace, which a peer silent since set-up gets on top."""
    n, me = hvd.size(), hvd.rank()
    late = me == n - 1
    out = {}
    if late:
        time.sleep(3)
        busy(12)
    out["fresh"] = attempt(hvd.allreduce, np.full(3, me + 1.0), op=hvd.Sum, name="stall.fresh")
    for _ in range(3):  # the response cache now holds it
        hvd.allreduce(np.full(3, me + 1.0), op=hvd.Sum, name="stall.cached")
    if late:
        time.sleep(3)
    out["cached"] = attempt(hvd.allreduce, np.full(3, me + 1.0), op=hvd.Sum,
                            name="stall.cached")
    save(f"result{me}", **out)


def stall_shutdown() -> None:
    """With SPARK_HVD_STALL_SHUTDOWN_TIME_S=2: a rank waiting for a late peer (a plain and
    a grouped allreduce), then two ranks waiting on different names, get
    CollectiveTimeoutError; the engine goes on."""
    me = hvd.rank()
    out = {}
    if me == 0:
        group = hvd.grouped_allreduce_async([np.ones(3), np.ones(2)], name="stall.group")
        out["alone"] = attempt(hvd.allreduce, np.ones(3), name="stall.alone")
        out["group"] = [attempt(hvd.synchronize, m) for m in group.members]
        save("alone_done", at=time.time())
    else:
        wait_file("alone_done", 20)
    out["sync"] = attempt(hvd.allreduce, np.ones(3), op=hvd.Sum, name="stall.sync")
    out["crossed"] = attempt(hvd.allreduce, np.ones(3), name=f"stall.crossed.{me}")
    out["final"] = attempt(hvd.allreduce, np.ones(3), op=hvd.Sum, name="stall.final")
    save(f"result{me}", **out)


def kill_in_init(stage: str) -> None:
    """Rank VICTIM[stage] SIGKILLs itself inside hvd.init(): "before_connect" once it is
    registered with the rendezvous service, before its mesh connects; "after_publish"
    right after publishing its mesh address. The others report what init raised."""
    import spark_hvd._core as core

    me = int(os.environ["SPARK_HVD_RANK"])
    save(f"pid{me}", pid=os.getpid())

    def die() -> None:
        save("killed_at", at=time.time())
        os.kill(os.getpid(), signal.SIGKILL)

    if me == KILL_IN_INIT_VICTIM[stage] and stage == "before_connect":
        core.init = lambda *args, **kwargs: die()
    elif me == KILL_IN_INIT_VICTIM[stage]:
        def set_then_die(publish, set_only, key):
            if "/tcp/" in key:
                set_only()  # published; the peers' addresses never read
                die()
            return publish()
        _on_publish(set_then_die)
    save(f"result{me}", **attempt(hvd.init))


KILL_IN_INIT_VICTIM = {"before_connect": 2, "after_publish": 1}


def _on_publish(hook) -> None:
    """Calls hook(publish, set_only, key) wherever the rendezvous client publishes a key:
    a SET, or the SET part of a SETMGET (the core publishes an address with the read of
    its peers' in one request). publish() sends the request itself, set_only() only the
    key's SET."""
    from spark_hvd._job.client import RendezvousClient

    set_key, set_and_get = RendezvousClient.set, RendezvousClient.set_and_get_many

    def hooked_set(self, key, value):
        publish = lambda: set_key(self, key, value)  # noqa: E731
        return hook(publish, publish, key)

    def hooked_set_and_get(self, key, value, *args, **kwargs):
        return hook(lambda: set_and_get(self, key, value, *args, **kwargs),
                    lambda: set_key(self, key, value), key)
    RendezvousClient.set = hooked_set
    RendezvousClient.set_and_get_many = hooked_set_and_get


def hold_shm_setup() -> None:
    """The last rank stops inside init right before publishing its shm address (the
    lower ranks' listeners are open, waiting for it) until the test has tried its
    connections (file attack_done); then every rank checks an allreduce."""

    me, n = int(os.environ["SPARK_HVD_RANK"]), int(os.environ["SPARK_HVD_SIZE"])
    save(f"pid{me}", pid=os.getpid())
    if me == n - 1:
        def held_set(publish, set_only, key):
            if "/shm/set0/addr/" in key:
                save("holding", at=time.time())
                wait_file("attack_done", 60)
            return publish()
        _on_publish(held_set)
    hvd.init()
    save(f"result{me}", **attempt(hvd.allreduce, np.full(3, me + 1.0), op=hvd.Sum, name="after"))
    wait_file("checked", 60)  # the test looks at this process's sockets meanwhile


def stop_ranks() -> None:
    """Ranks SPARK_HVD_TEST_VICTIMS (comma-separated) stop together, by SIGSTOP (frozen:
    a host cut off) or SIGKILL (SPARK_HVD_TEST_SIGNAL=KILL), while every rank runs
    allreduces; the others report what they saw."""
    import threading

    me = hvd.rank()
    victims = [int(v) for v in os.environ["SPARK_HVD_TEST_VICTIMS"].split(",")]
    sig = signal.SIGKILL if os.environ.get("SPARK_HVD_TEST_SIGNAL") == "KILL" else signal.SIGSTOP
    hvd.allreduce(np.ones(4), name="warm")
    save(f"pid{me}", pid=os.getpid())
    if me in victims:
        def stop():
            if me == victims[0]:
                save("stopped_at", at=time.time())
            os.kill(os.getpid(), sig)
        threading.Timer(0.5, stop).start()

    def loop():
        for _ in range(1000000):
            hvd.allreduce(np.ones(4), name="loop")
    save(f"result{me}", **attempt(loop))


if __name__ == "__main__":
    if sys.argv[1].startswith("kill_in_init:"):
        kill_in_init(sys.argv[1].split(":", 1)[1])
        sys.exit(0)
    if sys.argv[1] == "hold_shm_setup":
        hold_shm_setup()
        sys.exit(0)
    if sys.argv[1] == "never_init":
        never_init()
        sys.exit(0)
    hvd.init()
    save(f"pid{hvd.rank()}", pid=os.getpid())
    {"kill": kill, "kill_mid_transfer": kill_mid_transfer, "stop_ranks": stop_ranks,
     "kill_forked_mid_transfer": kill_forked_mid_transfer, "freeze": freeze,
     "freeze_mid_transfer": freeze_mid_transfer, "shutdown_early": shutdown_early,
     "stall_warning": stall_warning, "stall_shutdown": stall_shutdown}[sys.argv[1]]()

