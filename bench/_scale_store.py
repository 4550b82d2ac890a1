"""Clients of bench/scale.py's rendezvous probe: ``python bench/_scale_store.py CONFIG_JSON``.

THREADS clients in this process, each on a thread of its own:

1. at ``connect_at`` (wall clock, the same in every probe process) every thread builds a
   RendezvousClient (connect and authenticate), as N ranks starting at once would;
2. from ``rate_at`` for ``seconds`` every connected thread sends GETs of a key it set,
   one after the other, as fast as the server answers.

Writes ``out``: connects that succeeded and failed (with the errors), reconnects the
client made because the server closed a connection before authenticating it, the
slowest connect, and the GETs completed within the window.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections import Counter

from spark_hvd._job import env
from spark_hvd._job.client import RendezvousClient

CONFIG = json.loads(sys.argv[1])
SECRET = env.secret_from_env(os.environ[env.SECRET_ENV_VAR])  # not in argv: ps shows argv


class RetryCounter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.retries = 0
        self._lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        if "before authenticating" in record.getMessage():
            with self._lock:
                self.retries += 1


def sleep_until(t: float) -> None:
    while (left := t - time.time()) > 0:
        time.sleep(min(left, 0.5))


def client_thread(index: int, out: dict, lock: threading.Lock) -> None:
    sleep_until(CONFIG["connect_at"])
    t0 = time.time()
    try:
        client = RendezvousClient(CONFIG["addr"], CONFIG["port"], SECRET, CONFIG["run_id"],
                                  connect_timeout_s=CONFIG["connect_timeout_s"])
    except Exception as e:  # noqa: BLE001 - counted
        with lock:
            out["failed"] += 1
            out["errors"][f"{type(e).__name__}: {str(e)[:200]}"] += 1
        return
    connect_s = time.time() - t0
    key = f"probe/{CONFIG['process']}/{index}"
    requests = 0
    try:
        client.set(key, b"x")
        sleep_until(CONFIG["rate_at"])
        end = CONFIG["rate_at"] + CONFIG["seconds"]
        while time.time() < end:
            client.get(key, timeout_s=5.0)
            if time.time() <= end:
                requests += 1
    except Exception as e:  # noqa: BLE001 - counted
        with lock:
            out["errors"][f"{type(e).__name__}: {str(e)[:200]}"] += 1
    finally:
        client.close()
    with lock:
        out["connected"] += 1
        out["connect_s"].append(connect_s)
        out["requests"] += requests


def main() -> None:
    retries = RetryCounter()
    log = logging.getLogger("spark_hvd._job.client")
    log.addHandler(retries)
    log.setLevel(logging.DEBUG)
    out = {"connected": 0, "failed": 0, "errors": Counter(), "connect_s": [], "requests": 0}
    lock = threading.Lock()
    threads = [threading.Thread(target=client_thread, args=(i, out, lock), daemon=True)
               for i in range(CONFIG["threads"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out["retries"] = retries.retries
    out["errors"] = dict(out["errors"])
    with open(CONFIG["out"] + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(CONFIG["out"] + ".tmp", CONFIG["out"])


if __name__ == "__main__":
    main()
