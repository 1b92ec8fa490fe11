"""The demo's requests: one long prompt that nearly fills the pool, and short ones beside it.

On a model with a chat template (SmolLM2) they are chat prompts, rendered with
the checkpoint's template: the long one asks for a summary of a passage cut to
length, the short ones are questions, each with the answer shown at the end.
On the tiny random model (``--model tiny``) they are random byte ids, as no
answer would mean anything.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from model_svc.tokenizer import Tokenizer

Request = tuple[str, list[int], int]  # rid, prompt ids, max_new_tokens

LONG_SHARE = 0.78  # of the pool, taken by the long prompt
LONG_NEW_TOKENS = 40

PASSAGE = (
    "A language model writes its answer one token at a time. For every token it has "
    "already read or written, it keeps two vectors per layer, a key and a value, so "
    "that the next step does not recompute them. These vectors are the KV cache, and "
    "they grow with every request that runs. A server that admits many requests at "
    "once therefore has to guess how long their answers will be: if it guesses too "
    "low, memory runs out in the middle of decoding. It must then pick a request, "
    "take its memory back and run it again later. This is called retraction. The "
    "victim's cache can simply be dropped and rebuilt by another prefill, which costs "
    "compute, or it can be copied to host memory and copied back when there is room "
    "again, which costs bandwidth. Either way the answer must come out exactly as if "
    "nothing had happened, token for token. A careful server also learns from each "
    "retraction and becomes more cautious about how many requests it admits, then "
    "slowly grows bolder again while decoding goes well. Prefix caching adds another "
    "twist: finished requests leave their cache behind in a tree, so that a new "
    "request starting with the same words can reuse it, and that cached memory is "
    "the first to be evicted when space runs short."
)

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "How many legs does a spider have?",
    "Why is the sky blue?",
    "Give me a tip for learning to cook.",
    "What is photosynthesis?",
    "Name three planets of the solar system.",
    "What does a bee make?",
    "Write one sentence about autumn.",
    "How do airplanes stay in the air?",
    "What is the boiling point of water?",
    "Suggest a name for a pet turtle.",
    "What is a prime number?",
    "Describe a rainbow in one sentence.",
    "What do pandas eat?",
]


@dataclass
class Workload:
    requests: list[Request]
    questions: dict[str, str] = field(default_factory=dict)  # rid -> the user's message


def random_workload(seed: int, count: int, capacity: int) -> Workload:
    """One request whose prompt fills 78% of ``capacity``, then ``count`` short ones.

    Each short one is small enough to be admitted beside the long one (its
    prompt plus a page plus its whole ``max_new_tokens`` fits what the long
    one's optimistic reservation leaves) and long-lived enough that the two
    outgrow the pool before either finishes: decoding runs out of memory.
    """
    rng = random.Random(seed)
    long_len = int(capacity * LONG_SHARE)
    reqs = [("long", [rng.randrange(256) for _ in range(long_len)], LONG_NEW_TOKENS)]
    for i in range(count):
        prompt = [rng.randrange(256) for _ in range(rng.randint(4, 12))]
        reqs.append((f"short-{i}", prompt, rng.randint(28, 31)))
    return Workload(reqs)


def chat_workload(tokenizer: Tokenizer, seed: int, count: int, capacity: int) -> Workload:
    """The same shape as :func:`random_workload`, as chat prompts of ``tokenizer``'s template.

    The long prompt asks for a summary of :data:`PASSAGE`, cut by whole words
    to the longest that stays within 78% of ``capacity``; the short ones are
    ``count`` of :data:`QUESTIONS` in a seeded order.
    """
    template = tokenizer.chat_template
    if template is None:
        raise ValueError("the checkpoint has no chat template; use --model tiny")
    if count > len(QUESTIONS):
        raise ValueError(f"--requests {count}: at most {len(QUESTIONS)} with a real model")

    def prompt(message: str) -> list[int]:
        return tokenizer.encode(template.render([{"role": "user", "content": message}]))

    words = PASSAGE.split()
    budget = int(capacity * LONG_SHARE)
    ask = "Summarize this passage in two sentences.\n\n"
    long_ids = prompt(ask + PASSAGE)
    while len(long_ids) > budget and len(words) > 1:
        words.pop()
        long_ids = prompt(ask + " ".join(words))
    rng = random.Random(seed)
    questions = rng.sample(QUESTIONS, count)
    reqs = [("long", long_ids, LONG_NEW_TOKENS)]
    reqs += [(f"short-{i}", prompt(q), rng.randint(28, 31)) for i, q in enumerate(questions)]
    asked = {"long": ask.strip() + f" ({len(words)} words)"}
    asked |= {f"short-{i}": q for i, q in enumerate(questions)}
    return Workload(reqs, asked)
