"""The workloads of ``bench/hicache.py``: seeded synthetic conversations, token for token.

Four kinds (:data:`KINDS`), each a set of conversations that send turns one
after another, a turn's prompt being the whole history so far (token for token,
the model's own replies included) plus the turn's new tokens, rendered in
SmolLM2's (ChatML) template:

- ``docs``, long shared documents: one long system prompt shared by every
  chat, each turn a long user passage (the original ``bench/hicache.py``);
- ``chat``, multi-turn chat with short turns (issue 34's): a short shared
  system prompt, a few dozen new tokens per turn, some chats in flight at a time;
- ``agent``, agentic traces: a shared instruction prompt, a task, then each
  step appends a tool output of a few hundred tokens to a context that keeps
  growing; a few agents in parallel;
- ``unique``, the no-reuse control: one-turn prompts that share nothing (each
  opens with its own ticket line), so no cache of any tier can hit.

Nothing is downloaded: the texts are templates filled from a seeded
``random.Random``. A checkpoint without a tokenizer (the bundled ``tiny``
model) gets each word's CRC mapped into its vocabulary instead, so equal texts
are still equal token ids. ``Workload.chats(round)`` gives fresh conversations
per round: the round's tag in the first tokens keeps rounds from hitting what
an earlier round cached.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field, replace
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
AGENT_TEXT = (
    "You are an operations agent with shell access to a fleet of inference "
    "servers. Each step, call exactly one tool: run(command), read(path) or "
    "done(summary). Read the tool output that follows each call before the next "
    "one. Prefer commands that print little; never restart a server that is "
    "serving traffic; report what you changed and why when you call done. "
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
TASK_TEXT = "Task {n}: the replica {host} reports {topic} problems since {hour}:00; find out why. "
TOOL_LINE = (
    "[{hour:02d}:{minute:02d}:{second:02d}] {host} {level} {topic}: {value} ms over {n} steps\n"
)
TICKET_TEXT = "Ticket {n}-{k}, filed at {hour}:{minute:02d} by team {team}. "


@dataclass(frozen=True)
class Spec:
    """One workload's shape: per round, ``conversations`` of ``turns`` turns each."""

    kind: str
    conversations: int
    turns: int
    system_len: int  # shared prefix (0: nothing shared)
    turn_len: int  # new tokens per turn (user passage, tool output or prompt body)
    output_len: int  # reply tokens per turn (greedy, ignore_eos)
    in_flight: int  # conversations served at a time (a chat holds its slot to its end)
    pressures: tuple[float, ...]  # working set / device pool, one cell each


# Scaled to fit the whole default matrix (3 rounds and a warm-up one) in about 35 minutes
# on two CPU cores. ``docs`` has enough conversations (8 x 6 turns, 4 in flight) for a
# tight cell: at pressure 6 the pool holds about one longest history (612 tokens), a sixth
# of the working set.
KINDS: dict[str, Spec] = {
    "docs": Spec("docs", 8, 6, 128, 64, 4, 4, (0.8, 2.0, 6.0)),
    "chat": Spec("chat", 8, 4, 120, 24, 8, 4, (0.8, 2.0, 4.0)),
    "agent": Spec("agent", 5, 4, 192, 224, 8, 5, (0.8, 2.0, 4.0)),
    "unique": Spec("unique", 16, 1, 0, 192, 8, 4, (0.8, 4.0)),
}
QUICK: dict[str, Spec] = {
    "docs": Spec("docs", 2, 2, 64, 48, 2, 2, (0.8, 3.0)),
    "chat": Spec("chat", 3, 2, 48, 16, 2, 2, (3.0,)),
    "agent": Spec("agent", 2, 3, 48, 48, 2, 2, (3.0,)),
    "unique": Spec("unique", 4, 1, 0, 48, 2, 2, (3.0,)),
}


def sized(spec: Spec, **overrides: Any) -> Spec:
    """``spec`` with the overrides that are not None."""
    return replace(spec, **{k: v for k, v in overrides.items() if v is not None})


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
    user_turns: list[list[int]]  # turn t's new tokens: message rendered, assistant opened
    history: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)


class Encoder:
    """Text to token ids: the checkpoint's tokenizer, or (none there) words hashed into its
    vocabulary, deterministic across processes."""

    def __init__(self, checkpoint: Path) -> None:
        self.tokenizer = None
        if (checkpoint / "tokenizer.json").is_file() or (
            checkpoint / "tokenizer_config.json"
        ).is_file():
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(checkpoint)
            self.vocab = len(self.tokenizer)
        else:
            import json

            config = json.loads((checkpoint / "config.json").read_text())
            self.vocab = int(config["vocab_size"]) - 8  # clear of the special ids at the top

    def __call__(self, text: str) -> list[int]:
        if self.tokenizer is not None:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return [zlib.crc32(word.encode()) % self.vocab for word in text.split()]


def fill(encode: Encoder, text_of: Any, length: int) -> list[int]:
    """Token ids of ``text_of(i)`` for i = 0, 1, ... joined until ``length``, cut there."""
    ids: list[int] = []
    index = 0
    while len(ids) < length:
        ids += encode(text_of(index))
        index += 1
    return ids[:length]


class Workload:
    """A :class:`Spec`'s conversations, built with the model's tokenizer (or its stand-in)."""

    def __init__(self, encode: Encoder, spec: Spec, seed: int) -> None:
        self.encode = encode
        self.spec = spec
        self.seed = seed
        self.end_of_turn = encode("<|im_end|>\n")
        system = SYSTEM_TEXT if spec.kind != "agent" else AGENT_TEXT
        self.system_ids = self._message("system", fill(encode, lambda i: system, spec.system_len))

    def _message(self, role: str, body: list[int], *, reply: bool = False) -> list[int]:
        out = self.encode(f"<|im_start|>{role}\n") + body + self.end_of_turn
        return out + self.encode("<|im_start|>assistant\n") if reply else out

    def _turn(self, rng: random.Random, chat: int, turn: int) -> list[int]:
        """Turn ``turn``'s new tokens: the message(s) a turn adds, assistant opened."""
        spec, encode = self.spec, self.encode
        topic = rng.choice(TOPICS)
        if spec.kind == "agent" and turn > 0:  # a tool's output: log lines
            host = f"node-{rng.randint(1, 64)}"

            def line(i: int) -> str:
                return TOOL_LINE.format(
                    hour=rng.randint(0, 23), minute=rng.randint(0, 59), second=rng.randint(0, 59),
                    host=host, level=rng.choice(("INFO", "WARN", "ERROR")),
                    topic=rng.choice(TOPICS), value=rng.randint(1, 9999), n=rng.randint(1, 512),
                )  # fmt: skip

            return self._message("tool", fill(encode, line, spec.turn_len), reply=True)
        if spec.kind == "agent":
            text = TASK_TEXT.format(
                n=chat, host=f"node-{rng.randint(1, 64)}", topic=topic, hour=rng.randint(0, 23)
            )
            return self._message("user", fill(encode, lambda i: text, spec.turn_len), reply=True)
        text = USER_TEXT.format(
            topic=topic, turn=turn + 1, n=rng.randint(2, 64), m=rng.randint(8, 512)
        )
        body = fill(encode, lambda i: text, spec.turn_len)
        if spec.kind == "unique":  # its own ticket line first: no page in common with another
            ticket = TICKET_TEXT.format(
                n=rng.randint(10**5, 10**6), k=chat, hour=rng.randint(0, 23),
                minute=rng.randint(0, 59), team=rng.choice(TOPICS),
            )  # fmt: skip
            body = (encode(ticket * 3) + body)[: spec.turn_len]
        return self._message("user", body, reply=True)

    def chats(self, round_index: int) -> list[Chat]:
        """Fresh chats: the round's tag in the system prompt's first tokens keeps rounds apart."""
        rng = random.Random(f"{self.seed}-{self.spec.kind}-{round_index}")
        tag = self.encode(f"Session {round_index}. ")
        chats = []
        for i in range(self.spec.conversations):
            turns = [self._turn(rng, i, t) for t in range(self.spec.turns)]
            chat = Chat(f"{self.spec.kind}-r{round_index}-c{i}", turns)
            if self.spec.system_len:
                chat.history = self.system_ids[:3] + tag + self.system_ids[3:]
            chats.append(chat)
        return chats

    def working_set(self) -> tuple[int, int]:
        """(distinct tokens of every final history, the longest history) for one round."""
        chats = self.chats(0)
        shared = len(chats[0].history)
        reply = self.spec.output_len + len(self.end_of_turn)
        per_chat = [sum(len(u) + reply for u in c.user_turns) for c in chats]
        return shared + sum(per_chat), shared + max(per_chat)

    def describe(self) -> dict[str, Any]:
        spec = self.spec
        return {
            "kind": spec.kind,
            "conversations": spec.conversations,
            "turns": spec.turns,
            "shared_prefix_tokens": len(self.chats(0)[0].history),
            "new_tokens_per_turn": spec.turn_len,
            "output_tokens_per_turn": spec.output_len,
            "in_flight": spec.in_flight,
        }
