"""Run prompts through real vLLM (CPU build), with or without kvtier.

Used by the tests as a subprocess: vLLM starts worker processes, so this
needs its own `__main__`. Prints one JSON line per request on stdout.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from kvtier_tools.dev.cpu_dtype import cpu_model_dtype, model_dtype


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument(
        "--prompts",
        required=True,
        help='JSON file: list of prompts (or "RESET", "FORGET", '
        'or {"together": [prompts]}: prompts submitted at once, in that order); a prompt is its '
        'token ids, or {"ids" or "text": ..., "lora": name, "salt": cache_salt, "image": seed, '
        '"embeds": true (the ids as prompt embeddings)}',
    )
    p.add_argument(
        "--kv-role", default="", help="kv_both | kv_producer | kv_consumer; empty: no kvtier"
    )
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--max-batched", type=int, default=1024)
    p.add_argument(
        "--dtype", required=True, help="bfloat16 | float32 (see kvtier_tools.dev.cpu_dtype)"
    )
    p.add_argument(
        "--by-name", action="store_true", help="no kv_connector_module_path: vLLM's plugin finds it"
    )
    p.add_argument(
        "--tp", type=int, default=1, help="tensor parallel size (a worker process per rank)"
    )
    p.add_argument(
        "--lora", action="append", default=[], help="NAME=PATH: a LoRA adapter prompts may name"
    )
    p.add_argument("--embeds", action="store_true", help="vLLM's enable_prompt_embeds")
    p.add_argument("--attention-backend", default="", help="vLLM's attention_backend, by name")
    p.add_argument(
        "--mamba-align",
        action="store_true",
        help="vLLM's prefix caching on, Mamba state kept at block ends (a hybrid model's only mode "
        "kvtier serves); a FORGET between prompts clears vLLM's own cache",
    )
    p.add_argument(
        "--prefix-caching",
        action="store_true",
        help="vLLM's own prefix cache on (a FORGET between prompts clears it)",
    )
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.tp > 1:  # one core per rank
        os.environ.setdefault(
            "VLLM_CPU_OMP_THREADS_BIND",
            "|".join(str(r % (os.cpu_count() or 1)) for r in range(args.tp)),
        )

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv = None
    if args.kv_role:
        kv = KVTransferConfig(
            kv_connector="KvtierConnector",
            kv_role=args.kv_role,
            kv_connector_module_path=None if args.by_name else "kvtier.integrations.vllm",
        )
    options = {"mamba_cache_mode": "align"} if args.mamba_align else {}
    if args.lora:
        options.update(enable_lora=True, max_lora_rank=8, max_loras=len(args.lora))
    if args.embeds:
        options["enable_prompt_embeds"] = True
    if args.attention_backend:
        options["attention_backend"] = args.attention_backend
    llm = LLM(
        model=args.model,
        seed=0,
        max_model_len=8192,
        dtype=args.dtype,
        enable_prefix_caching=args.mamba_align or args.prefix_caching,
        max_num_batched_tokens=args.max_batched,
        enforce_eager=True,
        kv_transfer_config=kv,
        tensor_parallel_size=args.tp,
        distributed_executor_backend="mp" if args.tp > 1 else None,
        **options,
    )
    adapters = dict(a.split("=", 1) for a in args.lora)
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, logprobs=0, ignore_eos=True)
    with open(args.prompts) as f:
        prompts = json.load(f)
    for ids in prompts:  # one at a time: the second sees the first's stored KV
        if ids == "RESET":  # vLLM's reset_prefix_cache, the connector's caches included
            print(
                "RESULT " + json.dumps({"reset": llm.reset_prefix_cache(reset_connector=True)}),
                flush=True,
            )
            continue
        if ids == "FORGET":  # vLLM's own prefix cache only: a hit after it comes from the connector
            print("RESULT " + json.dumps({"reset": llm.reset_prefix_cache()}), flush=True)
            continue
        batch = ids["together"] if isinstance(ids, dict) and "together" in ids else [ids]
        inputs = [_prompt(x, args.model) for x in batch]
        loras = [_lora(x, adapters) for x in batch]
        for request in llm.generate(inputs, sp, use_tqdm=False, lora_request=loras):
            out = request.outputs[0]
            logprobs = [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]
            print(
                "RESULT " + json.dumps({"token_ids": list(out.token_ids), "logprobs": logprobs}),
                flush=True,
            )


def _prompt(prompt: list[int] | dict, model: str) -> dict:
    """vLLM's input for a prompt of the --prompts file."""
    if isinstance(prompt, list):
        return {"prompt_token_ids": prompt}
    out = {"prompt": prompt["text"]} if "text" in prompt else {"prompt_token_ids": prompt["ids"]}
    if prompt.get("embeds"):
        out = {"prompt_embeds": _embeddings(model, out.pop("prompt_token_ids"))}
    if "image" in prompt:
        from kvtier_tools.dev.tinyvlm import seeded_image

        out["multi_modal_data"] = {"image": seeded_image(prompt["image"])}
    if "salt" in prompt:
        out["cache_salt"] = prompt["salt"]
    return out


def _lora(prompt: list[int] | dict, adapters: dict[str, str]):
    if not isinstance(prompt, dict) or "lora" not in prompt:
        return None
    from vllm.lora.request import LoRARequest

    name = prompt["lora"]
    return LoRARequest(name, list(adapters).index(name) + 1, adapters[name])


def _embeddings(model: str, ids: list[int]):
    """The model's input embeddings of `ids` (what its embedding layer would give)."""
    from safetensors import safe_open

    with safe_open(str(Path(model) / "model.safetensors"), "pt") as f:
        return f.get_tensor("model.embed_tokens.weight")[ids]


CPU_BLOCK_SIZE = 128  # vLLM's CPU build's default block size


def hit_granularity() -> int:
    """Tokens a vLLM (CPU build) hit is rounded to here: 1 where vLLM's CPU attention kernel
    is "vec" (kvtier knows its token layout), else whole blocks (kvtier moves whole blocks)."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    dtype = getattr(torch, cpu_model_dtype().dtype)
    return 1 if _get_attn_isa(dtype, CPU_BLOCK_SIZE, 64, "auto") == "vec" else CPU_BLOCK_SIZE


def run_vllm(
    model: Path,
    prompts: list[list[int]],
    tmp: Path,
    kv_role: str = "",
    env: dict | None = None,
    name: str = "",
    dtype: str = "auto",
    max_tokens: int = 8,
    by_name: bool = False,
    tp: int = 1,
    engine_process: bool = False,
    max_batched: int = 1024,
    mamba_align: bool = False,
    lora: dict[str, Path] | None = None,
    embeds: bool = False,
    attention_backend: str = "",
    prefix_caching: bool = False,
) -> tuple[list[dict], str]:
    """Run this file in a subprocess; returns the per-request results and vLLM's log.

    dtype "auto": the one models run in here (kvtier_tools.dev.cpu_dtype.model_dtype). vLLM's
    engine core runs in that process (VLLM_ENABLE_V1_MULTIPROCESSING=0: a run takes 34 s
    instead of 66 s on a 2-core host, vLLM imported once), with the scheduler's and the
    worker's connector side by side; `engine_process` runs it in a process of its own, as
    `LLM` does by default (the connector suite's main runs, and every OpenAI server)."""
    pfile = tmp / f"prompts-{name or kv_role or 'plain'}.json"
    pfile.write_text(json.dumps(prompts))
    cmd = [
        sys.executable,
        __file__,
        "--model",
        str(model),
        "--prompts",
        str(pfile),
        "--kv-role",
        kv_role,
        "--dtype",
        model_dtype().dtype if dtype == "auto" else dtype,
        "--max-tokens",
        str(max_tokens),
    ]
    cmd += (["--by-name"] if by_name else []) + ["--tp", str(tp), "--max-batched", str(max_batched)]
    cmd += ["--mamba-align"] if mamba_align else []
    cmd += ["--prefix-caching"] if prefix_caching else []
    cmd += [f"--lora={n}={p}" for n, p in (lora or {}).items()] + (["--embeds"] if embeds else [])
    cmd += ["--attention-backend", attention_backend] if attention_backend else []
    # Defaults under LMCACHE_ names: a test's own LMCACHE_ or KVTIER_ setting replaces or
    # overrides them.
    # Partial last chunks not stored (LMCache's default; kvtier's stores them): the tiers' tests
    # count whole chunks; the connector suite's main runs and its next-turn case run kvtier's
    # default.
    full_env = {
        **os.environ,
        "LMCACHE_CHUNK_SIZE": "256",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.25",
        "LMCACHE_SAVE_UNFULL_CHUNK": "false",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if engine_process else "0",
        **(env or {}),
    }
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=full_env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    results = [
        json.loads(line[7:]) for line in out.stdout.splitlines() if line.startswith("RESULT ")
    ]
    assert len(results) == sum(
        len(p["together"]) if isinstance(p, dict) and "together" in p else 1 for p in prompts
    )
    return results, out.stderr


if __name__ == "__main__":
    main()
