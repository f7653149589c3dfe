"""`python -m kvtier_tools.bench.pd_vllm`: LMCache's 1P1D guide inside real vLLM, on two GPUs.

    a prefiller on GPU 0 and a decoder on GPU 1 (vLLM's OpenAI server each, kvtier
    as its connector, transfer_channel cuda_ipc) and `kvtier proxy` (kvtier_tools.dev.pdcluster)
    a model with Llama-3.1-8B's KV shape (32 layers, 8 KV heads of 128, bf16) and a
    thin MLP, seeded N(0, 0.02) weights written to disk (the output follows the prompt)
    per length: `pairs` new prompts, each through the proxy (prefill on GPU 0, its KV
    into the decoder's buffer, the decoder loads it and decodes); the decoder's prefix
    cache reset; the same prompt straight to the decoder, which prefills it alone (its
    buffer holds nothing for it); once more straight to the decoder, a hit in its own
    GPU prefix cache: TTFT of each (streamed). Tokens: the PD answer must equal the
    decoder's own prefix hit's, both computing the last prompt token alone on the
    same KV (the alone prefill computes it inside a larger step: bf16 may part from it
    at a near-tie after some tokens, counted apart); a control prompt (another first
    token) must give other tokens

    python -m kvtier_tools.bench.pd_vllm --lengths 4096 16384 32768 --pairs 5 --out results/gpu2

With `--engine lmcache` the same run with LMCache 0.5.x's PD in both servers instead
(LMCacheConnectorV1, transfer_channel nixl, its guide's UCX_TLS) behind `kvtier proxy
--pd-engine lmcache`: the figure to set beside kvtier's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import time
from dataclasses import asdict
from pathlib import Path

from kvtier_tools.bench.chat import Result, request
from kvtier_tools.dev.pdcluster import pd_cluster
from kvtier_tools.dev.tinymodel import TinyLlama, make_tiny_llama

# Llama-3.1-8B's attention and KV (128 KiB of KV a token), a thin MLP and vocabulary.
MODEL = TinyLlama(
    hidden_size=4096,
    intermediate_size=1024,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=32000,
    max_position_embeddings=40960,
)
KV_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2
LAST_WRITES = re.compile(
    r"PD: request \S+: KV of (\d+) tokens in the decoder's buffer, its last writes ([\d.]+) ms"
)


async def _one(url: str, model: str, prompt: list[int], max_tokens: int) -> Result:
    import aiohttp

    r = Result(0, 0, len(prompt), 0.0)
    async with aiohttp.ClientSession() as session:
        await request(session, url, model, prompt, max_tokens, r, time.perf_counter(), logprobs=2)
    return r


# logprob: bf16 logits around 4-8 lie 1/32 apart, so one rounding step is 0.031 (the
# 2026-11-26 run first used 0.02, under that step; `--recheck` re-reads its record).
NEAR_TIE = 0.05


def verdict(pd: Result, ref: Result) -> str:
    """ "equal"; or "near-tie": the tokens part where one side's top two are the two
    tokens and lie within NEAR_TIE of each other (either side: each has only its top two),
    and every logprob before that is within NEAR_TIE of the reference's (bf16, another
    shape of the last token's step); else "differ" (wrong KV would move them all)."""
    if pd.output_ids == ref.output_ids:
        return "equal"
    at = next(i for i, (a, b) in enumerate(zip(pd.output_ids, ref.output_ids)) if a != b)
    if len(pd.top_logprobs) <= at or len(ref.top_logprobs) <= at:
        return "differ"
    before = all(
        abs(pd.top_logprobs[i][t] - ref.top_logprobs[i][t]) < NEAR_TIE
        for i, t in enumerate(ref.output_ids[:at])
    )
    pair = (pd.output_ids[at], ref.output_ids[at])
    tie = any(
        all(t in top for t in pair) and abs(top[pair[0]] - top[pair[1]]) < NEAR_TIE
        for top in (ref.top_logprobs[at], pd.top_logprobs[at])
    )
    return "near-tie" if before and tie else "differ"


def one(url: str, model: str, prompt: list[int], max_tokens: int) -> Result:
    return asyncio.run(_one(url, model, prompt, max_tokens))


def reset_prefix_cache(url: str) -> None:
    """vLLM's dev endpoint (VLLM_SERVER_DEV_MODE=1): its GPU prefix cache emptied."""
    import urllib.request

    with urllib.request.urlopen(
        urllib.request.Request(f"{url}/reset_prefix_cache", method="POST"), timeout=30
    ):
        pass


def run(args: argparse.Namespace) -> dict:
    model = make_tiny_llama(Path(args.model_dir), MODEL)
    name, rng = str(model), random.Random(0)
    runs = []
    channel = "cuda_ipc" if args.engine == "kvtier" else "nixl"
    with pd_cluster(
        model,
        Path(args.out) / "cluster",
        channel,
        two_gpus=True,
        buffer_bytes=int(args.buffer_gb * 2**30),
        max_model_len=max(args.lengths) + 64,
        gpu_util=0.6,
        eager=args.eager,
        decoder_prefix_cache=True,
        engine=args.engine,
    ) as c:
        warm = [rng.randrange(10, MODEL.vocab_size) for _ in range(1024)]
        for url in (c.url, c.decoder.url):  # the first request of each path: kernels, IPC mapping
            one(url, name, warm, args.max_tokens)
        for n in args.lengths:
            row = _length(c, name, n, rng, args)
            runs.append(row)
            print(
                f"{n:6d} tokens: through the proxy (P on GPU0, D on GPU1) "
                f"{row['pd_median_ms']:.1f} ms, decoder "
                f"alone {row['alone_median_ms']:.1f} ms ({row['alone_over_pd']:.2f}x), "
                f"decoder's own prefix hit "
                f"{statistics.median(row['hit_ttft_ms']):.1f} ms; "
                f"last writes after the last forward "
                f"{row['sender_median_ms']} ms ({n * KV_BYTES_PER_TOKEN / 1e9:.2f} GB in all); "
                f"tokens equal to "
                f"the decoder's hit {row['equal']}/{args.pairs}, "
                f"parting at a near-tie {row['near_tie']} (equal to "
                f"its prefill alone {row['equal_to_alone']}), "
                f"control differs {row.get('control_differs')}, failed {row['failed']}",
                flush=True,
            )
    return {
        "command": "python -m kvtier_tools.bench.pd_vllm " + " ".join(args.argv),
        "date": time.strftime("%Y-%m-%d"),
        "engine": args.engine,
        "channel": channel,
        "model": asdict(MODEL),
        "eager": args.eager,
        "runs": runs,
    }


def _length(c, name: str, n: int, rng: random.Random, args: argparse.Namespace) -> dict:
    """`args.pairs` prompts of `n` tokens: through the proxy, the decoder alone, its own hit."""
    row: dict = {
        "tokens": n,
        "pd_ttft_ms": [],
        "alone_ttft_ms": [],
        "hit_ttft_ms": [],
        "equal": 0,
        "near_tie": 0,
        "equal_to_alone": 0,
        "failed": 0,
        "differing": [],
    }
    for i in range(args.pairs):
        prompt = [rng.randrange(10, MODEL.vocab_size) for _ in range(n)]
        pd = one(c.url, name, prompt, args.max_tokens)
        reset_prefix_cache(c.decoder.url)
        alone = one(c.decoder.url, name, prompt, args.max_tokens)
        hit = one(c.decoder.url, name, prompt, args.max_tokens)
        reset_prefix_cache(c.decoder.url)
        row["failed"] += sum(bool(r.error) for r in (pd, alone, hit))
        if pd.error or alone.error or hit.error:
            row["differing"].append({"pair": i, "errors": [pd.error, alone.error, hit.error]})
            continue
        for key, r in (("pd_ttft_ms", pd), ("alone_ttft_ms", alone), ("hit_ttft_ms", hit)):
            row[key].append(r.ttft_s * 1e3)
        row["equal_to_alone"] += pd.output_ids == alone.output_ids
        v = verdict(pd, hit)
        row["equal"] += v == "equal"
        row["near_tie"] += v == "near-tie"
        if v != "equal":
            row["differing"].append(
                {
                    "pair": i,
                    "verdict": v,
                    "pd": pd.output_ids,
                    "hit": hit.output_ids,
                    "pd_top": pd.top_logprobs,
                    "hit_top": hit.top_logprobs,
                }
            )
        if i == 0:
            control = one(
                c.decoder.url,
                name,
                [(prompt[0] + 1) % MODEL.vocab_size] + prompt[1:],
                args.max_tokens,
            )
            row["control_differs"] = control.output_ids != alone.output_ids
    # the GPU time of the prefiller's last writes after its last forward (what PD adds there;
    # kvtier's log)
    row["sender_ms"] = [
        float(ms) for t, ms in LAST_WRITES.findall(c.prefiller.log_text()) if int(t) == n
    ][-args.pairs :]
    pd_med = statistics.median(row["pd_ttft_ms"]) if row["pd_ttft_ms"] else None
    alone_med = statistics.median(row["alone_ttft_ms"]) if row["alone_ttft_ms"] else None
    return row | {
        "pd_median_ms": pd_med,
        "alone_median_ms": alone_med,
        "alone_over_pd": alone_med / pd_med if pd_med and alone_med else None,
        "sender_median_ms": statistics.median(row["sender_ms"]) if row["sender_ms"] else None,
    }


def recheck(path: Path) -> dict:
    """A record's differing answers judged again by `verdict` (they carry their tokens and
    top logprobs); the counts rewritten."""
    record = json.loads(path.read_text())

    def res(ids: list[int], tops: list[dict]) -> Result:
        r = Result(0, 0, 0, 0.0)
        r.output_ids, r.top_logprobs = ids, [{int(k): v for k, v in t.items()} for t in tops]
        return r

    for row in record["runs"]:
        for d in row["differing"]:
            if "verdict" in d:
                d["verdict"] = verdict(res(d["pd"], d["pd_top"]), res(d["hit"], d["hit_top"]))
        row["near_tie"] = sum(d.get("verdict") == "near-tie" for d in row["differing"])
    record["rechecked_with_near_tie"] = NEAR_TIE
    path.write_text(json.dumps(record, indent=1))
    return record


def main() -> None:
    import sys

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--buffer-gb", type=float, default=12.0, help="the decoder's pd_buffer_size")
    p.add_argument("--eager", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--model-dir", default="/tmp/kvtier-pd-model")
    p.add_argument(
        "--engine",
        choices=("kvtier", "lmcache"),
        default="kvtier",
        help="whose PD runs in the two servers: kvtier's (cuda_ipc) or LMCache's (nixl)",
    )
    p.add_argument("--out", default="results/gpu2-pd-vllm")
    p.add_argument("--recheck", type=Path, help="judge a record's differing answers again (no GPU)")
    args = p.parse_args()
    args.argv = sys.argv[1:]
    if args.recheck:
        record = recheck(args.recheck)
    else:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        record = run(args)
        (Path(args.out) / "pd-vllm.json").write_text(json.dumps(record, indent=1))
    for r in record["runs"]:
        print(
            f"{r['tokens']:6d} tokens: PD {r['pd_median_ms']:.1f} ms, "
            f"decoder alone {r['alone_median_ms']:.1f} ms, "
            f"equal to the decoder's hit {r['equal']}, parting at a near-tie {r['near_tie']}, "
            f"of {len(r['pd_ttft_ms'])}; failed {r['failed']}"
        )
    bad = [
        r
        for r in record["runs"]
        if r["failed"]
        or r["equal"] + r["near_tie"] != len(r["pd_ttft_ms"])
        or not r.get("control_differs")
    ]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
