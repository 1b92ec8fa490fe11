"""The worker's logprobs (SGLang's return_logprob): chosen token, top-k, the prompt's.

Checked against the dense reference's log-softmax: prompt positions scored by the
token after them (across chunks, where that token is the next chunk's first),
top-k in order, temperature-scaled output logprobs for a sampled request, and
the masks (``suppress_token_ids``, ``min_p``) that SGLang's min_new_tokens and
min_p are.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from memsvc import protocol as wire
from model_svc import handlers
from model_svc.client import ForwardError, _Ops, _result
from model_svc.handlers import AttachedPool, ModelService
from model_svc.reference import dense_logits
from model_svc.sampling import SamplingParams, sample, sampling_logprobs, top_logprobs

PROMPT = [5, 17, 3, 99, 42, 8, 8, 61, 120, 7, 33, 2, 250, 14]


class InProcess(_Ops):
    """model_svc's client ops, answered by a ModelService in this process."""

    def __init__(self, service: ModelService) -> None:
        self.service = service

    def _invoke(self, header, arrays):
        return _result(wire.unpack(self.service.handle(wire.pack({**header, "op_id": 1}, arrays))))


@pytest.fixture
def worker(bound_pool):
    bp = bound_pool(4)
    service = ModelService(bp.model, lambda: AttachedPool("epoch", bp.attached))
    yield bp, InProcess(service)
    bp.model.unbind()


def open_request(bp, rid: str, length: int) -> int:
    bp.pool.open_request(rid)
    assert bp.pool.alloc_extend([(rid, length)]) is not None
    return bp.pool.request(rid).row


@pytest.mark.parametrize("block", [256, 4])  # positions made into logits at a time
def test_prompt_logprobs_match_the_dense_reference_across_chunks(
    worker, tiny_model, monkeypatch, block: int
) -> None:
    monkeypatch.setattr(handlers, "INPUT_LOGITS_BLOCK", block)
    bp, client = worker
    want = torch.log_softmax(dense_logits(tiny_model, PROMPT), -1)
    row = open_request(bp, "r", len(PROMPT))
    start, cut = 3, 9  # logprobs from prompt position 3; the prefill in chunks [0, 9), [9, 14)
    spec = {"logprobs": True, "top_logprobs_num": 3}
    first = client.extend(
        [(row, 0, PROMPT[:cut])], [spec], logprob_starts=[start], next_token_ids=[PROMPT[cut]]
    )
    second = client.extend([(row, cut, PROMPT[cut:])], [spec], logprob_starts=[0])
    entries = [first.input_logprobs[0], second.input_logprobs[0]]
    got = entries[0]["logprobs"] + entries[1]["logprobs"]
    sampled = int(second.next_token_ids[0])
    targets = [*PROMPT[start + 1 :], sampled]  # each position scores the token after it
    expected = [float(want[p, t]) for p, t in zip(range(start, len(PROMPT)), targets, strict=True)]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    tops = entries[0]["top"] + entries[1]["top"]
    for position, (values, ids) in zip(range(start, len(PROMPT)), tops, strict=True):
        best = want[position].topk(3)
        assert ids == best.indices.tolist()
        np.testing.assert_allclose(values, best.values.tolist(), rtol=1e-5, atol=1e-5)
    # The sampled (greedy) token: its logprob and top-k are the last position's.
    assert sampled == int(want[-1].argmax())
    assert second.logprobs[0] == pytest.approx(float(want[-1, sampled]), abs=1e-5)
    values, ids = second.top_logprobs[0]
    assert ids == want[-1].topk(3).indices.tolist()
    bp.pool.release("r", PROMPT, is_insert=False)
    bp.pool.check_integrity(idle=True)


def test_bad_logprob_arrays_are_refused_and_write_nothing(worker) -> None:
    bp, client = worker
    row = open_request(bp, "r", len(PROMPT))
    before = bp.kv_snapshot()
    bad = [
        {"logprob_starts": [-1]},
        {"logprob_starts": [0, 0]},
        {"logprob_starts": [0], "next_token_ids": [10**6]},
        {"next_token_ids": [1]},
    ]
    for arrays in bad:
        with pytest.raises(ForwardError) as err:
            client.extend([(row, 0, PROMPT)], [{}], **arrays)
        assert err.value.code == "invalid_batch", arrays
    assert (bp.kv_snapshot() == before).all()
    bp.pool.release("r", PROMPT, is_insert=False)
    bp.pool.check_integrity(idle=True)


def test_no_logprob_fields_unless_asked(worker) -> None:
    bp, client = worker
    row = open_request(bp, "r", len(PROMPT))
    out = client.extend([(row, 0, PROMPT)], [{}])
    assert out.logprobs is None and out.top_logprobs is None and out.input_logprobs is None
    # A start at the end of the new tokens asks for no prompt position.
    bp.pool.release("r", PROMPT, is_insert=False)
    row = open_request(bp, "s", len(PROMPT))
    out = client.extend([(row, 0, PROMPT)], [{}], logprob_starts=[len(PROMPT)])
    assert out.input_logprobs == [None]
    bp.pool.release("s", PROMPT, is_insert=False)
    bp.pool.check_integrity(idle=True)


def test_logprobs_are_of_the_distribution_sampled_from() -> None:
    """Greedy: the raw logits' log-softmax; sampling: over the temperature (SGLang's)."""
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.5, 2.5]])
    params = [SamplingParams(logprobs=True), SamplingParams(temperature=2.0, seed=3, logprobs=True)]
    tokens, logprobs = sample(logits, params, [0, 0])
    raw = torch.log_softmax(logits[0], -1)[tokens[0]]
    scaled = torch.log_softmax(logits[1] / 2.0, -1)[tokens[1]]
    torch.testing.assert_close(logprobs, torch.stack([raw, scaled]))
    rows = sampling_logprobs(logits, params)
    assert top_logprobs(rows, [2, 0]) == [
        (rows[0, [1, 2]].tolist(), [1, 2]),
        None,
    ]


def test_top_logprobs_ties_keep_vocabulary_order() -> None:
    rows = torch.log_softmax(torch.tensor([[1.0, 3.0, 3.0, 0.0]]), -1)
    assert top_logprobs(rows, [3])[0][1] == [1, 2, 0]


def test_suppressed_ids_are_never_chosen_and_get_no_mass() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, -1.0]])
    param = SamplingParams(logprobs=True, suppress_token_ids=(1,), top_logprobs_num=4)
    tokens, logprobs = sample(logits, [param], [0])
    assert int(tokens[0]) == 2  # the best one left
    masked = logits.clone()
    masked[0, 1] = -math.inf
    assert float(logprobs[0]) == pytest.approx(float(torch.log_softmax(masked, -1)[0, 2]))
    for seed in range(30):
        drawn = SamplingParams(temperature=1.0, seed=seed, suppress_token_ids=(1, 2))
        assert int(sample(logits, [drawn], [seed])[0][0]) in (0, 3)


def test_min_p_drops_the_unlikely_tail() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = set()
    for seed in range(200):
        param = SamplingParams(temperature=1.0, seed=seed, min_p=0.4)  # keeps p >= 0.2
        kept.add(int(sample(logits, [param], [seed])[0][0]))
    assert kept == {0, 1}
    loose = {
        int(sample(logits, [SamplingParams(temperature=1.0, seed=s)], [s])[0][0])
        for s in range(200)
    }
    assert loose == {0, 1, 2, 3}
