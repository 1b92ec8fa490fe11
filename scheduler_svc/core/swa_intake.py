"""The intake refusal (400) of a hybrid model's request the SWA pool could never serve.

- :func:`check_swa_fits`: a request whose SWA requirement
  (:func:`swa_requirement`, from the budgets of :mod:`scheduler_svc.core.swa_budget`)
  exceeds the SWA pool, or (chunked) whose one-page progress does not fit it
  (:func:`swa_chunk_progress_tokens`), or (normal node) whose decoding alone
  would outgrow it (:func:`swa_decode_peak_tokens`).
"""

from __future__ import annotations

from scheduler_svc.core.admission import ceil_page, floor_page
from scheduler_svc.core.errors import RequestTooLargeError
from scheduler_svc.core.swa_budget import (
    SwaSpec,
    estimate_swa_kv_tokens,
    prealloc_required_tokens,
)


def swa_requirement(
    input_len: int,
    spec: SwaSpec,
    *,
    mode: str,
    reserved: int = 0,
    chunked_prefill_size: int | None = None,
    max_new_tokens: int = 1,
) -> int:
    """The SWA slots a request with an ``input_len``-token prompt needs at once, alone.

    PD decode node: SGLang's ``_check_if_req_exceed_kv_capacity``, the SWA half
    of :func:`prealloc_required_tokens` (tail prealloc only; without it the
    prompt itself, as SGLang caps the pool at the SWA pool's size then).
    Otherwise: admission's SWA reservation (:class:`SwaPrefillGate`) of the
    prompt with ``max_new_tokens`` of output (what admission checks:
    ``min(max_new, clip)``; at least 1); with chunked prefill, of its smallest
    chunk (one page), since the gate cuts the chunk of a request that could
    never fit down to what the pool takes.
    """
    if mode == "decode":
        if not spec.uses_tail_prealloc:
            return input_len
        return prealloc_required_tokens(input_len, spec.page_size, reserved, spec)[1]
    paged = ceil_page(input_len, spec.page_size)
    if chunked_prefill_size is not None:
        paged = min(paged, spec.page_size)
    output = max(max_new_tokens, 1)
    return estimate_swa_kv_tokens(paged, output, spec.sliding_window, spec.page_size)


def swa_chunk_progress_tokens(input_len: int, spec: SwaSpec) -> int:
    """The SWA slots a chunked prefill of an ``input_len``-token prompt needs at once,
    alone, to go on one page at a time (the least admission falls back to).

    memsvc frees a row's SWA pages below ``floor_page(s_prev + 1 − W)``
    before each allocation (``s_prev``: the start of its previous one, here the
    previous chunk's, a page back): a page-sized chunk at ``s`` then needs the
    pages from there to ``s`` plus its own; at most ``2 × page + ceil_page(W − 1)``,
    and never more than the pages of every position up to the first decoded one,
    ``ceil_page(input_len + 1)``.
    """
    page = spec.page_size
    steady = 2 * page + ceil_page(max(spec.sliding_window - 1, 0), page)
    return min(steady, ceil_page(input_len + 1, page))


def swa_decode_peak_tokens(input_len: int, max_new_tokens: int, spec: SwaSpec) -> int:
    """The most SWA slots a request of ``input_len`` prompt tokens holds at once while it
    decodes ``max_new_tokens`` tokens, alone (0 if it decodes no step).

    A decode step allocates position ``p`` (from ``input_len`` to ``input_len +
    max_new_tokens − 2``) after memsvc frees the row's SWA pages below
    ``floor_page(p − W)`` (the previous step started at ``p − 1``), so it holds
    ``ceil_page(p + 1) − floor_page(p − W)``: growing until ``p`` passes the
    window, then repeating page by page.
    """
    page, window = spec.page_size, spec.sliding_window
    last = input_len + max_new_tokens - 2
    if last < input_len:
        return 0
    stop = min(last, max(input_len, window) + 2 * page)
    return max(
        ceil_page(p + 1, page) - floor_page(max(0, p - window), page)
        for p in range(input_len, stop + 1)
    )


def check_swa_fits(
    input_len: int,
    spec: SwaSpec | None,
    *,
    mode: str,
    reserved: int = 0,
    chunked_prefill_size: int | None = None,
    max_new_tokens: int = 1,
) -> None:
    """Reject at intake (400) a request whose SWA requirement exceeds the SWA pool.

    A decode node refuses ``swa_required > size_swa`` as SGLang does; a normal
    or prefill node one whose reservation admission could never take
    (``>= size_swa``: admission's SWA check is strict), and, with chunked
    prefill, one whose page-by-page progress (:func:`swa_chunk_progress_tokens`)
    the SWA pool cannot hold; a normal node also one whose decoding alone would
    outgrow it (:func:`swa_decode_peak_tokens`). Not hybrid: nothing.
    """
    if spec is None:
        return
    needed = swa_requirement(
        input_len,
        spec,
        mode=mode,
        reserved=reserved,
        chunked_prefill_size=chunked_prefill_size,
        max_new_tokens=max_new_tokens,
    )
    too_large = needed > spec.capacity if mode == "decode" else needed >= spec.capacity
    if not too_large and mode != "decode" and chunked_prefill_size is not None:
        progress = swa_chunk_progress_tokens(input_len, spec)
        if progress > spec.capacity:
            raise RequestTooLargeError(
                f"Request prompt exceeds the SWA KV memory budget: a chunked prefill of "
                f"input_len={input_len} tokens needs {progress} SWA KV tokens at once to "
                f"progress (one page chunk and its sliding window {spec.sliding_window}, "
                f"page size {spec.page_size}), SWA pool capacity={spec.capacity} tokens"
            )
    if not too_large and mode == "normal":
        peak = swa_decode_peak_tokens(input_len, max_new_tokens, spec)
        if peak > spec.capacity:
            raise RequestTooLargeError(
                f"Request exceeds the SWA KV memory budget: decoding {max_new_tokens} tokens "
                f"after input_len={input_len} needs up to {peak} SWA KV tokens at once "
                f"(sliding window {spec.sliding_window} and the pages it straddles, page size "
                f"{spec.page_size}), SWA pool capacity={spec.capacity} tokens"
            )
    if too_large:
        raise RequestTooLargeError(
            f"Request prompt exceeds the SWA KV memory budget: input_len={input_len} tokens "
            f"need {needed} SWA KV tokens (sliding window {spec.sliding_window}), "
            f"SWA pool capacity={spec.capacity} tokens"
        )
