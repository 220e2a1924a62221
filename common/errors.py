"""The one exception type a user sees as a single clear line (see `cli.run_main`)."""


class UserError(Exception):
    """Bad input or environment: the message names the path or flag and the fix."""
