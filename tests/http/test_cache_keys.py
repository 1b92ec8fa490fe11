"""``cache_salt`` and ``extra_key`` from the HTTP body to memsvc's namespace (issue 30), no I/O.

SGLang 0.5.23's rules on ``/generate`` (``GenerateReqInput``'s single and batch
normalisation), its OpenAI server's on ``/v1/*`` (strings, "" for none), then what
the scheduler makes of them: one namespace per request, on the request, on each
memsvc call that opens a row, in the resubmission fingerprints.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvstack.serve.errors import ApiError
from kvstack.serve.openai import protocol as oai
from kvstack.serve.sglang.protocol import parse_generate, validate_body
from memsvc.namespace import DEFAULT_NAMESPACE, is_namespace, namespace_of
from scheduler_svc import protocol as p
from scheduler_svc.core import Req
from scheduler_svc.engine.base import EngineBase
from scheduler_svc.engine.prefill_round import PrefillRound
from scheduler_svc.generation import CacheKeys, Generation, LogprobArgs
from scheduler_svc.intake import fingerprint, new_req
from scheduler_svc.pd import flight


def keys(body: dict[str, Any]) -> list[tuple[str | None, str | None]]:
    return [(one.cache_salt, one.extra_key) for one in parse_generate(body).items]


def refused(body: dict[str, Any]) -> str:
    with pytest.raises(ApiError) as caught:
        parse_generate(body)
    assert caught.value.status == 400
    return caught.value.message


# -- /generate: SGLang's rules ---------------------------------------------------------


def test_a_single_prompt_takes_strings_and_reads_the_empty_one_as_none() -> None:
    assert keys({"text": "a", "cache_salt": "s", "extra_key": "k"}) == [("s", "k")]
    assert keys({"text": "a", "cache_salt": "", "extra_key": None}) == [(None, None)]
    assert keys({"text": "a"}) == [(None, None)]


@pytest.mark.parametrize("value", [["s"], 3, {"a": 1}, True])
def test_a_single_prompt_refuses_anything_but_a_string(value: Any) -> None:
    for name in ("cache_salt", "extra_key"):
        message = refused({"text": "a", name: value})
        assert message == f"{name} should be a string for a single request."


def test_a_batch_takes_one_string_for_all_or_one_per_prompt() -> None:
    assert keys({"text": ["a", "b"], "cache_salt": "s"}) == [("s", None), ("s", None)]
    body = {"input_ids": [[1, 2], [3, 4]], "cache_salt": ["x", ""], "extra_key": ["k", "j"]}
    assert keys(body) == [("x", "k"), (None, "j")]


def test_parallel_samples_share_their_prompts_keys() -> None:
    body = {"text": ["a", "b"], "cache_salt": ["x", "y"], "sampling_params": {"n": 2}}
    assert keys(body) == [("x", None), ("x", None), ("y", None), ("y", None)]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (["s"], "The length of cache_salt should be equal to the batch size."),
        (["s", "t", "u"], "The length of cache_salt should be equal to the batch size."),
        (["s", None], "Every cache_salt should be a string."),
        (["s", 1], "Every cache_salt should be a string."),
        (7, "cache_salt should be a list or a string."),
    ],
)
def test_a_batch_refuses_what_sglang_refuses(value: Any, message: str) -> None:
    assert refused({"text": ["a", "b"], "cache_salt": value}) == message
    extra = message.replace("cache_salt", "extra_key")
    assert refused({"text": ["a", "b"], "extra_key": value}) == extra


def test_a_key_past_the_cap_is_refused() -> None:
    assert "at most" in refused({"text": "a", "cache_salt": "x" * (p.MAX_CACHE_KEY_LEN + 1)})
    assert keys({"text": "a", "cache_salt": "x" * p.MAX_CACHE_KEY_LEN})[0][0] is not None


# -- the OpenAI routes ----------------------------------------------------------------


def test_completions_carry_the_keys_to_every_prompt_and_sample() -> None:
    body = oai.CompletionIn.model_validate(
        {"prompt": ["a", "b"], "n": 2, "cache_salt": "s", "extra_key": "k"}
    )
    ones = oai.generate_ones(body, body.prompts(), max_new_tokens=[4, 4], top_logprobs=None)
    assert [(o.cache_salt, o.extra_key) for o in ones] == [("s", "k")] * 4


def test_chat_reads_an_empty_salt_as_none_and_refuses_a_list() -> None:
    body = oai.ChatIn.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "cache_salt": ""}
    )
    ones = oai.generate_ones(body, [{"input_ids": [1, 2]}], max_new_tokens=[4], top_logprobs=None)
    assert (ones[0].cache_salt, ones[0].extra_key) == (None, None)
    with pytest.raises(ApiError) as caught:
        validate_body(
            oai.ChatIn, {"messages": [{"role": "user", "content": "hi"}], "cache_salt": ["a"]}
        )
    assert caught.value.status == 400 and caught.value.param == "cache_salt"


# -- the scheduler: one namespace per request -----------------------------------------


def generate(**fields: Any) -> p.Generate:
    return p.Generate(
        op="generate", op_id=1, rid="r", client="c", input_ids=np.arange(1, 9), **fields
    )


def test_the_namespace_is_the_pair_and_default_without_one() -> None:
    assert generate().namespace == DEFAULT_NAMESPACE
    salted = generate(cache_salt="a").namespace
    assert is_namespace(salted) and salted != DEFAULT_NAMESPACE
    assert salted == namespace_of("a", None)
    assert generate(extra_key="a").namespace not in (salted, DEFAULT_NAMESPACE)
    # SGLang's OpenAI server concatenates salt + extra_key; kvstack keeps the boundary
    assert generate(cache_salt="ab").namespace != generate(cache_salt="a", extra_key="b").namespace


def test_the_request_keeps_its_namespace_and_resubmissions_tell_them_apart() -> None:
    ids = list(range(1, 9))
    req, _ = new_req(
        generate(cache_salt="a"),
        ids,
        capacity=1024,
        page_size=4,
        mode="normal",
        stop_decoder=lambda ids: "",
    )
    assert req.namespace == namespace_of("a", None)
    assert fingerprint(ids, generate(cache_salt="a")) != fingerprint(ids, generate(cache_salt="b"))
    assert fingerprint(ids, generate()) == fingerprint(ids, generate())
    assert flight.fingerprint(generate(cache_salt="a")) != flight.fingerprint(generate())


def test_flush_cache_names_a_namespace_only_with_a_key() -> None:
    assert p.FlushCache(op="flush_cache", op_id=1).namespace is None
    flush = p.FlushCache(op="flush_cache", op_id=1, cache_salt="a")
    assert flush.namespace == generate(cache_salt="a").namespace


def test_the_client_sends_the_keys_set_and_nothing_else() -> None:
    client = SimpleNamespace(address="x", resubmits=0, client_id="c")
    plain = Generation(client, [1, 2], None, None, "r", False, None, LogprobArgs())
    assert "cache_salt" not in plain.header and "extra_key" not in plain.header
    salted = Generation(client, [1, 2], None, None, "r", False, None, LogprobArgs(), CacheKeys("s"))
    assert salted.header["cache_salt"] == "s" and "extra_key" not in salted.header
    assert p.parse_request(salted.frames(1)).namespace == namespace_of("s", None)


class RecordingMem:
    """memsvc's two row-opening calls, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, dict[str, Any]]] = []

    async def admit(self, items: Any, **kwargs: Any) -> str:
        self.calls.append(("admit", [rid for rid, _ in items], kwargs))
        return "reply"

    async def alloc_row(self, rid: str, **kwargs: Any) -> int:
        self.calls.append(("alloc_row", rid, kwargs))
        return 0


def test_memsvc_opens_each_row_in_its_requests_namespace() -> None:
    salted, plain = Req("a", [1, 2, 3]), Req("b", [1, 2, 3])
    salted.namespace = namespace_of("s", None)
    mem = RecordingMem()
    engine = SimpleNamespace(mem=mem, hierarchical=False)
    asyncio.run(PrefillRound._admit(engine, [plain]))  # type: ignore[arg-type]
    asyncio.run(PrefillRound._admit(engine, [plain, salted]))  # type: ignore[arg-type]
    asyncio.run(EngineBase.open_row(engine, salted))  # type: ignore[arg-type]
    asyncio.run(EngineBase.open_row(engine, plain))  # type: ignore[arg-type]
    assert mem.calls == [
        ("admit", ["b"], {}),
        ("admit", ["b", "a"], {"namespaces": ["", salted.namespace]}),
        ("alloc_row", "a", {"namespace": salted.namespace}),
        ("alloc_row", "b", {"namespace": ""}),
    ]
