"""The multi-turn chat workload of ``bench/hicache.py``: its prompts in SmolLM2's chat
template, token for token, and what the client saw of each reply.

The workload's shape (flags, sizes, seeding) is described in ``bench/hicache.py``.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SYSTEM_TEXT = (
    "You are Kestrel, the support assistant of a company that builds serving "
    "software for large language models. Answer in plain English, briefly and "
    "precisely. When a question is about memory, explain which part of the "
    "system holds the data (the GPU's KV pool, host memory, or the disk) and "
    "why. When a question is about latency, say which step dominates: the queue, "
    "the prefill of the prompt, or the decode of the answer. Never invent "
    "numbers; if the user gives you measurements, reason from them. If a request "
    "is ambiguous, state the reading you chose in one sentence and answer it. "
    "Prefer short lists over long paragraphs, and finish every answer with one "
    "line that starts with 'In short:'. The product has four parts: a memory "
    "service that owns the KV cache pages and the radix prefix tree, a scheduler "
    "that admits requests and retracts them under memory pressure, a model "
    "worker that runs the forward passes in place on the shared pool, and an "
    "HTTP front that speaks the native and the OpenAI API. "
)
TOPICS = (
    "prefix caching",
    "retraction under memory pressure",
    "paged attention",
    "chunked prefill",
    "host memory offload",
    "disaggregated prefill and decode",
    "the new token ratio",
    "page sizes",
)
USER_TEXT = (
    "Here are my notes on {topic} from our deployment, turn {turn} of our "
    "review. We run {n} replicas, each with a pool sized for about {m} thousand "
    "tokens, and the chats we serve are long: users paste whole documents and "
    "come back to them many times. Our dashboards show the cache hit rate "
    "falling whenever traffic peaks, and the time to the first token rising at "
    "the same moments. Question {turn}: what does {topic} change for a chat like "
    "this one, and what should we watch first? "
)


@dataclass
class Turn:
    """One reply as the client saw it."""

    ttft_s: float
    e2e_s: float
    output_ids: list[int]
    meta_info: dict[str, Any]


@dataclass
class Chat:
    """One conversation: its turns' new tokens, and what it has said so far."""

    name: str
    user_turns: list[list[int]]  # turn t's new tokens: user message rendered, assistant opened
    history: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)


class Workload:
    """Token-level chats in SmolLM2's (ChatML) template, built with the model's tokenizer."""

    def __init__(self, checkpoint: Path, args: argparse.Namespace) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        self.args = args
        self.system_ids = self._system_ids(args.system_len)
        self.end_of_turn = self._encode("<|im_end|>\n")

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _system_ids(self, length: int) -> list[int]:
        """``<|im_start|>system\\n`` + the system text, repeated as needed, cut to ``length``."""
        head = self._encode("<|im_start|>system\n")
        body = self._encode(SYSTEM_TEXT * (1 + length // 100))
        return head + body[: max(length - len(head), 0)] + self._encode("<|im_end|>\n")

    def _user_ids(self, rng: random.Random, turn: int) -> list[int]:
        topic = rng.choice(TOPICS)
        text = USER_TEXT.format(
            topic=topic, turn=turn + 1, n=rng.randint(2, 64), m=rng.randint(8, 512)
        )
        body = self._encode(text * (1 + self.args.user_len // 80))[: self.args.user_len]
        return (
            self._encode("<|im_start|>user\n")
            + body
            + self._encode("<|im_end|>\n<|im_start|>assistant\n")
        )

    def chats(self, round_index: int) -> list[Chat]:
        """Fresh chats: the round's tag in the system prompt's first tokens keeps rounds apart."""
        rng = random.Random(f"{self.args.seed}-{round_index}")
        tag = self._encode(f"Session {round_index}. ")
        chats = []
        for i in range(self.args.conversations):
            turns = [self._user_ids(rng, t) for t in range(self.args.turns)]
            chat = Chat(f"r{round_index}-c{i}", turns)
            head = self.system_ids[:3]
            chat.history = head + tag + self.system_ids[3:]
            chats.append(chat)
        return chats

    def working_set(self) -> tuple[int, int]:
        """(distinct tokens of every final history, the longest history) for one round."""
        chats = self.chats(0)
        system_len = len(chats[0].history)
        per_chat = [
            sum(len(u) + self.args.output_len + len(self.end_of_turn) for u in c.user_turns)
            for c in chats
        ]
        return system_len + sum(per_chat), system_len + max(per_chat)
