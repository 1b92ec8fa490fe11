"""Typed errors raised by the model worker's core.

Each carries a stable ``code`` string, like the memsvc errors, so the service
shell can put it in an error reply without parsing messages.
"""

from __future__ import annotations


class ModelSvcError(Exception):
    """Base class of every model_svc error."""

    code = "internal"


class CheckpointError(ModelSvcError):
    """A checkpoint directory that cannot be loaded: missing, corrupt or mismatched.

    The message names the file (and the tensor, when one is at fault).
    """

    code = "bad_checkpoint"


class ModelLayoutError(ModelSvcError):
    """The KV pool's layout (layers, KV heads, head dim, page size, dtype) does not fit
    the model."""

    code = "layout_mismatch"


class InvalidBatchError(ModelSvcError, ValueError):
    """A forward batch that cannot be run: empty, a row twice, positions without a KV slot."""

    code = "invalid_batch"
