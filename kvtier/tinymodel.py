"""A small Llama-shaped model directory made locally, for tests and the demo.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on
text from Python's own standard library, and the weights are vLLM's
`load_format="dummy"` (random, seeded), so the directory holds only
config.json and the tokenizer files.
"""

from __future__ import annotations

import json
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

# Stdlib modules whose source makes the tokenizer corpus and the demo's
# long prompt: plain English docstrings and code, present on every CPython.
CORPUS_MODULES = ("argparse", "typing", "subprocess", "logging/__init__", "pathlib", "asyncio/base_events")


@dataclass(frozen=True)
class TinyLlama:
    hidden_size: int = 512
    intermediate_size: int = 1408
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 64
    vocab_size: int = 4096
    max_position_embeddings: int = 16384
    torch_dtype: str = "bfloat16"


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def corpus_text(min_chars: int = 0) -> str:
    """Deterministic English-and-code text from the stdlib, repeated to `min_chars`."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    text = "\n".join((lib / f"{m}.py").read_text(encoding="utf-8") for m in CORPUS_MODULES)
    while len(text) < min_chars:
        text += text
    return text


def make_tiny_llama(path: str | Path, spec: TinyLlama = TinyLlama()) -> Path:
    """Write config.json and tokenizer files to `path` (idempotent)."""
    path = Path(path)
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(path, spec.vocab_size)
    tok = json.loads((path / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **asdict(spec),
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": vocab["<s>"],
        "eos_token_id": vocab["</s>"],
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def _write_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_text().splitlines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
