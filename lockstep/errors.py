"""Errors that Lockstep reports to users as one clear line (the CLI prints them without a
traceback and exits non-zero; the server turns them into 4xx responses)."""


class LockstepError(Exception):
    """Base class for errors whose message is meant for the user as is. `exit_status`: the
    CLI's status for it (2: the command as given cannot run)."""

    exit_status = 2


class ConfigError(LockstepError, ValueError):
    """An engine option has an invalid value or an invalid combination with another option."""


class ModelLoadError(LockstepError):
    """A model could not be resolved or loaded: missing file, unsupported format or type."""


class UnreadableWeights(ModelLoadError):
    """A weight update's path names nothing that loads. The message says what exists on the
    server's disk: for the server's log and in-process callers, not for remote clients."""


class RequestError(LockstepError, ValueError):
    """A request cannot be served as given (too long for the context, bad sampling values)."""
