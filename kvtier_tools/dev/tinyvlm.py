"""What the identity tests need beside the tiny Llama, made locally: a tiny LLaVA (a
vision-language model vLLM's CPU build serves, with its processor), seeded images, and
LoRA adapters in PEFT's format.

Nothing is downloaded. The LLaVA's tokenizer is the tiny Llama's BPE (tinymodel.py) with
an `<image>` token; its weights are transformers' own initialisation of the architecture
(linear N(0, 0.02), norms 1), seeded, so that the output follows both the text and the
image. Its image processor is transformers' PIL one: torchvision, which the other needs,
has no CPU build on the package index here (and Qwen2-VL's processor needs its video
processor, which needs torchvision).
"""

from __future__ import annotations

import json
from pathlib import Path

from kvtier_tools.dev.tinymodel import TinyLlama, _write_tokenizer

# where a prompt's image goes; the processor expands it to the image's tokens
IMAGE_TOKEN = "<image>"
_IMAGE_TOKENS = ["<fake_token_around_image>", IMAGE_TOKEN, "<end_of_utterance>", "<global-img>"] + [
    f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)
]


def make_tiny_idefics3(path: str | Path, seed: int = 0) -> Path:
    """Config, tokenizer, processor and seeded weights of an Idefics3ForConditionalGeneration:
    a Llama of 2 layers of 256 and a 2-layer SigLIP-style tower on 224x224 images in patches
    of 14, shuffled by 2: 64 image tokens an image, not split into tiles (fewer would move the
    answer too little to tell two images' KV apart). Idempotent."""
    import torch
    from transformers import (
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    path = Path(path)
    if (path / "model.safetensors").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(path, 2048)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.add_special_tokens({"additional_special_tokens": _IMAGE_TOKENS})
    config = Idefics3Config(
        text_config={
            "model_type": "llama",
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": len(tokenizer),
            "max_position_embeddings": 8192,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "tie_word_embeddings": False,
        },
        vision_config={
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "image_size": 224,
            "patch_size": 14,
        },
        scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        pad_token_id=tokenizer.convert_tokens_to_ids("<unk>"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():  # a peaked output, as a trained model's (logits of std ~4, not ~0.3)
        model.lm_head.weight.mul_(12.5)
    model.save_pretrained(str(path), safe_serialization=True)
    images = Idefics3ImageProcessorPil(
        do_image_splitting=False, size={"longest_edge": 224}, max_image_size={"longest_edge": 224}
    )
    Idefics3Processor(
        image_processor=images, tokenizer=tokenizer, image_seq_len=64
    ).save_pretrained(str(path))
    return path


def seeded_image(seed: int, width: int = 160, height: int = 120):
    """A PIL image of seeded noise: two seeds, two images whose KV differs."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def make_lora_adapter(
    path: str | Path, spec: TinyLlama = TinyLlama(), rank: int = 8, seed: int = 0
) -> Path:
    """A LoRA adapter of the tiny Llama in PEFT's format (adapter_config.json and
    adapter_model.safetensors) on q_proj and v_proj, with A and B both N(0, 0.02) x 10 and
    seeded (a fresh PEFT adapter's B is zero and would change nothing)."""
    import torch
    from safetensors.torch import save_file

    path = Path(path)
    if (path / "adapter_model.safetensors").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    hd = spec.head_dim
    outs = {"q_proj": spec.num_attention_heads * hd, "v_proj": spec.num_key_value_heads * hd}
    weights = {}
    for i in range(spec.num_hidden_layers):
        for name, out in outs.items():
            pre = f"base_model.model.model.layers.{i}.self_attn.{name}"
            weights[f"{pre}.lora_A.weight"] = (
                torch.randn(rank, spec.hidden_size, generator=gen) * 0.2
            )
            weights[f"{pre}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.2
    save_file(weights, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted(outs),
        "base_model_name_or_path": None,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return path
