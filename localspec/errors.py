"""localspec's errors: one base class, one subclass per kind of failure.

Every message says what is wrong and what to do. The command line maps these classes to exit
codes in one place (:data:`EXIT_CODES` here, so that a process that must exit at once can use it
too) and the server to HTTP statuses in one place (``localspec.server.app.HTTP_STATUS``); library
callers catch :class:`LocalspecError`.
"""

from __future__ import annotations


class LocalspecError(Exception):
    """Base class of every error localspec raises on purpose."""


class ConfigError(LocalspecError, ValueError):
    """Settings that are out of range or cannot be combined; `param` is the keyword name of the
    setting at fault (the CLI shows it as --kebab-case, the server as the request field)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param or None


class ModelError(LocalspecError, RuntimeError):
    """A model cannot be loaded or used; the message says which file and what to do."""


class PromptError(ModelError):
    """The caller's prompt or messages cannot be used (empty, malformed, not valid Unicode text,
    longer than the context, a chat for a model without a chat template): the input is at fault,
    not the model (HTTP 400 naming the field: `param` where it is known, e.g.
    ``messages[2].tool_calls[0].function.arguments``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextFull(ModelError):
    """The KV cache has no room for a batch (llama.cpp left it as it was): a larger --ctx-size,
    or a shorter prompt or answer, is needed."""


class ConstraintError(ModelError):
    """The grammar matcher of a constrained generation and the tokens committed disagree (a
    token the grammar forbids was committed, a rollback past the grammar's start) or llguidance
    itself failed: a fault of localspec, never of the caller's grammar, which is checked before
    any decoding (bad grammars are :class:`ConfigError`)."""


class RemoteError(ModelError):
    """A llama.cpp RPC server is unreachable or stopped answering (HTTP 503 and 502: the server's
    upstream failed, not the client)."""

    def __init__(self, message: str, status: int = 502) -> None:
        super().__init__(message)
        self.status = status


class VerifierError(LocalspecError, ValueError):
    """Invalid input to the C verifier; the message names the argument and index at fault."""

    def __init__(self, message: str, status: int = 0, index: int = -1) -> None:
        super().__init__(message)
        self.status = status
        self.index = index


class RequestError(LocalspecError, ValueError):
    """A bad HTTP request: an OpenAI-style error with the parameter at fault and its status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


class BenchError(ConfigError):
    """A benchmark input that cannot be used (the message names the option or file)."""


class CheckFailed(LocalspecError, RuntimeError):
    """A check the user asked for ran and failed (losslessness checks, the verifier's self-test)."""


class FetchError(LocalspecError, RuntimeError):
    """A registry model could not be downloaded, assembled or verified."""


class ModelNotFound(LocalspecError, ValueError):
    """Neither an existing file nor a known registry model name."""


class DependencyError(LocalspecError, RuntimeError):
    """A dependency is missing (an extra such as ``localspec[server]``, a backend of the
    llama.cpp build) or outside the versions localspec was tested with
    (:mod:`localspec.dependencies`); the message says what to install."""


class Cancelled(LocalspecError):
    """The user stopped it: a load or fetch whose progress callback returned False (everything it
    had taken is freed), a call stopped before it had its pair (the message is the reason:
    "interrupted", "terminated", "gone" or "ending"), a decode stopped half-way. Not a failure: the
    command line exits as after Ctrl-C."""


class CallbackError(LocalspecError, RuntimeError):
    """A callback the caller gave (a load's progress callback) raised: what it was doing was
    stopped and cleaned up, and the message names the callback's exception (chained as the cause)."""


# ---------------------------------------------------------------- exit statuses

EXIT_INTERRUPTED = 130  # the shell's convention for SIGINT (Ctrl-C)
EXIT_TERMINATED = 143  # ... and for SIGTERM (128 + 15)
EXIT_CODES: dict[type[LocalspecError], int] = {  # the first class an error is an instance of
    ConfigError: 2,  # a usage error, as click's own (BenchError included)
    RemoteError: 3,  # an RPC server unreachable or gone (also when one dies mid-generation)
    CheckFailed: 1, ModelError: 1, VerifierError: 1, FetchError: 1, ModelNotFound: 1, DependencyError: 1,
    CallbackError: 1, Cancelled: EXIT_INTERRUPTED,  # stopped by the user, as Ctrl-C stops a command
}


def exit_code(error: LocalspecError | type[LocalspecError]) -> int:
    """The command line's exit status for an error (or an error class)."""
    error_type = error if isinstance(error, type) else type(error)
    return next((code for cls, code in EXIT_CODES.items() if issubclass(error_type, cls)), 1)
