"""What a request asks for and why it ended: its sampling record and its finish reasons.

:class:`SamplingParams` holds the limits the core enforces (length, stops, how
the text is decoded) and, opaque, how each token is drawn; a
:data:`FinishReason` says which of them ended the request (``max_new_tokens``:
:class:`FinishLength`; a stop or EOS token: :class:`FinishMatchedToken`; a stop
string: :class:`FinishMatchedStr`), or that it was aborted
(:class:`FinishAbort`). :class:`scheduler_svc.core.request.Req` checks them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """A request's sampling record as the core keeps it: the limits the core enforces
    (length, stops, how the text is decoded) and, as ``draw``, how each token is drawn.

    ``draw`` holds the wire's other sampling fields (``temperature``, ``top_p``...)
    by name; the core never reads it, the engine sends it to the worker. Empty:
    greedy. :meth:`of` splits a wire record into the two.
    """

    max_new_tokens: int = 128
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = frozenset()
    min_new_tokens: int = 0  # EOS / stop ids are masked out before this many tokens
    stop: tuple[str, ...] = ()
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    draw: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        object.__setattr__(self, "stop_token_ids", frozenset(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))

    @classmethod
    def of(cls, record: Mapping[str, Any], **decided: Any) -> SamplingParams:
        """From a wire record's fields: those named as this class's fields (``decided``
        overriding them), and every other one into ``draw``."""
        own = _LIMITS.intersection(record)
        limits = {name: record[name] for name in own}
        draw = {name: value for name, value in record.items() if name not in own}
        return cls(**{**limits, **decided}, draw=draw)

    @property
    def stop_str_max_len(self) -> int:
        return max(map(len, self.stop), default=0)

    def finish_reason(
        self,
        output_ids: list[int],
        eos_token_ids: Collection[int] = (),
        decode: Callable[[list[int]], str] | None = None,
    ) -> FinishReason | None:
        """Which limit ends a request that has generated ``output_ids`` (at least one), if any.

        The length limit is checked first; stop tokens and EOS are both
        ignored under ``ignore_eos`` and before ``min_new_tokens``; stop strings
        are looked for in the ``decode``d tail of the output (none without it).
        """
        if len(output_ids) >= self.max_new_tokens:
            return FinishLength(self.max_new_tokens)
        last = output_ids[-1]
        stops = len(output_ids) > self.min_new_tokens  # earlier ones are masked out
        if stops and not self.ignore_eos and (last in self.stop_token_ids or last in eos_token_ids):
            return FinishMatchedToken(last)
        if not self.stop or decode is None:
            return None
        # SGLang's tail check: as many tokens as the longest stop string has characters, plus one
        tail = decode(output_ids[-(self.stop_str_max_len + 1) :])
        matched = next((stop for stop in self.stop if stop in tail), None)
        return None if matched is None else FinishMatchedStr(matched)

    def suppressed_token_ids(self, generated: int, eos_token_ids: Collection[int]) -> list[int]:
        """What the next token may not be after ``generated`` tokens: EOS and the stop
        ids, before ``min_new_tokens``."""
        if generated >= self.min_new_tokens:
            return []
        return sorted(set(eos_token_ids) | self.stop_token_ids)


_LIMITS = frozenset(f.name for f in fields(SamplingParams)) - {"draw"}


@dataclass(frozen=True, slots=True)
class FinishLength:
    length: int

    def to_json(self) -> dict[str, Any]:
        return {"type": "length", "length": self.length}


class _FinishMatched:
    """A stop matched (SGLang's ``FINISH_MATCHED_*``): its JSON names what matched."""

    __slots__ = ()
    matched: int | str

    def to_json(self) -> dict[str, Any]:
        return {"type": "stop", "matched": self.matched}


@dataclass(frozen=True, slots=True)
class FinishMatchedToken(_FinishMatched):
    matched: int


@dataclass(frozen=True, slots=True)
class FinishMatchedStr(_FinishMatched):
    matched: str


@dataclass(frozen=True, slots=True)
class FinishAbort:
    message: str
    status_code: int

    def to_json(self) -> dict[str, Any]:
        return {"type": "abort", "message": self.message, "status_code": self.status_code}


FinishReason = FinishLength | FinishMatchedToken | FinishMatchedStr | FinishAbort
