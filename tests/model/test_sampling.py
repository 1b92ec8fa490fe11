"""Sampling: greedy by default; seeded draws fixed by (seed, position); top-k, top-p, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from model_svc.sampling import GREEDY, SamplingParams, sample, seed_from_rid

LOGITS = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 2.5]])


def test_greedy_is_argmax_and_logprobs_are_the_models() -> None:
    tokens, logprobs = sample(LOGITS, [GREEDY, GREEDY], [0, 0])
    assert tokens.tolist() == [1, 0] and logprobs is None
    params = [SamplingParams(logprobs=True), SamplingParams(temperature=5.0, top_k=1)]
    tokens, logprobs = sample(LOGITS, params, [0, 0])
    assert tokens.tolist() == [1, 0]
    torch.testing.assert_close(logprobs, torch.log_softmax(LOGITS, -1)[[0, 1], [1, 0]])


def test_same_seed_and_position_draw_the_same_token() -> None:
    params = SamplingParams(temperature=1.0, seed=1234)
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    draws = [int(sample(logits, [params], [pos])[0]) for pos in range(40)]
    again = [int(sample(logits, [params], [pos])[0]) for pos in range(40)]
    assert draws == again
    assert len(set(draws)) > 10  # the position changes the draw
    # Neighbours in the batch do not change a request's draw.
    batch = torch.cat([torch.randn(3, 50), logits])
    mixed = [GREEDY, SamplingParams(temperature=2.0, seed=9), GREEDY, params]
    assert int(sample(batch, mixed, [5, 5, 5, 7])[0][3]) == draws[7]
    other_seed = [
        int(sample(logits, [SamplingParams(temperature=1.0, seed=99)], [p])[0]) for p in range(40)
    ]
    assert other_seed != draws


def test_draws_follow_the_distribution_top_k_and_top_p() -> None:
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))

    def frequencies(params: SamplingParams, n: int = 3000) -> list[float]:
        counts = [0, 0, 0]
        for pos in range(n):
            counts[int(sample(logits, [params], [pos])[0])] += 1
        return [c / n for c in counts]

    plain = frequencies(SamplingParams(temperature=1.0, seed=3))
    assert all(
        math.isclose(f, p, abs_tol=0.03) for f, p in zip(plain, [0.6, 0.3, 0.1], strict=True)
    )
    top_k = frequencies(SamplingParams(temperature=1.0, top_k=2, seed=3), 1000)
    assert top_k[2] == 0 and math.isclose(top_k[0], 2 / 3, abs_tol=0.05)
    assert frequencies(SamplingParams(temperature=1.0, top_p=0.5, seed=3), 200) == [1.0, 0, 0]
    top_p = frequencies(SamplingParams(temperature=1.0, top_p=0.8, seed=3), 1000)
    assert top_p[2] == 0 and top_p[1] > 0.2


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1.0},
        {"temperature": math.inf},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": 0},
        {"seed": 1.5},
    ],
)
def test_invalid_params(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_seed_from_rid_is_stable() -> None:
    assert seed_from_rid("req-1") == seed_from_rid("req-1") != seed_from_rid("req-2")
    assert 0 <= seed_from_rid("req-1") < 2**64


def test_one_bad_row_never_breaks_the_batch() -> None:
    """float32 edge values and NaN logits draw a token for their own row only (issue 18)."""
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]] * 4)
    logits[3] = torch.tensor([float("nan"), 1.0, float("nan"), 3.0])
    params = [
        SamplingParams(temperature=1e-300, seed=1),  # SGLang: below _SAMPLING_EPS is greedy
        SamplingParams(temperature=1.0, top_p=1e-46, seed=2),  # 0 in float32: top token only
        SamplingParams(temperature=0.7, seed=3),
        SamplingParams(temperature=1.0, seed=4),
    ]
    assert params[0].is_greedy and not params[1].is_greedy
    tokens, _ = sample(logits, params, [5, 5, 5, 5])
    assert tokens[:2].tolist() == [1, 1]
    alone, _ = sample(logits[2:3], params[2:3], [5])
    assert int(tokens[2]) == int(alone[0])  # its neighbours change nothing
    assert int(tokens[3]) in (1, 3)  # NaN logits are never chosen
    nothing = torch.full((1, 4), float("nan"))
    assert sample(nothing, [SamplingParams(temperature=1.0, seed=5)], [0])[0].shape == (1,)
