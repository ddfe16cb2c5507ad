"""Tiny random-weight Hugging Face models saved to a directory, for vLLM runs offline.

Random weights echo their input unless the ``lm_head`` is untied and the weights are large
(``initializer_range=0.3``); with them, greedy outputs differ from prompt to prompt, so a wrong
block handed to vLLM changes the tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VOCAB = 512


def _common() -> dict[str, Any]:
    return {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "initializer_range": 0.3,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }


def _config(kind: str) -> Any:
    import transformers

    if kind == "llama":
        return transformers.LlamaConfig(num_hidden_layers=2, **_common())
    if kind == "gemma3":
        # Five 64-token sliding-window layers for every full-attention layer (Gemma-3's mix).
        return transformers.Gemma3TextConfig(
            num_hidden_layers=6,
            sliding_window=64,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
            query_pre_attn_scalar=64,
            **_common(),
        )
    if kind == "mistral":
        # Every layer slides over 80 tokens: one window that is not a multiple of the block.
        return transformers.MistralConfig(num_hidden_layers=2, sliding_window=80, **_common())
    raise ValueError(f"unknown tiny model {kind!r}")


def save_tiny_model(kind: str, directory: Path, seed: int = 0) -> Path:
    """Writes a random-weight model of ``kind`` (llama, gemma3, mistral) to ``directory``."""
    import torch
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    if (directory / "config.json").exists():
        return directory
    torch.manual_seed(seed)
    config = _config(kind)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.save_pretrained(directory)
    # vLLM reads the generation config; greedy sampling is set per request anyway.
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    return directory
