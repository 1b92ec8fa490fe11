"""Typed errors raised by the scheduler core.

Each carries a stable ``code`` string for the service shell's error replies,
and the request-level ones an HTTP-style ``status_code``. A core call that
raises has changed nothing.
"""

from __future__ import annotations


class SchedulerError(Exception):
    """Base class of every scheduler-core error."""

    code = "internal"


class ConfigError(SchedulerError, ValueError):
    """The scheduler configuration (arguments or ``SGLANG_*`` environment) is invalid.

    The service refuses to start on it.
    """

    code = "config"


class IllegalTransitionError(SchedulerError, RuntimeError):
    """A request was asked to change state in a way its state machine forbids."""

    code = "illegal_transition"


class RequestTooLargeError(SchedulerError, ValueError):
    """A prompt that can never fit the KV pool, whatever else is running."""

    code = "request_too_large"
    status_code = 400
