"""Errors that cross module boundaries, and the contract's error kinds.

`ConfigError` is the one exception the CLI turns into a single stderr line and
exit code 2: anything the user can fix by changing input (flags, environment,
settings file, scenario file, run directory) raises it with a message that
names the problem and the fix.
"""

from __future__ import annotations

from typing import Final, Literal


class ConfigError(Exception):
    """Bad user input: printed as one line, exit code 2, never a traceback."""


class HarnessError(RuntimeError):
    """A child process tokenload depends on (Locust, the simulator) failed.

    Printed as one line naming the log to read, exit code 1: not the user's
    input, and not a bug to show a traceback for.
    """


# The contract's `error_kind` values. `client_error` means a bug of ours and must stay
# at zero in tests.
AUTH: Final = "auth"
NOT_FOUND_MODEL: Final = "not_found_model"
BAD_BASE_URL: Final = "bad_base_url"
RATE_LIMITED: Final = "rate_limited"
OVERLOADED: Final = "overloaded"
SERVER_ERROR: Final = "server_error"
BAD_REQUEST: Final = "bad_request"
CONTEXT_LENGTH: Final = "context_length"
TIMEOUT_FIRST_TOKEN: Final = "timeout_first_token"
TIMEOUT_STALL: Final = "timeout_stall"
DISCONNECTED: Final = "disconnected"
CONNECTION_REFUSED: Final = "connection_refused"
MALFORMED_STREAM: Final = "malformed_stream"
CLIENT_ERROR: Final = "client_error"

ERROR_KINDS: Final = (
    AUTH,
    NOT_FOUND_MODEL,
    BAD_BASE_URL,
    RATE_LIMITED,
    OVERLOADED,
    SERVER_ERROR,
    BAD_REQUEST,
    CONTEXT_LENGTH,
    TIMEOUT_FIRST_TOKEN,
    TIMEOUT_STALL,
    DISCONNECTED,
    CONNECTION_REFUSED,
    MALFORMED_STREAM,
    CLIENT_ERROR,
)

ErrorKind = Literal[
    "auth", "not_found_model", "bad_base_url", "rate_limited", "overloaded", "server_error",
    "bad_request", "context_length", "timeout_first_token", "timeout_stall", "disconnected",
    "connection_refused", "malformed_stream", "client_error",
]
ErrorClass = Literal["config", "input", "load", "client"]

# Why a request failed decides what its failure means. `config`: the channel is
# misconfigured (every request will fail the same way; stop and point at doctor).
# `input`: this request's body was refused (too long a prompt, a bad field); it says
# nothing about the channel's capacity. `load`: the channel pushed back or broke
# under the load we offered, or went down after it had answered (a refused connection
# then is an outage, not a wrong address); only these count towards an error rate
# under load, live (stop rules) and in the analysis alike. `client`: our own bug.
ERROR_CLASSES: Final[dict[str, ErrorClass]] = {
    AUTH: "config",
    NOT_FOUND_MODEL: "config",
    BAD_BASE_URL: "config",
    BAD_REQUEST: "input",
    CONTEXT_LENGTH: "input",
    RATE_LIMITED: "load",
    OVERLOADED: "load",
    SERVER_ERROR: "load",
    TIMEOUT_FIRST_TOKEN: "load",
    TIMEOUT_STALL: "load",
    DISCONNECTED: "load",
    CONNECTION_REFUSED: "load",
    MALFORMED_STREAM: "load",
    CLIENT_ERROR: "client",
}
CONFIG_KINDS: Final = frozenset(k for k, c in ERROR_CLASSES.items() if c == "config")
LOAD_KINDS: Final = frozenset(k for k, c in ERROR_CLASSES.items() if c == "load")


def error_class(kind: str | None) -> ErrorClass | None:
    """The class of an error kind (None for a success); an unknown kind counts as load."""
    if not kind:
        return None
    return ERROR_CLASSES.get(kind, "load")


# The fix a user should try for each kind, in the words users know them by.
FIXES: Final[dict[str, str]] = {
    AUTH: "check the key: it must be the one you created, with no stray space or newline, and not deleted or expired",
    NOT_FOUND_MODEL: "use a model id this channel serves (tokenload doctor lists them where the channel offers /v1/models)",
    BAD_BASE_URL: "point --base-url at the API endpoint, not the site's home page or dashboard; relays often need the /api path part",
    RATE_LIMITED: "lower the concurrency or request rate, or wait for the retry-after period; the channel's rate limit was hit",
    OVERLOADED: "the channel is overloaded: retry at off-peak time or lower the load",
    SERVER_ERROR: "the channel returned a server error: retry later or report it to the channel's operator",
    BAD_REQUEST: "the channel rejected the request body: check the model id, max tokens and extra body fields",
    CONTEXT_LENGTH: "the prompt plus max tokens exceeds the model's context window: send shorter prompts or a lower max_tokens",
    TIMEOUT_FIRST_TOKEN: "no token before the first-token timeout: the channel is queueing or stuck; lower the load, or raise the timeout (--timeout, or first_token_timeout_s in a scenario)",
    TIMEOUT_STALL: "the stream stalled between tokens past the idle timeout: the channel or a proxy is stuck",
    DISCONNECTED: "the connection closed before the stream ended: a proxy or the channel dropped it",
    CONNECTION_REFUSED: ("the channel refused connections after it had answered: the server (or the relay) went "
                         "down mid-run; check that it is running and read its log for a crash or restart"),
    MALFORMED_STREAM: "the stream was not valid server-sent events for this protocol: check --protocol and the base URL",
    CLIENT_ERROR: "this is a tokenload bug: please report it with the run's manifest.json",
}
