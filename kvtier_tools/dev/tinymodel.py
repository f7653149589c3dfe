"""Small model directories made locally, for tests and the demo: a Llama, a
Gemma-3-style model whose layers mostly attend within a sliding window, and a
Nemotron-H-style hybrid whose layers are mostly Mamba-2.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on
text from Python's own standard library, and the weights are random,
seeded, written as model.safetensors.

Why not vLLM's `load_format="dummy"`: it fills every tensor, norm weights
included, with U(-1e-3, 1e-3), so attention adds less than bf16 can
resolve and the output does not depend on the context at all. A test
that compares output with and without loaded KV would then pass even if
the KV were wrong. Here linear weights are N(0, 0.02) and norms are 1, as
a freshly initialised Llama has, so the output follows the context.
"""

from __future__ import annotations

import json
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

# Stdlib modules whose source makes the tokenizer corpus and the demo's
# long prompt: plain English docstrings and code, present on every CPython.
CORPUS_MODULES = (
    "argparse",
    "typing",
    "subprocess",
    "logging/__init__",
    "pathlib",
    "asyncio/base_events",
)


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

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Bytes of KV (K and V, every layer) a token takes in an engine's cache."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


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
    """Write config.json, tokenizer files and seeded weights to `path` (idempotent)."""
    path = Path(path)
    vocab = _new_model_dir(path, spec.vocab_size)
    if vocab is None:
        return path
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
    _write_weights(
        path,
        spec,
        spec.torch_dtype,
        lm_head=True,
        norm=1.0,
        layer_norms=("input_layernorm", "post_attention_layernorm"),
    )
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def _new_model_dir(path: Path, vocab_size: int) -> dict[str, int] | None:
    """None where `path` holds a model already; else the directory with a tokenizer, and its
    vocab."""
    if all((path / f).exists() for f in ("config.json", "tokenizer.json", "model.safetensors")):
        return None
    path.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(path, vocab_size)
    return json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]


def _write_weights(
    path: Path,
    spec: TinyLlama | TinyGemma3,
    dtype_name: str,
    *,
    lm_head: bool,
    norm: float,
    layer_norms: tuple[str, ...],
    head_norms: bool = False,
    seed: int = 0,
) -> None:
    """N(0, 0.02) linear weights, seeded; every norm's weight is `norm` (1 for Llama's x*w,
    0 for Gemma's x*(1+w): a fresh norm either way)."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, dtype_name)
    h, inter, hd = spec.hidden_size, spec.intermediate_size, spec.head_dim
    q, kv = spec.num_attention_heads * hd, spec.num_key_value_heads * hd

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(dtype)

    def fill(n: int) -> torch.Tensor:
        return torch.full((n,), norm, dtype=dtype)

    weights = {
        "model.embed_tokens.weight": normal(spec.vocab_size, h),
        "model.norm.weight": fill(h),
    }
    if lm_head:
        weights["lm_head.weight"] = normal(spec.vocab_size, h)
    for i in range(spec.num_hidden_layers):
        pre = f"model.layers.{i}."
        weights.update(
            {
                pre + "self_attn.q_proj.weight": normal(q, h),
                pre + "self_attn.k_proj.weight": normal(kv, h),
                pre + "self_attn.v_proj.weight": normal(kv, h),
                pre + "self_attn.o_proj.weight": normal(h, q),
                pre + "mlp.gate_proj.weight": normal(inter, h),
                pre + "mlp.up_proj.weight": normal(inter, h),
                pre + "mlp.down_proj.weight": normal(h, inter),
                **{pre + f"{n}.weight": fill(h) for n in layer_norms},
            }
        )
        if head_norms:
            weights.update(
                {
                    pre + "self_attn.q_norm.weight": fill(hd),
                    pre + "self_attn.k_norm.weight": fill(hd),
                }
            )
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})


@dataclass(frozen=True)
class TinyGemma3:
    """Gemma 3's text model, small: five sliding-window layers to one full-attention layer."""

    hidden_size: int = 512
    intermediate_size: int = 1408
    num_hidden_layers: int = 6
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 64
    vocab_size: int = 4096
    max_position_embeddings: int = 16384
    sliding_window: int = 128
    full_every: int = 6  # layer i is full attention where (i + 1) % full_every == 0


def make_tiny_gemma3(path: str | Path, spec: TinyGemma3 = TinyGemma3()) -> Path:
    """Config, tokenizer and seeded weights of a Gemma3ForCausalLM (idempotent)."""
    path = Path(path)
    vocab = _new_model_dir(path, spec.vocab_size)
    if vocab is None:
        return path
    layer_types = [
        "full_attention" if (i + 1) % spec.full_every == 0 else "sliding_attention"
        for i in range(spec.num_hidden_layers)
    ]
    fields = {k: v for k, v in asdict(spec).items() if k != "full_every"}
    config = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        **fields,
        "layer_types": layer_types,
        "query_pre_attn_scalar": spec.head_dim,
        "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "bos_token_id": vocab["<s>"],
        "eos_token_id": vocab["</s>"],
        "pad_token_id": vocab["<unk>"],
    }
    _write_weights(
        path,
        spec,
        "bfloat16",
        lm_head=False,
        norm=0.0,
        head_norms=True,
        layer_norms=(
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ),
    )
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


@dataclass(frozen=True)
class TinyNemotronH:
    """Nemotron-H, small: Mamba-2 layers (M), attention (*) and MLPs (-) in `pattern`."""

    hidden_size: int = 512
    intermediate_size: int = 1408
    pattern: str = "M-M*-M-M*-"
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 64
    mamba_num_heads: int = 16
    mamba_head_dim: int = 32
    mamba_n_groups: int = 1
    ssm_state_size: int = 64
    mamba_d_conv: int = 4
    vocab_size: int = 4096
    max_position_embeddings: int = 16384


def make_tiny_nemotron_h(path: str | Path, spec: TinyNemotronH = TinyNemotronH()) -> Path:
    """Config, tokenizer and seeded weights of a NemotronHForCausalLM (idempotent). Linear
    weights N(0, 0.02) (the head's N(0, 0.25)), norms 1, the convolution U(-1/sqrt(width),
    1/sqrt(width)). The Mamba layers remember: decay A in [-4, -1], step dt in [0.005, 0.05]
    (a memory of 5 to 200 tokens) and no skip (D = 0), so that their output is their state's,
    not the token's; with Mamba-2's own init (D = 1, dt from 0.001) a random model's output
    ignores the context."""
    from safetensors.torch import save_file

    path = Path(path)
    vocab = _new_model_dir(path, spec.vocab_size)
    if vocab is None:
        return path
    save_file(_nemotron_h_weights(spec), str(path / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": len(spec.pattern),
        "hybrid_override_pattern": spec.pattern,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "mamba_num_heads": spec.mamba_num_heads,
        "mamba_head_dim": spec.mamba_head_dim,
        "mamba_n_groups": spec.mamba_n_groups,
        "ssm_state_size": spec.ssm_state_size,
        "mamba_d_conv": spec.mamba_d_conv,
        "mamba_chunk_size": 128,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "mlp_hidden_act": "relu2",
        "mamba_hidden_act": "silu",
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": vocab["<s>"],
        "eos_token_id": vocab["</s>"],
        "pad_token_id": vocab["<unk>"],
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def _nemotron_h_weights(spec: TinyNemotronH) -> dict:
    import math

    import torch

    gen = torch.Generator().manual_seed(0)
    h, hd, heads = spec.hidden_size, spec.head_dim, spec.mamba_num_heads
    inner = heads * spec.mamba_head_dim
    conv_dim = inner + 2 * spec.mamba_n_groups * spec.ssm_state_size

    def normal(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)

    def uniform(lo: float, hi: float, *shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=gen) * (hi - lo) + lo

    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
    # A peaked output (the head N(0, 0.25): logits of std ~5, as a trained model's): with N(0, 0.02)
    # its distribution is near uniform, and greedy tokens flip on near-ties from run to run.
    weights = {
        "backbone.embeddings.weight": normal(spec.vocab_size, h),
        "backbone.norm_f.weight": ones(h),
        "lm_head.weight": normal(spec.vocab_size, h, std=0.25),
    }
    for i, kind in enumerate(spec.pattern):
        pre = f"backbone.layers.{i}."
        weights[pre + "norm.weight"] = ones(h)
        if kind == "M":
            dt = torch.exp(uniform(math.log(0.005), math.log(0.05), heads))
            bound = 1 / math.sqrt(spec.mamba_d_conv)
            weights.update(
                {
                    pre + "mixer.in_proj.weight": normal(inner + conv_dim + heads, h),
                    pre + "mixer.conv1d.weight": uniform(
                        -bound, bound, conv_dim, 1, spec.mamba_d_conv
                    ).to(torch.bfloat16),
                    pre + "mixer.conv1d.bias": uniform(-bound, bound, conv_dim).to(torch.bfloat16),
                    pre + "mixer.A_log": torch.log(uniform(1.0, 4.0, heads)),
                    pre + "mixer.D": torch.zeros(heads),
                    pre + "mixer.dt_bias": dt
                    + torch.log(-torch.expm1(-dt)),  # softplus(dt_bias) = dt
                    pre + "mixer.norm.weight": ones(inner),
                    pre + "mixer.out_proj.weight": normal(h, inner),
                }
            )
        elif kind == "*":
            q, kv = spec.num_attention_heads * hd, spec.num_key_value_heads * hd
            weights.update(
                {
                    pre + "mixer.q_proj.weight": normal(q, h),
                    pre + "mixer.k_proj.weight": normal(kv, h),
                    pre + "mixer.v_proj.weight": normal(kv, h),
                    pre + "mixer.o_proj.weight": normal(h, q),
                }
            )
        else:
            weights.update(
                {
                    pre + "mixer.up_proj.weight": normal(spec.intermediate_size, h),
                    pre + "mixer.down_proj.weight": normal(h, spec.intermediate_size),
                }
            )
    return weights


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


def make_tiny_deepseek_v2(path: str | Path, seed: int = 0) -> Path:
    """Config, tokenizer and seeded weights of a DeepseekV2ForCausalLM, small: multi-head
    latent attention (MLA: one compressed KV of kv_lora_rank + the rope part a token and
    layer: 256 + 64, the smallest row vLLM's MLA kernels take), 4 dense layers of 512 (no
    experts). Weights are transformers' initialisation of the architecture, seeded, the
    head x12.5 for a peaked output. Idempotent."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    path = Path(path)
    vocab = _new_model_dir(path, 4096)
    if vocab is None:
        return path
    layers = 4
    config = DeepseekV2Config(
        vocab_size=len(vocab),
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_nope_head_dim=64,
        qk_rope_head_dim=64,
        v_head_dim=64,
        first_k_dense_replace=layers,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        max_position_embeddings=16384,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
    )
    torch.manual_seed(seed)
    model = DeepseekV2ForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.mul_(12.5)
    model.save_pretrained(str(path), safe_serialization=True)
    return path
