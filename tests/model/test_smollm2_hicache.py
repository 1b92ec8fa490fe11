"""SmolLM2 multi-turn chats through a stack with the hierarchical cache (issue 21).

Three chats of three turns, taken in turn (chat 0, 1, 2, then each one's next
turn), each turn the whole history (the model's own replies token for token)
plus a new user message in the chat template, on a device pool that holds about
one history, with host and file disk tiers under it: by the time a chat comes
back, the other two have pushed its history off the device. Every
reply must be transformers' own greedy continuation of its prompt, though most
of each prompt's KV came back from the host or the disk tier instead of being
computed; the stack ends idle.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvstack.stack.launch import Launcher
from memsvc.client import MemClient
from scheduler_svc.client import AsyncGenerateClient, GenerateResult
from tests.smollm2 import CHATS, transformers_greedy

NUM_NEW = 8
TURNS = ["Tell me more.", "Now say it in one short sentence."]
GREEDY = {"max_new_tokens": NUM_NEW, "ignore_eos": True, "temperature": 0.0}
# 28 pages of 4 = 112 tokens: one chat's last turn fits, three chats' histories do not.
POOL = ["--page-size", "4", "--num-pages", "28", "--max-running-requests", "8"]
POOL += ["--max-context-len", "512"]


@pytest.fixture(scope="module")
def hicache_stack(smollm2_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    workdir = tmp_path_factory.mktemp("smollm2-hicache")
    flags = [
        "--enable-hierarchical-cache", "--hicache-ratio", "1",
        "--hicache-storage-backend", "file", "--hicache-storage-dir", str(workdir / "disk"),
    ]  # fmt: skip
    with Launcher(workdir) as up:
        yield up.start_normal_stack(smollm2_checkpoint, [*POOL, *flags])
    assert not up.leaked_segments


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def run_chats(address: str, tokenizer) -> dict[str, tuple[list[int], GenerateResult]]:
    """Turn t of every chat, then turn t + 1 of every chat...; (prompt, result) by rid."""

    def opening(text: str) -> list[int]:
        messages = [{"role": "user", "content": text}]
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return encode(tokenizer, rendered)

    async def go() -> dict:
        prompts = [opening(text) for text in CHATS[:3]]
        done = {}
        async with AsyncGenerateClient(address, timeout_s=300) as client:
            for turn in range(1 + len(TURNS)):
                for index, prompt in enumerate(prompts):
                    rid = f"c{index}-t{turn}"
                    done[rid] = (prompt, await client.generate(prompt, rid=rid, sampling=GREEDY))
                    if turn < len(TURNS):
                        follow = f"<|im_end|>\n<|im_start|>user\n{TURNS[turn]}<|im_end|>\n"
                        prompts[index] = [
                            *prompt,
                            *done[rid][1].output_ids,
                            *encode(tokenizer, follow + "<|im_start|>assistant\n"),
                        ]
        return done

    return asyncio.run(go())


def hf_continuations(checkpoint: Path, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    found = transformers_greedy(checkpoint, prompts, max_new=NUM_NEW)
    return {rid: answer["tokens"] for rid, answer in found.items()}


def test_multi_turn_replies_are_transformers_with_kv_from_lower_tiers(
    hicache_stack, smollm2_checkpoint, hf_tokenizer
) -> None:
    mem, _, sched = hicache_stack
    got = run_chats(sched.address, hf_tokenizer)
    want = hf_continuations(smollm2_checkpoint, {rid: p for rid, (p, _) in got.items()})
    differing = {
        rid: (hf_tokenizer.decode(r.output_ids), hf_tokenizer.decode(want[rid]))
        for rid, (_, r) in got.items()
        if r.output_ids != want[rid]
    }
    assert not differing, differing
    lower = 0
    for _, r in got.values():
        details = r.meta_info.get("cached_tokens_details") or {}
        lower += details.get("host", 0) + details.get("storage", 0)
    assert lower > 0, "no turn's prefix came from the host or disk tier"
    with MemClient(mem.address) as client:
        stats = client.stats()["hicache"]
        client.check(idle=True)
    assert stats["load_bytes"] > 0 and stats["backup_bytes"] > 0
