"""Run by mpirun in front of each rank's command: set SPARK_HVD_* from MPI's env, exec.

``spark-hvdrun --mpi`` starts ``python /path/to/_mpi_exec.py command...`` so a rank
sees the same SPARK_HVD_RANK/SIZE/LOCAL_* variables as under the Gloo launcher.
It is run by path, so it first puts the package root on sys.path; the command it
execs gets a fresh interpreter, untouched.
"""

import os
import sys

if __name__ == "__main__":
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spark_hvd import _config  # noqa: E402
from spark_hvd._job import env as _env  # noqa: E402

PID_DIR_ENV_VAR = "_SPARK_HVD_MPI_PID_DIR"  # internal: where a rank leaves its pid

# (our variable, the variables Open MPI / MPICH / PMIx set, in order of preference)
_FROM_MPI = (
    (_env.RANK_ENV_VAR, ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")),
    (_env.SIZE_ENV_VAR, ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")),
    (_env.LOCAL_RANK_ENV_VAR, ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")),
    (_env.LOCAL_SIZE_ENV_VAR, ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")),
)


def mpi_rank_env(environ) -> dict:
    """SPARK_HVD_* rank variables derived from the MPI launcher's variables.

    Cross rank/size are only known here when every rank is on this host; otherwise
    they are left for the MPI controller to compute (a communicator split).
    """
    out = {}
    for ours, theirs in _FROM_MPI:
        for name in theirs:
            if environ.get(name):
                out[ours] = environ[name]
                break
    if out.get(_env.LOCAL_SIZE_ENV_VAR) and \
            out.get(_env.LOCAL_SIZE_ENV_VAR) == out.get(_env.SIZE_ENV_VAR):
        out[_env.CROSS_RANK_ENV_VAR] = "0"
        out[_env.CROSS_SIZE_ENV_VAR] = "1"
    out[_config.CONTROLLER_ENV_VAR] = _env.CONTROLLER_MPI
    return out


def main(argv) -> None:
    if not argv:
        sys.exit("spark_hvd _mpi_exec: no command given")
    environ = dict(os.environ)
    environ.update(mpi_rank_env(environ))
    pid_dir = environ.pop(PID_DIR_ENV_VAR, None)
    rank = environ.get(_env.RANK_ENV_VAR)
    if pid_dir and rank is not None:
        try:
            with open(os.path.join(pid_dir, f"{int(rank)}.pid"), "w") as f:
                f.write(str(os.getpid()))
        except (OSError, ValueError):
            pass
    try:
        os.execvpe(argv[0], argv, environ)
    except OSError as e:
        sys.stderr.write(f"spark-hvdrun: cannot run {argv[0]!r}: {e.strerror or e}\n")
        sys.exit(127)


if __name__ == "__main__":
    main(sys.argv[1:])
