"""What runs on the box's hosts: an sshd each, a Spark standalone Master and Workers.

Every daemon starts in its namespace under its host name (Box.argv), in a session of its
own, its output in ``<box dir>/logs/``; the box's down() ends them with everything else
in the namespaces, so nothing here tracks pids for cleanup.

ssh: one client key and a host key per host under ``<box dir>/ssh``; ``ssh`` on the PATH
of Box.env() is a two-line wrapper adding ``-F <box dir>/ssh/ssh_config``, which maps each
host name to its address, trusts only the box's host keys, and reads nothing of ~/.ssh.

Spark: pyspark's own ``spark-class`` runs the Master (namespace boxmaster, port 7077,
its web UI's JSON on 8080 tells who registered) and a Worker per host (``--host`` its
address, SPARK_LOCAL_IP too, so its executors listen there), each Worker with ``gpus``
fake GPUs from a discovery script. Box.spark_conf() is a driver's conf for the cluster:
one executor per host taking all its cores and GPUs, one GPU per task.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from typing import Dict, List, Optional

import _box_procs as _procs
from _box_procs import BoxError

SSHD = "/usr/sbin/sshd"
MASTER_PORT = 7077
MASTER_UI_PORT = 8080
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"
MASTER_CLASS = "org.apache.spark.deploy.master.Master"
JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC -Djava.net.preferIPv4Stack=true"
START_TIMEOUT_S = 120.0
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def spark_home() -> str:
    import pyspark

    return os.path.dirname(os.path.abspath(pyspark.__file__))


def _write(path: str, text: str, mode: int = 0o644) -> None:
    with open(path, "w") as f:
        f.write(textwrap.dedent(text).lstrip())
    os.chmod(path, mode)


class Services:
    def __init__(self, box) -> None:
        self.box = box
        self.ssh_dir = os.path.join(box.dir, "ssh")
        self.log_dir = os.path.join(box.dir, "logs")
        self.spark_dir = os.path.join(box.dir, "spark")
        self.cores = self.gpus = 0
        self.memory = "1g"
        info = box.state.get("services", {})
        if info.get("spark"):
            self.cores, self.gpus, self.memory = info["cores"], info["gpus"], info["memory"]

    # -- starting ------------------------------------------------------------------------

    def start(self, sshd: bool, spark: bool, gpus: int, cores: int = 2,
              memory: str = "1g") -> None:
        os.makedirs(self.log_dir, exist_ok=True)
        if sshd:
            self._start_sshds()
        if spark:
            self.cores, self.gpus, self.memory = cores, gpus, memory
            self.box.state["services"] = {"spark": True, "cores": cores, "gpus": gpus,
                                          "memory": memory}
            self._start_spark()
        self.box.state["services"]["sshd"] = sshd

    def _daemon(self, host: str, argv: List[str], log: str,
                env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
        with open(os.path.join(self.log_dir, log), "ab") as out:
            return self.box.popen(host, argv, stdin=subprocess.DEVNULL, stdout=out,
                                  stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def _wait_port(self, proc: subprocess.Popen, addr: str, port: int, what: str,
                   log: str) -> None:
        """Until ``addr:port`` accepts a connection (from the root namespace, through
        the bridge); a failure names the daemon and shows its log."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                socket.create_connection((addr, port), timeout=1).close()
                return
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise self._failed(what, log, proc) from None
            time.sleep(0.05)

    def _failed(self, what: str, log: str, proc: Optional[subprocess.Popen]):
        with open(os.path.join(self.log_dir, log), errors="replace") as f:
            tail = "\n".join(f.read().splitlines()[-30:])
        state = "it exited" if proc is not None and proc.poll() is not None else "it hangs"
        return BoxError(f"{what} did not start within {START_TIMEOUT_S:.0f} s ({state}); "
                        f"{log} ends:\n{tail}")

    def _start_sshds(self) -> None:
        if not os.path.exists(SSHD) or shutil.which("ssh") is None:
            raise BoxError("the box runs an sshd per host: apt-get install openssh-server "
                           "openssh-client (make apt-test)")
        d = self.ssh_dir
        os.makedirs(os.path.join(d, "bin"))
        keygen = ["ssh-keygen", "-q", "-t", "ed25519", "-N", ""]
        subprocess.run([*keygen, "-C", "box-client", "-f", f"{d}/client_key"], check=True)
        shutil.copy(f"{d}/client_key.pub", f"{d}/authorized_keys")
        known, config = [], []
        for h in self.box.hosts:
            subprocess.run([*keygen, "-C", h.name, "-f", f"{d}/{h.name}_key"], check=True)
            with open(f"{d}/{h.name}_key.pub") as f:
                known.append(f"{h.name},{h.addr} {' '.join(f.read().split()[:2])}\n")
            config.append(f"Host {h.name}\n  HostName {h.addr}\n")
            _write(f"{d}/{h.name}_sshd_config", f"""
                Port 22
                ListenAddress {h.addr}
                HostKey {d}/{h.name}_key
                AuthorizedKeysFile {d}/authorized_keys
                PidFile {d}/{h.name}_sshd.pid
                StrictModes no
                UsePAM no
                PermitRootLogin prohibit-password
                PubkeyAuthentication yes
                PasswordAuthentication no
                KbdInteractiveAuthentication no
                X11Forwarding no
                MaxStartups 100
                LogLevel ERROR
            """)
        with open(f"{d}/known_hosts", "w") as f:
            f.writelines(known)
        _write(f"{d}/ssh_config", "".join(config) + f"""
            Host *
              User root
              IdentityFile {d}/client_key
              IdentitiesOnly yes
              UserKnownHostsFile {d}/known_hosts
              GlobalKnownHostsFile /dev/null
              StrictHostKeyChecking yes
              BatchMode yes
              LogLevel ERROR
        """)
        _write(f"{d}/bin/ssh", f'#!/bin/sh\nexec {shutil.which("ssh")} -F {d}/ssh_config "$@"\n',
               0o755)
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
        procs = {h.name: self._daemon(h.name, [SSHD, "-D", "-e", "-f",
                                               f"{d}/{h.name}_sshd_config"], f"sshd-{h.name}.log")
                 for h in self.box.hosts}
        for h in self.box.hosts:
            self._wait_port(procs[h.name], h.addr, 22, f"sshd on {h.name}", f"sshd-{h.name}.log")

    def ssh_env(self, env: Dict[str, str]) -> Dict[str, str]:
        env["PATH"] = os.path.join(self.ssh_dir, "bin") + os.pathsep + env.get("PATH", os.defpath)
        return env

    # -- Spark ---------------------------------------------------------------------------

    def _spark_env(self, addr: str, name: str) -> Dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SPARK_", "PYSPARK_"))}
        d = os.path.join(self.spark_dir, name)
        for sub in ("work", "local"):
            os.makedirs(os.path.join(d, sub), exist_ok=True)
        os.makedirs(os.path.join(self.spark_dir, "conf"), exist_ok=True)
        env.update(SPARK_HOME=spark_home(), SPARK_LOCAL_IP=addr,
                   SPARK_CONF_DIR=os.path.join(self.spark_dir, "conf"),
                   SPARK_LOG_DIR=os.path.join(d, "work"),
                   SPARK_WORKER_DIR=os.path.join(d, "work"),
                   SPARK_LOCAL_DIRS=os.path.join(d, "local"),
                   SPARK_DAEMON_MEMORY="256m", SPARK_DAEMON_JAVA_OPTS=JVM_OPTIONS,
                   PYSPARK_PYTHON=sys.executable)
        return env

    @property
    def gpu_script(self) -> str:
        return os.path.join(self.spark_dir, "discover_gpus.sh")

    def _start_spark(self) -> None:
        os.makedirs(self.spark_dir, exist_ok=True)
        addresses = json.dumps([str(i) for i in range(self.gpus)])
        _write(self.gpu_script,
               f"#!/bin/sh\necho '{{\"name\": \"gpu\", \"addresses\": {addresses}}}'\n", 0o755)
        m = self.box.master
        argv = [os.path.join(spark_home(), "bin", "spark-class"), MASTER_CLASS, "--host", m.addr,
                "--port", str(MASTER_PORT), "--webui-port", str(MASTER_UI_PORT)]
        proc = self._daemon(m.name, argv, "spark-master.log", self._spark_env(m.addr, m.name))
        self._wait_port(proc, m.addr, MASTER_UI_PORT, "the Spark master", "spark-master.log")
        for h in self.box.hosts:
            self.start_worker(h.name, wait=False)
        self.wait_workers(self.box.names)

    def start_worker(self, host: str, wait: bool = True) -> None:
        """Starts ``host``'s Worker (again, after kill_worker)."""
        h = self.box.host(host)
        env = self._spark_env(h.addr, h.name)
        env["SPARK_WORKER_OPTS"] = (f"-Dspark.worker.resource.gpu.amount={self.gpus} "
                                    f"-Dspark.worker.resource.gpu.discoveryScript="
                                    f"{self.gpu_script}")
        argv = [os.path.join(spark_home(), "bin", "spark-class"), WORKER_CLASS, "--host",
                h.addr, "--cores", str(self.cores), "--memory", "4g", "--webui-port", "8081",
                "--work-dir", env["SPARK_WORKER_DIR"], self.box.master_url]
        self._daemon(h.name, argv, f"spark-worker-{h.name}.log", env)
        if wait:
            self.wait_workers([host])

    def master_state(self) -> dict:
        url = f"http://{self.box.master.addr}:{MASTER_UI_PORT}/json/"
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.load(r)

    def alive_workers(self) -> Dict[str, dict]:
        """The Workers the master holds ALIVE, by host name."""
        by_addr = {h.addr: h.name for h in self.box.hosts}
        return {by_addr.get(w["host"], w["host"]): w for w in self.master_state()["workers"]
                if w["state"] == "ALIVE"}

    def _alive_or_none(self) -> Dict[str, dict]:
        try:
            return self.alive_workers()
        except (OSError, ValueError):  # the UI's port opens before its pages answer (404)
            return {}

    def wait_workers(self, hosts: List[str]) -> None:
        """Until the master holds a live Worker on each of ``hosts``."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while not set(hosts) <= set(self._alive_or_none()):
            if time.monotonic() > deadline:
                missing = sorted(set(hosts) - set(self._alive_or_none()))
                raise self._failed(f"the Spark Worker on {', '.join(missing)}",
                                   f"spark-worker-{missing[0]}.log", None)
            time.sleep(0.2)

    def worker_pid(self, host: str) -> Optional[int]:
        for pid in _procs.netns_pids(host):
            if WORKER_CLASS in _procs.cmdline(pid) and "java" in _procs.cmdline(pid):
                return pid
        return None

    def kill_worker(self, host: str, sig: int = signal.SIGKILL) -> int:
        """Sends ``sig`` to ``host``'s Worker JVM (only it); its pid."""
        pid = self.worker_pid(host)
        if pid is None:
            raise BoxError(f"no Spark Worker runs on {host}")
        os.kill(pid, sig)
        return pid

    def spark_conf(self, **overrides: str) -> Dict[str, str]:
        """A driver's conf for the box's cluster (the driver in the root namespace, at the
        bridge's address): one executor per host with all its cores and fake GPUs."""
        n = len(self.box.hosts)
        path = os.pathsep.join(p for p in (REPO, os.path.join(REPO, "tests", "cluster"),
                                           os.environ.get("PYTHONPATH")) if p)
        conf = {
            "spark.master": self.box.master_url,
            "spark.driver.host": self.box.driver_addr,
            "spark.driver.bindAddress": self.box.driver_addr,
            "spark.driver.extraJavaOptions": JVM_OPTIONS,
            "spark.executor.extraJavaOptions": JVM_OPTIONS,
            "spark.executor.cores": str(self.cores),
            "spark.executor.memory": self.memory,
            "spark.cores.max": str(self.cores * n),
            "spark.executor.resource.gpu.amount": str(self.gpus),
            "spark.executor.resource.gpu.discoveryScript": self.gpu_script,
            "spark.task.resource.gpu.amount": "1",
            "spark.pyspark.python": sys.executable,
            "spark.executorEnv.PYTHONPATH": path,
            "spark.ui.enabled": "false",
            "spark.ui.showConsoleProgress": "false",
            "spark.sql.shuffle.partitions": str(n),
            "spark.default.parallelism": str(n),
        }
        conf.update(overrides)
        return conf
