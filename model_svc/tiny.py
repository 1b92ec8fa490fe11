"""A small deterministic Llama checkpoint, in the HF layout, so nothing is downloaded.

``python -m model_svc.tiny OUT_DIR`` writes ``config.json`` + ``model.safetensors``
(seeded random weights: 4 layers, hidden 256, 4 query heads, 2 KV heads of
dim 64, a byte vocabulary: 256 bytes + bos 256 + eos 257 + pad 258).
:func:`default_checkpoint` is the bundled default, made on first use.

The weights are scaled so that greedy generations wander through many
tokens instead of settling on one: unit-variance embeddings, projections at
``gain / sqrt(fan_in)``, and an LM head whose logits spread over a few nats.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from model_svc.checkpoint import WEIGHTS_FILE, expected_shapes
from model_svc.config import CONFIG_FILE, ModelConfig

DEFAULT_SEED = 0
DEFAULT_DIR_NAME = "tiny-llama"
BYTE_VOCAB = 256
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258

# Standard deviation of each kind of tensor, as a multiple of 1 / sqrt(fan_in).
_GAINS = {"lm_head": 6.0, "o_proj": 1.0, "down_proj": 1.0}
_PROJ_GAIN = 1.5


def tiny_config(**overrides: object) -> ModelConfig:
    fields: dict = dict(
        vocab_size=BYTE_VOCAB + 3,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_ids=(EOS_ID,),
        pad_token_id=PAD_ID,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def tiny_state_dict(config: ModelConfig, seed: int = DEFAULT_SEED) -> dict[str, torch.Tensor]:
    """Seeded float32 weights for every tensor of ``config``, by HF name."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in expected_shapes(config).items():
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        if name.endswith("norm.weight"):
            state[name] = 1.0 + 0.1 * noise
        elif name == "model.embed_tokens.weight":
            state[name] = noise
        else:
            kind = name.split(".")[-2]
            gain = _GAINS.get(kind, _PROJ_GAIN)
            state[name] = noise * (gain / shape[1] ** 0.5)
    return state


def write_checkpoint(
    out_dir: str | Path, config: ModelConfig, state: dict[str, torch.Tensor]
) -> Path:
    """``config.json`` + one ``model.safetensors`` in ``out_dir`` (created if needed)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = config.to_dict() | {"torch_dtype": "float32"}
    (out / CONFIG_FILE).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    tensors = {name: tensor.contiguous() for name, tensor in state.items()}
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    return out


def write_tiny_checkpoint(out_dir: str | Path, seed: int = DEFAULT_SEED) -> Path:
    config = tiny_config()
    return write_checkpoint(out_dir, config, tiny_state_dict(config, seed))


def kvstack_home() -> Path:
    home = os.environ.get("KVSTACK_HOME")
    return Path(home) if home else Path.home() / ".cache" / "kvstack"


def default_checkpoint() -> Path:
    """The bundled tiny checkpoint, ``$KVSTACK_HOME/tiny-llama``; written on first use.

    Written into a temporary sibling directory and renamed into place, so a
    reader never sees half a checkpoint; when two processes race, the loser
    drops its copy and uses the winner's (they are identical).
    """
    final = kvstack_home() / DEFAULT_DIR_NAME
    if (final / CONFIG_FILE).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_DIR_NAME}-", dir=final.parent))
    try:
        write_tiny_checkpoint(staging)
        os.rename(staging, final)
    except OSError:
        if not (final / CONFIG_FILE).is_file():
            raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(staging)
    return final


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m model_svc.tiny", description="Write the tiny Llama checkpoint."
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = parser.parse_args(argv)
    out = write_tiny_checkpoint(args.out_dir, args.seed)
    print(f"wrote {out / CONFIG_FILE} and {out / WEIGHTS_FILE}")


if __name__ == "__main__":
    main()
