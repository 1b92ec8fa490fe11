"""``kvstack serve`` as SGLang's clients and OpenAI's client speak to it (issue 17), tiny model.

One server (the tiny model behind the HTTP front) serves the whole module:
SGLang's native endpoints, batch ``/generate``, every SGLang request field
(honoured, or accepted at its default and refused otherwise), SGLang's
validation, streamed ``meta_info``, logprobs, the OpenAI-compatible endpoints
through the official ``openai`` package and raw HTTP, and the ``sglang:``
metrics. Outputs are judged against the scheduler's own ZMQ client. The module
ends by checking that the pool is whole again (available + evictable ==
capacity) and that SIGTERM leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import json
import math
import signal
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstack.serve.metrics import ITL_BUCKETS, TTFT_BUCKETS
from kvstack.serve.sglang.fields import (
    FRONT_SAMPLING,
    GENERATE_DEFAULTS,
    SAMPLING_DEFAULTS,
    honoured_sampling,
)
from kvstack.serve.streaming import StreamMeta, StreamText
from model_svc.tiny import write_tiny_checkpoint
from model_svc.tokenizer import ByteTokenizer
from scheduler_svc.client import AsyncGenerateClient, GenerateResult
from tests.http.test_http_front import (
    Front,
    read_events,
    start_front,
    stop_and_check_clean,
    stop_front,
)

CAPACITY = 1024
CONTEXT = 512
POOL = ["--page-size", "4", "--num-pages", "256", "--max-context-len", str(CONTEXT)]
GREEDY = {"max_new_tokens": 6, "ignore_eos": True}
SERVED = "tiny-under-test"  # --served-model-name: /v1/models, model_info, metrics labels


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    workdir = tmp_path_factory.mktemp("sglang-api")
    checkpoint = write_tiny_checkpoint(workdir / "ckpt")
    front = start_front(
        workdir, "server", "--checkpoint", str(checkpoint), "--served-model-name", SERVED, *POOL
    )
    front.info["checkpoint"] = str(checkpoint)
    try:
        yield front
        # the pool is whole again: every page free or cached, none held by a request
        text = asyncio.run(_get_text(f"{front.url}/metrics"))
        tokens = {
            s.labels["state"]: s.value
            for f in text_string_to_metric_families(text)
            if f.name == "memsvc_tokens"
            for s in f.samples
        }
        assert tokens.get("used", 0) == 0, tokens
        assert tokens["available"] + tokens["evictable"] == CAPACITY, tokens
    finally:
        stop_and_check_clean(front)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _get_text(url: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(url) as response:
        assert response.status == 200
        return await response.text()


async def _request(method: str, url: str, body: Any = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http:
        kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
        async with http.request(method, url, **kwargs) as response:
            if response.content_type == "text/event-stream":
                return response.status, await read_events(response)
            if response.content_type == "application/json":
                return response.status, await response.json()
            return response.status, await response.text()


def post(server: Front, path: str, body: Any) -> tuple[int, Any]:
    return run(_request("POST", f"{server.url}{path}", body))


def get(server: Front, path: str) -> tuple[int, Any]:
    return run(_request("GET", f"{server.url}{path}"))


def zmq_generate(server: Front, **kwargs: Any) -> GenerateResult:
    async def go() -> GenerateResult:
        async with AsyncGenerateClient(server.info["scheduler"], timeout_s=60) as client:
            return await client.generate(**kwargs)

    return run(go())


def client(server: Front) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


# -- SGLang's native endpoints ----------------------------------------------------------------


def test_model_info_has_sglangs_keys(server: Front) -> None:
    for path in ("/get_model_info", "/model_info"):
        status, info = get(server, path)
        assert status == 200, info
        assert info["model_path"] == info["tokenizer_path"] == server.info["checkpoint"]
        assert info["is_generation"] is True
        assert info["architectures"] == ["LlamaForCausalLM"] and info["model_type"] == "llama"
        assert info["served_model_name"] == SERVED
        assert info["disaggregation_mode"] == "null"


def test_a_pd_front_reports_what_sglangs_pd_router_does() -> None:
    """SGLang's PD router relays /get_model_info from its first prefill server, so a client
    of a PD deployment reads "prefill"; "pd" is not one of SGLang's values."""
    from aiohttp.test_utils import TestClient, TestServer

    from kvstack.serve.app import Backend, HttpFront

    async def go() -> dict[str, Any]:
        front = HttpFront(Backend("ipc:///nonexistent/router.sock"), mode="pd", tokenizer=None)
        async with TestClient(TestServer(front.app())) as http:
            response = await http.get("/get_model_info")
            assert response.status == 200
            return await response.json()

    assert run(go())["disaggregation_mode"] == "prefill"


def test_server_info_under_both_names(server: Front) -> None:
    for path in ("/get_server_info", "/server_info"):
        status, info = get(server, path)
        assert status == 200, info
        assert info["max_total_num_tokens"] == CAPACITY and info["max_context_len"] == CONTEXT
        assert info["model_path"] == server.info["checkpoint"]
        assert isinstance(info["internal_states"], list) and info["version"]


def test_health_generate_generates_one_token(server: Front) -> None:
    async def go() -> tuple[int, int, dict, dict]:
        async with AsyncGenerateClient(server.info["scheduler"], timeout_s=10) as scheduler:
            before = (await scheduler.info())["stats"]
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{server.url}/health_generate") as response:
                    generate = response.status
                async with http.get(f"{server.url}/health") as response:
                    health = response.status
            return generate, health, before, (await scheduler.info())["stats"]

    generate, health, before, after = run(go())
    assert (generate, health) == (200, 200)
    assert after["finished_reqs"] == before["finished_reqs"] + 1  # it did generate


def test_health_generate_is_503_without_a_scheduler(tmp_path: Path) -> None:
    orphan = start_front(
        tmp_path,
        "orphan",
        "--scheduler",
        f"ipc://{tmp_path}/nobody.sock",
        "--model-path",
        "tiny",  # nobody to ask which model it is
        "--control-timeout",
        "0.5",
        "--request-timeout",
        "0.5",
    )
    try:
        status, body = run(_request("GET", f"{orphan.url}/health_generate"))
        models = run(_request("GET", f"{orphan.url}/v1/models"))
    finally:
        code = stop_front(orphan, signal.SIGINT, timeout=20)
    assert status == 503, body
    assert body["error"]["message"]
    assert models[0] == 200 and models[1]["data"][0]["max_model_len"] is None
    assert code == 0


def test_flush_cache_answers_as_sglang(server: Front) -> None:
    body = {"input_ids": list(range(40, 80)), "sampling_params": GREEDY}
    assert post(server, "/generate", body)[0] == 200
    status, text = post(server, "/flush_cache", None)
    assert status == 200 and text.startswith("Cache flushed.")
    again = post(server, "/generate", body)[1]
    assert again["meta_info"]["cached_tokens"] == 0  # the prefix was flushed
    assert get(server, "/flush_cache")[0] == 200


def test_flush_cache_refuses_while_requests_run(server: Front) -> None:
    async def go() -> tuple[int, str]:
        async with aiohttp.ClientSession() as http:
            body = {
                "input_ids": [1, 2, 3],
                "sampling_params": {"max_new_tokens": 400, "ignore_eos": True},
                "stream": True,
                "rid": "flush-busy",
            }
            async with http.post(f"{server.url}/generate", json=body) as response:
                assert (await response.content.readline()).startswith(b"data: {")
                async with http.post(f"{server.url}/flush_cache") as flush:
                    got = (flush.status, await flush.text())
                async with http.post(
                    f"{server.url}/abort_request", json={"rid": "flush-busy"}
                ) as abort:
                    assert (await abort.json())["found"] is True
                await read_events(response)
            return got

    status, text = run(go())
    assert status == 400 and "pending requests" in text, text


def test_v1_models_names_the_served_model(server: Front) -> None:
    status, models = get(server, "/v1/models")
    assert status == 200
    assert models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == SERVED and card["object"] == "model"
    assert card["max_model_len"] == CONTEXT and card["owned_by"] == "sglang"
    status, one = get(server, f"/v1/models/{card['id']}")
    assert status == 200 and one["id"] == card["id"]
    status, missing = get(server, "/v1/models/nope")
    assert status == 404 and missing["object"] == "error" and missing["code"] == 404


def test_abort_all_with_sglangs_empty_rid(server: Front) -> None:
    status, reply = post(server, "/abort_request", {"rid": "", "abort_all": True})
    assert status == 200 and reply == {"aborted": []}
    body = {"rid": "nope", "abort_message": None, "finished_reason": None}
    status, reply = post(server, "/abort_request", body)
    assert status == 200 and reply == {"rid": "nope", "found": False}
    status, reply = post(server, "/abort_request", {"rid": "nope", "abort_message": "why"})
    assert status == 400 and "abort_message" in reply["error"]["message"]


# -- /generate: batches, n, fields -------------------------------------------------------------


def test_batch_of_texts_answers_a_list_in_order(server: Front) -> None:
    texts = ["Hello", "Good morning", "Hi"]
    status, outs = post(
        server,
        "/generate",
        {"text": texts, "sampling_params": GREEDY, "rid": ["b0", "b1", "b2"]},
    )
    assert status == 200, outs
    assert [o["meta_info"]["id"] for o in outs] == ["b0", "b1", "b2"]
    for text, out in zip(texts, outs, strict=True):
        want = zmq_generate(server, text=text, sampling=GREEDY)
        assert out["output_ids"] == want.output_ids and out["text"] == want.text


def test_batch_of_input_ids_with_a_list_of_sampling_params(server: Front) -> None:
    prompts = [[5, 6, 7], [8, 9]]
    samplings = [
        {"max_new_tokens": 3, "ignore_eos": True},
        {"max_new_tokens": 5, "ignore_eos": True},
    ]
    status, outs = post(server, "/generate", {"input_ids": prompts, "sampling_params": samplings})
    assert status == 200, outs
    assert [len(o["output_ids"]) for o in outs] == [3, 5]
    for prompt, sampling, out in zip(prompts, samplings, outs, strict=True):
        assert (
            out["output_ids"]
            == zmq_generate(server, input_ids=prompt, sampling=sampling).output_ids
        )
    status, reply = post(
        server, "/generate", {"input_ids": prompts, "sampling_params": samplings[:1]}
    )
    assert status == 400 and "1 values for a batch of 2" in reply["error"]["message"]


def test_streamed_batch_tags_each_chunk_with_its_index(server: Front) -> None:
    prompts = [[5, 6, 7], [8, 9]]
    status, events = post(
        server,
        "/generate",
        {"input_ids": prompts, "sampling_params": GREEDY, "stream": True},
    )
    assert status == 200 and events[-1] == "[DONE]"
    lasts = {}
    for event in events[:-1]:
        assert event["index"] in (0, 1)
        if event["meta_info"]["finish_reason"] is not None:
            lasts[event["index"]] = event
    assert set(lasts) == {0, 1}
    for i, prompt in enumerate(prompts):
        assert (
            lasts[i]["output_ids"]
            == zmq_generate(server, input_ids=prompt, sampling=GREEDY).output_ids
        )


def test_a_client_that_leaves_a_streamed_batch_aborts_all_of_it(server: Front) -> None:
    sampling = {"max_new_tokens": 480, "ignore_eos": True}

    async def go() -> tuple[dict, dict]:
        async with AsyncGenerateClient(server.info["scheduler"], timeout_s=10) as scheduler:
            before = await scheduler.info()
            async with aiohttp.ClientSession() as http:
                body = {
                    "input_ids": [[4, 5, 6], [7, 8]],
                    "sampling_params": sampling,
                    "stream": True,
                }
                response = await http.post(f"{server.url}/generate", json=body)
                assert (await response.content.readline()).startswith(b"data: {")
                response.close()  # hang up mid-stream
            for _ in range(200):
                info = await scheduler.info()
                if info["stats"]["aborted_reqs"] >= before["stats"]["aborted_reqs"] + 2:
                    break
                await asyncio.sleep(0.05)
            return before, info

    before, after = run(go())
    assert after["stats"]["aborted_reqs"] == before["stats"]["aborted_reqs"] + 2
    assert after["stats"]["finished_reqs"] == before["stats"]["finished_reqs"]
    assert after["num_running"] == after["num_waiting"] == 0


def test_parallel_sampling_n(server: Front) -> None:
    sampling = {**GREEDY, "n": 3, "temperature": 1.0, "sampling_seed": 11}
    status, outs = post(
        server, "/generate", {"input_ids": [20, 21, 22], "sampling_params": sampling}
    )
    assert status == 200, outs
    assert len(outs) == 3
    one = {k: v for k, v in sampling.items() if k not in ("n", "sampling_seed")}
    for j, out in enumerate(outs):  # sample j is the request seeded 11 + j
        want = zmq_generate(server, input_ids=[20, 21, 22], sampling={**one, "seed": 11 + j})
        assert out["output_ids"] == want.output_ids
    status, reply = post(server, "/generate", {"text": "a", "sampling_params": {"n": 0}})
    assert status == 400 and "sampling_params.n" in reply["error"]["message"]


# What SGLang's own clients send with every request (bench_serving, RuntimeEndpoint).
SGLANG_CLIENT_DEFAULTS = {
    "lora_path": None,
    "return_logprob": False,
    "logprob_start_len": -1,
    "return_routed_experts": False,
    "custom_logit_processor": None,
    "return_hidden_states": False,
    "top_logprobs_num": 0,
    "token_ids_logprob": None,
    "image_data": None,
    "session_params": None,
    "log_metrics": True,
    "stream": False,
}


def test_the_defaults_sglangs_clients_send_pass(server: Front) -> None:
    body = {"text": "Hello", "sampling_params": {**GREEDY, "n": 1, "top_k": -1}}
    status, out = post(server, "/generate", {**body, **SGLANG_CLIENT_DEFAULTS})
    assert status == 200, out
    assert out["output_ids"] == zmq_generate(server, text="Hello", sampling=GREEDY).output_ids


def _non_default(default: Any) -> Any:
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 7
    if isinstance(default, float):
        return default + 0.5
    return "something"


REFUSED_SAMPLING = sorted(
    f for f in SAMPLING_DEFAULTS if f not in honoured_sampling() and f not in FRONT_SAMPLING
)


@pytest.mark.parametrize("field", sorted(GENERATE_DEFAULTS))
def test_every_generate_field_of_sglang(server: Front, field: str) -> None:
    default = GENERATE_DEFAULTS[field]
    base = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
    status, reply = post(server, "/generate", {**base, field: default})
    assert status == 200, reply
    status, reply = post(server, "/generate", {**base, field: _non_default(default)})
    assert status == 400, reply
    assert reply["error"]["code"] == "unsupported_field"
    assert field in reply["error"]["message"] and "not supported" in reply["error"]["message"]


@pytest.mark.parametrize("field", REFUSED_SAMPLING)
def test_every_sampling_field_of_sglang_kvstack_does_not_honour(server: Front, field: str) -> None:
    default = SAMPLING_DEFAULTS[field]
    for value in (default, None):
        sampling = {"max_new_tokens": 1, field: value}
        status, reply = post(
            server, "/generate", {"input_ids": [1, 2], "sampling_params": sampling}
        )
        assert status == 200, reply
    sampling = {"max_new_tokens": 1, field: _non_default(default)}
    status, reply = post(server, "/generate", {"input_ids": [1, 2], "sampling_params": sampling})
    assert status == 400, reply
    assert reply["error"]["code"] == "unsupported_field"
    assert f"sampling_params.{field}" in reply["error"]["message"]


def test_the_sampling_fields_kvstack_honours_include_sglangs_main_ones() -> None:
    assert {
        "stop",
        "stop_token_ids",
        "min_new_tokens",
        "min_p",
        "no_stop_trim",
    } <= honoured_sampling()
    assert {
        "skip_special_tokens",
        "temperature",
        "top_p",
        "top_k",
        "ignore_eos",
    } <= honoured_sampling()


def test_a_sampling_field_is_mapped_by_its_name_not_by_hand(monkeypatch) -> None:
    """SGLang's ``sampling_params`` and OpenAI's bodies reach the scheduler's sampling
    record by the record's field names (issue 27, item 3): a field the scheduler learns
    under a name both APIs share passes with no change in the front (OpenAI's bodies: once
    they declare it)."""
    from kvstack.serve.openai.protocol import CompletionIn
    from kvstack.serve.sglang import fields

    learned = {*honoured_sampling(), "frequency_penalty"}  # as if the scheduler learned it
    monkeypatch.setattr(fields, "honoured_sampling", lambda: learned)
    assert fields.sampling_to_kvstack({"frequency_penalty": 0.5}) == {"frequency_penalty": 0.5}
    body = CompletionIn.model_validate({"prompt": "a", "frequency_penalty": 0.5, "seed": 3})
    sampling = body.sampling(4)
    assert sampling["frequency_penalty"] == 0.5 and sampling["seed"] == 3
    assert sampling["max_new_tokens"] == 4 and "n" not in sampling


def _stop_in(text: str) -> tuple[int, str]:
    """A two-character ASCII stop string first found at ``at`` >= 1 in ``text``."""
    for at in range(1, len(text) - 1):
        stop = text[at : at + 2]
        if stop.isascii() and stop.isprintable() and stop not in text[: at + 1]:
            return at, stop
    raise AssertionError(f"no ASCII stop string in {text!r}")


def test_stop_strings_and_min_new_tokens(server: Front) -> None:
    free = post(
        server, "/generate", {"input_ids": [30, 31, 32], "sampling_params": {"max_new_tokens": 12}}
    )[1]
    text = free["text"]
    at, stop = _stop_in(text)
    status, out = post(
        server,
        "/generate",
        {"input_ids": [30, 31, 32], "sampling_params": {"max_new_tokens": 12, "stop": stop}},
    )
    assert status == 200, out
    assert out["text"] == text[:at]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    eos = ByteTokenizer.eos_ids[0]
    early = {"max_new_tokens": 8, "stop_token_ids": [free["output_ids"][0]], "min_new_tokens": 4}
    status, out = post(server, "/generate", {"input_ids": [30, 31, 32], "sampling_params": early})
    assert status == 200 and len(out["output_ids"]) >= 4 and eos not in out["output_ids"][:4]


def test_streamed_text_never_shows_a_stop_string(server: Front) -> None:
    free = post(
        server, "/generate", {"input_ids": [30, 31, 32], "sampling_params": {"max_new_tokens": 12}}
    )[1]
    at, stop = _stop_in(free["text"])
    body = {
        "input_ids": [30, 31, 32],
        "sampling_params": {"max_new_tokens": 12, "stop": [stop]},
        "stream": True,
    }
    status, events = post(server, "/generate", body)
    assert status == 200
    assert all(stop not in e["text"] for e in events[:-1])
    assert events[-2]["text"] == free["text"][:at]


# -- SGLang's validation ------------------------------------------------------------------------


VALIDATION = [
    (
        "top_k 0",
        {"text": "a", "sampling_params": {"top_k": 0}},
        "top_k must be -1 (disable) or at least 1, got 0.",
    ),
    ("top_k -2", {"text": "a", "sampling_params": {"top_k": -2}}, "top_k must be -1"),
    (
        "NaN",
        b'{"text": "a", "sampling_params": {"temperature": NaN}}',
        "sampling_params.temperature: NaN",
    ),
    (
        "Infinity",
        b'{"text": "a", "sampling_params": {"top_p": Infinity}}',
        "sampling_params.top_p: NaN and Infinity",
    ),
    ("-Infinity in ids", b'{"input_ids": [1, -Infinity]}', "input_ids[1]"),
    ("id past int64", {"input_ids": [2**63]}, "input_ids"),
    ("id below int64", {"input_ids": [-(2**63) - 1]}, "input_ids"),
    ("id out of the vocabulary", {"input_ids": [1, 300]}, "out of vocabulary"),
    (
        "context overflow",
        {"input_ids": [1] * 500, "sampling_params": {"max_new_tokens": 20}},
        "context length",
    ),
    ("unknown field", {"text": "a", "evil": 1}, "evil"),
    (
        "unknown sampling field",
        {"text": "a", "sampling_params": {"evil": 1}},
        "sampling_params.evil",
    ),
    ("empty batch", {"text": []}, "at least one prompt"),
    ("rid not a list for a batch", {"text": ["a", "b"], "rid": "x"}, "list of rids"),
    (
        "top_logprobs_num too large",
        {"text": "a", "return_logprob": True, "top_logprobs_num": 21},
        "top_logprobs_num",
    ),
]


@pytest.mark.parametrize(
    ("body", "needle"), [c[1:] for c in VALIDATION], ids=[c[0] for c in VALIDATION]
)
def test_sglang_validation_gives_a_400_naming_the_problem(
    server: Front, body: Any, needle: str
) -> None:
    status, reply = post(server, "/generate", body)
    assert status == 400, reply
    assert needle in reply["error"]["message"], reply
    assert get(server, "/health")[0] == 200


# -- streamed meta_info and logprobs ------------------------------------------------------------


def test_streamed_chunks_carry_full_meta_info(server: Front) -> None:
    body = {"input_ids": [40, 41, 42, 43], "sampling_params": GREEDY, "stream": True}
    status, events = post(server, "/generate", body)
    assert status == 200 and events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 2
    for k, event in enumerate(chunks):
        meta = event["meta_info"]
        for key in ("id", "prompt_tokens", "cached_tokens", "completion_tokens", "num_retractions"):
            assert key in meta, (k, meta)
        assert meta["prompt_tokens"] == 4
        assert meta["completion_tokens"] == len(event["output_ids"])
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}


def test_return_logprob_in_sglangs_shape(server: Front) -> None:
    body = {
        "input_ids": [50, 51, 52],
        "sampling_params": GREEDY,
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 3,
        "return_text_in_logprobs": True,
    }
    status, out = post(server, "/generate", body)
    assert status == 200, out
    meta = out["meta_info"]
    outputs = meta["output_token_logprobs"]
    assert [entry[1] for entry in outputs] == out["output_ids"]
    assert all(entry[0] <= 0 for entry in outputs)
    assert [entry[2] for entry in outputs] == [
        ByteTokenizer().decode([t], skip_special=False) for t in out["output_ids"]
    ]
    inputs = meta["input_token_logprobs"]
    assert [entry[1] for entry in inputs] == [50, 51, 52] and inputs[0][0] is None
    assert len(meta["output_top_logprobs"]) == 6 and all(
        len(t) == 3 for t in meta["output_top_logprobs"]
    )
    for (logprob, token, _), top in zip(outputs, meta["output_top_logprobs"], strict=True):
        assert top[0][1] == token and math.isclose(top[0][0], logprob, abs_tol=1e-5)  # greedy


def test_streamed_logprobs_are_cumulative(server: Front) -> None:
    body = {
        "input_ids": [50, 51, 52],
        "sampling_params": GREEDY,
        "return_logprob": True,
        "stream": True,
    }
    status, events = post(server, "/generate", body)
    assert status == 200
    chunks = events[:-1]
    for event in chunks:  # each chunk holds the logprobs of every token so far
        got = [entry[1] for entry in event["meta_info"]["output_token_logprobs"]]
        assert got == event["output_ids"]
    whole = post(server, "/generate", {**body, "stream": False})[1]
    assert (
        chunks[-1]["meta_info"]["output_token_logprobs"]
        == whole["meta_info"]["output_token_logprobs"]
    )


def test_stream_meta_incremental_sends_only_new_logprobs() -> None:
    meta = StreamMeta("r", incremental=True)
    first = meta.chunk({"output_token_logprobs": [[-1.0, 5, None]], "prompt_tokens": 2}, 1)
    second = meta.chunk({"output_token_logprobs": [[-2.0, 6, None]]}, 2)
    done = meta.done({"output_token_logprobs": [[-1.0, 5, None], [-2.0, 6, None], [-3.0, 7, None]]})
    assert first["output_token_logprobs"] == [[-1.0, 5, None]] and first["prompt_tokens"] == 2
    assert second["output_token_logprobs"] == [[-2.0, 6, None]]
    assert done["output_token_logprobs"] == [[-3.0, 7, None]]
    cumulative = StreamMeta("r", incremental=False)
    cumulative.chunk({"output_token_logprobs": [[-1.0, 5, None]]}, 1)
    assert cumulative.chunk({"output_token_logprobs": [[-2.0, 6, None]]}, 2)[
        "output_token_logprobs"
    ] == [
        [-1.0, 5, None],
        [-2.0, 6, None],
    ]


def test_stream_text_shows_special_tokens_when_asked() -> None:
    eos = ByteTokenizer.eos_ids[0]
    shown = StreamText(ByteTokenizer(), incremental=True, skip_special_tokens=False)
    assert shown.chunk([65, eos])["text"] == f"A<|{eos}|>"
    hidden = StreamText(ByteTokenizer(), incremental=True)
    assert hidden.chunk([65, eos])["text"] == "A"


def test_stream_text_holds_back_a_possible_stop_string() -> None:
    text = StreamText(ByteTokenizer(), incremental=True, stop=["STOP"])
    shown = [text.chunk(list(piece.encode()))["text"] for piece in ("ab", "cS", "TO", "P")]
    assert shown == ["ab", "c", "", ""]
    assert text.done(GenerateResult("r", [], "abc", {}))["text"] == ""
    text = StreamText(ByteTokenizer(), incremental=True, stop=["STOP"])
    shown = [text.chunk(list(piece.encode()))["text"] for piece in ("aS", "Tx")]
    assert "".join(shown) == "aSTx"  # not a stop string after all: shown once it is clear


# -- OpenAI's API, through the official client ----------------------------------------------------


def test_openai_models_list(server: Front) -> None:
    models = client(server).models.list()
    assert [m.id for m in models.data] == [SERVED]


def test_openai_completion_matches_generate(server: Front) -> None:
    api = client(server)
    model = SERVED
    got = api.completions.create(
        model=model, prompt="Hello", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    want = zmq_generate(server, text="Hello", sampling=GREEDY)
    (choice,) = got.choices
    assert choice.text == want.text and choice.finish_reason == "length"
    assert got.model == model and got.object == "text_completion"
    assert got.usage.prompt_tokens == 6 and got.usage.completion_tokens == 6
    assert got.usage.total_tokens == 12


def test_openai_completion_prompts_as_strings_and_ids(server: Front) -> None:
    api = client(server)
    model = SERVED
    extra = {"ignore_eos": True}
    texts = api.completions.create(
        model=model, prompt=["Hello", "Hi"], max_tokens=4, temperature=0, extra_body=extra
    )
    ids = api.completions.create(
        model=model, prompt=[[1, 2, 3], [4, 5]], max_tokens=4, temperature=0, extra_body=extra
    )
    one = api.completions.create(
        model=model, prompt=[1, 2, 3], max_tokens=4, temperature=0, extra_body=extra
    )
    sampling = {"max_new_tokens": 4, "ignore_eos": True}
    assert [c.text for c in texts.choices] == [
        zmq_generate(server, text=t, sampling=sampling).text for t in ("Hello", "Hi")
    ]
    assert [c.index for c in ids.choices] == [0, 1]
    assert (
        ids.choices[0].text
        == one.choices[0].text
        == zmq_generate(server, input_ids=[1, 2, 3], sampling=sampling).text
    )
    assert ids.usage.prompt_tokens == 5


def test_openai_completion_n_samples(server: Front) -> None:
    got = client(server).completions.create(
        model="any",
        prompt="Hello",
        max_tokens=5,
        n=2,
        temperature=1.0,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in got.choices] == [0, 1]
    for j, choice in enumerate(got.choices):
        sampling = {"max_new_tokens": 5, "ignore_eos": True, "temperature": 1.0, "seed": 3 + j}
        assert choice.text == zmq_generate(server, text="Hello", sampling=sampling).text
    assert got.usage.prompt_tokens == 6 and got.usage.completion_tokens == 10


def test_openai_completion_stream_with_usage(server: Front) -> None:
    stream = client(server).completions.create(
        model="x",
        prompt="Hello",
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    *texts, last = chunks
    assert (
        last.choices == [] and last.usage.completion_tokens == 6 and last.usage.prompt_tokens == 6
    )
    assert all(c.usage is None for c in texts)
    assert (
        "".join(c.choices[0].text for c in texts)
        == zmq_generate(server, text="Hello", sampling=GREEDY).text
    )
    assert texts[-1].choices[0].finish_reason == "length"


def test_openai_completion_stop_strings_and_ids(server: Front) -> None:
    api = client(server)
    free = api.completions.create(model="x", prompt=[30, 31, 32], max_tokens=12, temperature=0)
    text = free.choices[0].text
    stopped = api.completions.create(
        model="x", prompt=[30, 31, 32], max_tokens=12, temperature=0, stop=[_stop_in(text)[1]]
    )
    at, stop = _stop_in(text)
    assert stopped.choices[0].text == text[:at] and stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].model_extra["matched_stop"] == stop
    first_id = zmq_generate(
        server, input_ids=[30, 31, 32], sampling={"max_new_tokens": 12}
    ).output_ids[2]
    by_id = api.completions.create(
        model="x",
        prompt=[30, 31, 32],
        max_tokens=12,
        temperature=0,
        extra_body={"stop_token_ids": [first_id]},
    )
    assert by_id.choices[0].finish_reason == "stop"
    assert by_id.choices[0].model_extra["matched_stop"] == first_id
    assert by_id.usage.completion_tokens == 3


def test_openai_completion_logprobs(server: Front) -> None:
    got = client(server).completions.create(
        model="x",
        prompt=[50, 51, 52],
        max_tokens=4,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    logprobs = got.choices[0].logprobs
    native = post(
        server,
        "/generate",
        {
            "input_ids": [50, 51, 52],
            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
            "return_logprob": True,
            "top_logprobs_num": 2,
        },
    )[1]["meta_info"]
    assert logprobs.token_logprobs == pytest.approx(
        [e[0] for e in native["output_token_logprobs"]], abs=1e-5
    )
    decode = ByteTokenizer().decode
    assert logprobs.tokens == [
        decode([e[1]], skip_special=False) for e in native["output_token_logprobs"]
    ]
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0


def test_openai_completion_echo(server: Front) -> None:
    api = client(server)
    extra = {"ignore_eos": True}
    want = zmq_generate(server, text="Hello", sampling={"max_new_tokens": 4, "ignore_eos": True})
    whole = api.completions.create(
        model="x", prompt="Hello", max_tokens=4, temperature=0, echo=True, extra_body=extra
    )
    assert whole.choices[0].text == "Hello" + want.text
    stream = api.completions.create(
        model="x",
        prompt="Hello",
        max_tokens=4,
        temperature=0,
        echo=True,
        stream=True,
        extra_body=extra,
    )
    assert "".join(c.choices[0].text for c in stream) == "Hello" + want.text
    scored = api.completions.create(
        model="x",
        prompt=[50, 51, 52],
        max_tokens=3,
        temperature=0,
        echo=True,
        logprobs=1,
        extra_body=extra,
    )
    logprobs = scored.choices[0].logprobs
    decode = ByteTokenizer().decode
    ids = [
        50,
        51,
        52,
        *zmq_generate(
            server, input_ids=[50, 51, 52], sampling={"max_new_tokens": 3, "ignore_eos": True}
        ).output_ids,
    ]
    assert logprobs.tokens == [decode([t], skip_special=False) for t in ids]
    assert logprobs.token_logprobs[0] is None and all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert logprobs.top_logprobs[0] is None and len(logprobs.top_logprobs[1]) == 1


EMPTY_PROMPTS = [
    ("text", "/generate", {"text": ""}),
    ("input_ids", "/generate", {"input_ids": []}),
    ("one of a batch of texts", "/generate", {"text": ["a", ""]}),
    ("one of a batch of ids", "/generate", {"input_ids": [[1, 2], []]}),
    ("streamed", "/generate", {"text": "", "stream": True}),
    ("completion", "/v1/completions", {"prompt": ""}),
    ("completion list", "/v1/completions", {"prompt": [""]}),
    ("completion empty list", "/v1/completions", {"prompt": []}),
    ("completion ids", "/v1/completions", {"prompt": [[]]}),
    ("completion streamed", "/v1/completions", {"prompt": "", "stream": True}),
    ("completion echo", "/v1/completions", {"prompt": "", "echo": True}),
]


@pytest.mark.parametrize(
    ("path", "body"), [c[1:] for c in EMPTY_PROMPTS], ids=[c[0] for c in EMPTY_PROMPTS]
)
def test_an_empty_prompt_is_sglangs_400(server: Front, path: str, body: Any) -> None:
    """Nothing to prefill: SGLang's 400 "Prompt cannot be empty", in the endpoint's error
    shape, before anything reaches the scheduler (the tiny model's bos would otherwise make
    an empty text a one-token prompt)."""
    status, reply = post(server, path, body)
    assert status == 400, reply
    if path.startswith("/v1/"):
        assert reply == {
            "object": "error",
            "message": "Prompt cannot be empty",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    else:
        assert reply == {"error": {"message": "Prompt cannot be empty", "code": "invalid_request"}}
    assert get(server, "/health")[0] == 200


def test_openai_chat_without_a_template_is_a_clear_400(server: Front) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client(server).chat.completions.create(
            model="x", messages=[{"role": "user", "content": "hi"}]
        )
    assert caught.value.status_code == 400
    assert "chat template" in caught.value.body["message"]


def test_openai_errors_have_openais_shape(server: Front) -> None:
    api = client(server)
    with pytest.raises(openai.BadRequestError) as caught:
        api.completions.create(model="x", prompt="a", max_tokens=2, extra_body={"top_k": 0})
    body = caught.value.body
    assert set(body) == {"object", "message", "type", "param", "code"}
    assert body["object"] == "error" and body["code"] == 400 and body["type"] == "BadRequestError"
    assert "top_k must be -1" in body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        api.completions.create(model="x", prompt="a", max_tokens=2, best_of=3)
    assert caught.value.body["param"] == "best_of" and "best_of" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        api.completions.create(model="x", prompt="a", max_tokens=2, frequency_penalty=0.5)
    assert caught.value.body["param"] == "frequency_penalty"


RAW_OPENAI_ERRORS = [
    ("not json", "/v1/completions", b"{", None),
    ("no prompt", "/v1/completions", {"model": "x"}, "prompt"),
    ("unknown field", "/v1/completions", {"prompt": "a", "evil": 1}, "evil"),
    ("NaN", "/v1/completions", b'{"prompt": "a", "temperature": NaN}', "temperature"),
    ("max_tokens 0", "/v1/completions", {"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ("n too large", "/v1/completions", {"prompt": "a", "n": 1000}, "n"),
    ("suffix", "/v1/completions", {"prompt": "a", "suffix": "b"}, "suffix"),
    (
        "continuous usage",
        "/v1/completions",
        {"prompt": "a", "stream": True, "stream_options": {"continuous_usage_stats": True}},
        "stream_options.continuous_usage_stats",
    ),
    ("no messages", "/v1/chat/completions", {"model": "x", "messages": []}, "messages"),
    (
        "tools",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a"}], "tools": [{}]},
        "tools",
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [c[1:] for c in RAW_OPENAI_ERRORS],
    ids=[c[0] for c in RAW_OPENAI_ERRORS],
)
def test_raw_openai_errors(server: Front, path: str, body: Any, param: str | None) -> None:
    status, reply = post(server, path, body)
    assert status == 400, reply
    assert reply["object"] == "error" and reply["code"] == 400 and reply["message"]
    assert reply["param"] == param


def test_raw_sse_of_a_completion(server: Front) -> None:
    body = {
        "prompt": [1, 2, 3],
        "max_tokens": 3,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }

    async def go() -> tuple[str, str]:
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{server.url}/v1/completions", json=body) as response,
        ):
            return response.headers["Content-Type"], await response.text()

    content_type, text = run(go())
    assert content_type.startswith("text/event-stream")
    frames = [f for f in text.split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames)
    assert frames[-1] == "data: [DONE]"
    objects = [json.loads(f[len("data: ") :]) for f in frames[:-1]]
    assert all(o["object"] == "text_completion" for o in objects)
    assert objects[-1]["choices"][0]["finish_reason"] == "length"
    assert len({o["id"] for o in objects}) == 1


# -- metrics ------------------------------------------------------------------------------------


def test_sglang_metrics_under_sglangs_names(server: Front) -> None:
    def scrape() -> dict[str, Any]:
        text = run(_get_text(f"{server.url}/metrics"))
        return {f.name: f for f in text_string_to_metric_families(text)}

    def value(families: dict, family: str, sample: str, **labels: str) -> float:
        return sum(
            s.value
            for s in families[family].samples
            if s.name == sample and labels.items() <= s.labels.items()
        )

    model = SERVED
    before = scrape()
    prompt = list(range(60, 69))
    stream_body = {"input_ids": prompt, "sampling_params": GREEDY, "stream": True}
    assert post(server, "/generate", stream_body)[0] == 200
    assert post(server, "/generate", {**stream_body, "stream": False})[0] == 200  # cached
    after = scrape()
    labels = {"model_name": model, "engine_type": "unified"}
    for streaming in ("true", "false"):
        lab = {**labels, "is_streaming": streaming}
        for family, sample, delta in [
            ("sglang:num_requests", "sglang:num_requests_total", 1),
            ("sglang:prompt_tokens", "sglang:prompt_tokens_total", 9),
            ("sglang:generation_tokens", "sglang:generation_tokens_total", 6),
            ("sglang:time_to_first_token_seconds", "sglang:time_to_first_token_seconds_count", 1),
            ("sglang:e2e_request_latency_seconds", "sglang:e2e_request_latency_seconds_count", 1),
        ]:
            got = value(after, family, sample, **lab) - value(before, family, sample, **lab)
            assert got == delta, (family, streaming, got)
    itl = "sglang:inter_token_latency_seconds"
    # each token after a request's first is observed once (a chunk of k: k times)
    itl_count = value(after, itl, f"{itl}_count", **labels) - value(
        before, itl, f"{itl}_count", **labels
    )
    assert 2 <= itl_count <= 10
    cached = value(
        after, "sglang:cached_tokens", "sglang:cached_tokens_total", cache_source="total"
    )
    assert (
        cached
        - value(before, "sglang:cached_tokens", "sglang:cached_tokens_total", cache_source="total")
        >= 4
    )
    buckets = {
        float(s.labels["le"])
        for s in after["sglang:time_to_first_token_seconds"].samples
        if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"
    }
    assert buckets == set(TTFT_BUCKETS)
    itl_buckets = {
        float(s.labels["le"])
        for s in after[itl].samples
        if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"
    }
    assert itl_buckets == set(ITL_BUCKETS)
    assert "kvstack_http_requests" in after  # next to kvstack's own


def test_health_generate_is_not_counted_in_sglangs_metrics(server: Front) -> None:
    def requests() -> float:
        text = run(_get_text(f"{server.url}/metrics"))
        return sum(
            s.value
            for f in text_string_to_metric_families(text)
            if f.name == "sglang:num_requests"
            for s in f.samples
            if s.name == "sglang:num_requests_total"
        )

    before = requests()
    assert get(server, "/health_generate")[0] == 200
    assert requests() == before
