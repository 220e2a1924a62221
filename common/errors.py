"""How a run ends when it cannot finish, each with its exit status.

Exit statuses follow the convention of Kubeflow's `restartPolicy: ExitCode`: 1-127 are
permanent failures (retrying cannot help), 128-255 are retryable (the same command resumes).
"""


class UserError(Exception):
    """Bad input or environment: the message names the path or flag and the fix."""
    exit_code = 2


class NonFiniteLoss(Exception):
    """The loss became NaN or inf; the last good checkpoint is kept."""
    exit_code = 3


class PeerLost(Exception):
    """Another rank died, stopped answering within --timeout, or never joined at start-up.

    Retryable: once every rank runs again (torchrun's restart, the operator's, a resubmitted
    job) the same command resumes from the checkpoint.  200 lies above 128 + any signal number
    (at most 192), so it is never mistaken for "killed by a signal"."""
    exit_code = 200


class Interrupted(Exception):
    """SIGTERM/SIGINT: the current step finished and a checkpoint was written."""

    def __init__(self, message, signum):
        super().__init__(message)
        self.exit_code = 128 + signum
