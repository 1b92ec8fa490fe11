"""Stop strings, min_new_tokens and the done text, on the request and the service alone."""

from __future__ import annotations

from model_svc.tokenizer import ByteTokenizer
from scheduler_svc.core import Req, SamplingParams
from scheduler_svc.replies import output_text

TOKENIZER = ByteTokenizer()


def running(params: SamplingParams, **kw) -> Req:
    req = Req("r", [1, 2, 3], params, stop_decoder=lambda ids: TOKENIZER.decode(ids), **kw)
    req.start_prefill(row=1, prefix_len=0, extend_len=3)
    req.complete_extend()
    return req


def feed(req: Req, text: str, eos: tuple[int, ...] = ()) -> int:
    """Append ``text``'s bytes one token at a time until the request finishes; how many."""
    for i, byte in enumerate(text.encode()):
        req.append_token(byte)
        if i == 0:
            if req.check_finished(eos):
                return 1
            req.start_decode()
            continue
        req.kv_len = req.seq_len - 1  # as a decode step's KV write would
        if req.check_finished(eos):
            return i + 1
    return -1


def text_of(req: Req) -> str:
    return output_text(TOKENIZER, req)


def test_a_stop_string_across_tokens_finishes_at_its_last_byte() -> None:
    req = running(SamplingParams(max_new_tokens=50, stop=("lo w", "zz")))
    assert feed(req, "hello world") == 7
    assert req.finish_reason.to_json() == {"type": "stop", "matched": "lo w"}
    assert text_of(req) == "hel"


def test_no_stop_trim_keeps_the_stop_string_and_the_stop_token() -> None:
    req = running(SamplingParams(max_new_tokens=50, stop=("or",), no_stop_trim=True))
    feed(req, "hello world")
    assert text_of(req) == "hello wor"
    req = running(SamplingParams(max_new_tokens=50, stop_token_ids=frozenset({ord("w")})))
    feed(req, "hello world")
    assert req.finish_reason.to_json() == {"type": "stop", "matched": ord("w")}
    assert text_of(req) == "hello "  # the stop token's text is trimmed
    kept = SamplingParams(max_new_tokens=50, stop_token_ids=frozenset({119}), no_stop_trim=True)
    req = running(kept)
    feed(req, "hello world")
    assert text_of(req) == "hello w"


def test_min_new_tokens_holds_back_stop_ids_and_eos() -> None:
    params = SamplingParams(max_new_tokens=50, min_new_tokens=4, stop_token_ids=frozenset({5}))
    req = running(params)
    assert req.suppressed_token_ids((257,)) == [5, 257]
    req.append_token(5)
    assert not req.check_finished((257,))  # a stop id before min_new_tokens does not end it
    req.start_decode()
    for token in (6, 7, 8):
        req.kv_len = req.seq_len - 1
        assert req.suppressed_token_ids((257,)) == [5, 257]
        req.append_token(token)
        assert not req.check_finished((257,))
    assert req.suppressed_token_ids((257,)) == []  # 4 tokens out: free to stop
    req.kv_len = req.seq_len - 1
    req.append_token(257)
    assert req.check_finished((257,))
    assert req.finish_reason.to_json() == {"type": "stop", "matched": 257}


def test_skip_special_tokens_decides_how_the_text_reads() -> None:
    req = running(SamplingParams(max_new_tokens=3, skip_special_tokens=False))
    feed(req, "a")
    req.kv_len = req.seq_len - 1
    req.append_token(256)
    req.kv_len = req.seq_len - 1
    req.append_token(ord("b"))
    assert req.check_finished()
    assert text_of(req) == "a<|256|>b"
    req = running(SamplingParams(max_new_tokens=3))
    feed(req, "a")
    req.kv_len = req.seq_len - 1
    req.append_token(256)
    req.kv_len = req.seq_len - 1
    req.append_token(ord("b"))
    assert req.check_finished()
    assert text_of(req) == "ab"
