"""What several test modules need: the repository root, a child's environment, argv parsing."""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(**extra):
    """The environment of a script started by a test: one thread per process, no launcher
    variables inherited from the caller (so a child is a world of 1 unless the test says
    otherwise), and Open MPI allowed to run as root and to oversubscribe the 2 cores."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1",
               PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe")
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(key, None)
    env.update(extra)
    return env


def last_value(argv, flag):
    """The value argparse keeps for `flag`: its last occurrence."""
    found = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]
    assert found, f"{flag} is not on the command line {argv}"
    return found[-1]
