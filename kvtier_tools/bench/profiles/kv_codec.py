"""Accuracy (and local speed) of the lossy KV codecs on the transformers Llama, on a GPU.

    python3 -m kvtier_tools.bench.profiles.kv_codec [OUT_JSON] [--lengths 4096 16384] [--new 32]

The Llama-3.1-8B-shaped model of `kvtier bench ttft` (random weights, bf16,
SDPA). Per prompt length and codec (naive = lossless, int8, fp8, int4), one
session with the CPU tier: the prompt is computed cold (kvtier off), then
stored, then loaded warm through the codec. Beside them, vLLM's own fp8 KV
cache (`--kv-cache-dtype fp8`, e4m3 with scale 1.0): the prompt's KV rounded
so, then decoded (`vllm-fp8`). Reported:
  - K and V of the loaded prefix against the cold run's: max and mean
    absolute error, and the mean error over the mean |x|
  - decoding `--new` tokens against the lossless warm run: greedy tokens
    equal (and leading before the first difference); with the reference's
    tokens fed (teacher forcing), top-1 agreement per step and |Δ logprob|
    of the reference token; the first token's max |Δ logprob| over the
    vocabulary. The lossless warm run is also compared with the cold one:
    with random weights the distribution is flat and even bit-exact KV
    flips greedy tokens once the last prompt token is computed alone
    (another kernel shape than in the full prefill); that is the floor.
  - warm TTFT from CPU RAM (median of 7) against the lossless one
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
from pathlib import Path

import torch

from kvtier.config import KvtierConfig
from kvtier.integrations.hf import HFSession, KvtierCache
from kvtier_tools.bench.offload import machine_name, timed
from kvtier_tools.bench.ttft import LLAMA_8B, build_model
from kvtier_tools.bench.ttft_sources import kv_bytes_per_token as _kv_bytes_per_token

CODECS = ("naive", "int8", "fp8", "int4")
VLLM_FP8 = "vllm-fp8"  # the prompt's KV as --kv-cache-dtype fp8 holds it (rounded_as_vllm_fp8)


def kv_of(session: HFSession, n: int) -> torch.Tensor:
    """[L, 2, H, n, D]: the session's K and V of the first n tokens."""
    return torch.stack([b[:, 0, :, :n] for b in session.buffers])


def forced(
    session: HFSession, ids: torch.Tensor, tokens: list[int], use_cache: bool
) -> torch.Tensor:
    """[len(tokens), vocab] log-probabilities of each step when `tokens` are fed after the
    prompt (teacher forcing: one path's choices, so one flip does not change every later step)."""
    result = session.prefill(ids, use_cache=use_cache)
    feed = torch.tensor(tokens[:-1], device=session.buffers[0].device)[None]
    later = session.model(input_ids=feed, past_key_values=result.cache, use_cache=True).logits[0]
    return torch.log_softmax(torch.cat([result.logits, later]).float(), -1)


def rounded_as_vllm_fp8(session: HFSession, ids: torch.Tensor) -> tuple[torch.Tensor, KvtierCache]:
    """The prompt computed cold, its KV but the last token's rounded as vLLM's fp8 KV cache
    stores it without calibrated scales (e4m3, scale 1.0, saturating at 448), then the last
    token computed on it: what a hit gives with `--kv-cache-dtype fp8`, beside the codecs'
    warm hits (the tokens decoded after the prompt keep their own KV unrounded in both)."""
    n = ids.numel()
    session.prefill(ids, use_cache=False)
    for b in session.buffers:
        prefix = b[..., : n - 1, :]
        prefix.copy_(prefix.float().clamp(-448, 448).to(torch.float8_e4m3fn).to(b.dtype))
    cache = KvtierCache(session.buffers, n - 1)
    last = ids.reshape(1, -1)[:, n - 1 :].to(session.buffers[0].device)
    out = session.model(input_ids=last, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1], cache


def vllm_fp8_row(model, ids: torch.Tensor, new: int, ref) -> dict:
    """Decoding with the prompt's KV in vLLM's fp8 against the lossless warm run `ref`."""
    session = HFSession(model, KvtierConfig(local_cpu=False), max_len=ids.numel() + new)
    with torch.inference_mode():
        row = {"vs_lossless_warm": _vllm_fp8_decoding(session, ids, new, ref)}
    session.engine.close()
    print(json.dumps({"tokens": ids.numel(), "codec": VLLM_FP8, **row}), flush=True)
    return row


def _vllm_fp8_decoding(session: HFSession, ids: torch.Tensor, new: int, ref) -> dict:
    logits, cache = rounded_as_vllm_fp8(session, ids)
    token = logits.argmax(-1)
    tokens = [int(token)]
    for _ in range(new - 1):
        step = session.model(input_ids=token[:, None], past_key_values=cache, use_cache=True)
        token = step.logits[:, -1].argmax(-1)
        tokens.append(int(token))
    logits, cache = rounded_as_vllm_fp8(session, ids)
    feed = torch.tensor(ref[0][:-1], device=logits.device)[None]
    later = session.model(input_ids=feed, past_key_values=cache, use_cache=True).logits[0]
    logp = torch.log_softmax(torch.cat([logits, later]).float(), -1)
    return compare(tokens, logp, *ref)


def compare(
    tokens: list[int], logp: torch.Tensor, ref_tokens: list[int], ref_logp: torch.Tensor
) -> dict:
    """How far one run's decoding is from a reference run's."""
    picked = torch.tensor(ref_tokens, device=logp.device)[:, None]
    delta = (logp.gather(1, picked) - ref_logp.gather(1, picked)).abs()
    return {
        "greedy_equal": sum(a == b for a, b in zip(tokens, ref_tokens)),
        "greedy_leading_equal": next(
            (i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(ref_tokens)
        ),
        "forced_top1_agreement": float((logp.argmax(1) == ref_logp.argmax(1)).float().mean()),
        "forced_mean_abs_dlogprob": float(delta.mean()),
        "forced_max_abs_dlogprob": float(delta.max()),
        "first_token_max_abs_dlogprob": float((logp[0] - ref_logp[0]).abs().max()),
    }


def measure(model, tokens: int, new: int, repeats: int) -> dict:
    """Per codec: the loaded KV against the computed KV, and decoding against the
    lossless warm run (the same arithmetic but for the KV); the lossless run also
    against the cold one, which computes the last prompt token in another kernel
    shape: the noise floor of this comparison on this model."""
    ids = torch.randint(
        0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(tokens)
    )
    pool_gib = (tokens + 512) * _kv_bytes_per_token(model) * 1.05 / 1024**3
    out: dict = {"tokens": tokens, "new_tokens": new}
    cold_kv = ref = None
    for codec in CODECS:
        cfg = KvtierConfig(chunk_size=256, max_local_cpu_size=pool_gib, remote_serde=codec)
        session = HFSession(model, cfg, max_len=tokens + new)
        row: dict = {}
        with torch.inference_mode():
            # a miss: computes the prompt and stores its chunks through the codec
            session.prefill(ids)
            if cold_kv is None:  # the KV as computed
                cold_kv = kv_of(session, tokens).clone()
                cold_tokens = session.generate(ids, new, use_cache=False)
                cold = (cold_tokens, forced(session, ids, cold_tokens, use_cache=False))
            warm = session.prefill(ids)
            hit = warm.hit_tokens
            ref_kv = cold_kv[..., :hit, :].float()
            err = (kv_of(session, hit).float() - ref_kv).abs()
            row.update(
                {
                    "hit_tokens": hit,
                    "chunk_bytes_over_bf16": round(
                        session.engine.chunk_bytes_per_token / _kv_bytes_per_token(model), 4
                    ),
                    "k_max_abs_err": float(err[:, 0].max()),
                    "k_mean_abs_err": float(err[:, 0].mean()),
                    "v_max_abs_err": float(err[:, 1].max()),
                    "v_mean_abs_err": float(err[:, 1].mean()),
                    "k_mean_rel_err": float(err[:, 0].mean() / ref_kv[:, 0].abs().mean()),
                    "v_mean_rel_err": float(err[:, 1].mean() / ref_kv[:, 1].abs().mean()),
                }
            )
            del err, ref_kv
            warm_tokens = session.generate(ids, new)
            if ref is None:  # lossless warm: the reference of the lossy codecs
                ref = (warm_tokens, forced(session, ids, warm_tokens, use_cache=True))
                row["vs_cold"] = compare(
                    warm_tokens, forced(session, ids, cold[0], use_cache=True), *cold
                )
            row["vs_lossless_warm"] = compare(
                warm_tokens, forced(session, ids, ref[0], use_cache=True), *ref
            )
            times = [
                timed(lambda: session.prefill(ids), torch.device("cuda")) for _ in range(repeats)
            ]
        row["warm_cpu_s"] = round(statistics.median(times), 4)
        out[codec] = row
        print(json.dumps({"tokens": tokens, "codec": codec, **row}), flush=True)
        session.engine.close()
        session = None
        torch.cuda.empty_cache()
    out[VLLM_FP8] = vllm_fp8_row(model, ids, new, ref)
    for codec in CODECS[1:]:
        out[codec]["warm_cpu_over_lossless"] = round(
            out[codec]["warm_cpu_s"] / out["naive"]["warm_cpu_s"], 3
        )
    return out


def markdown(record: dict) -> str:
    """The record's quality table: per prompt length, each lossy codec and vLLM's fp8 KV cache
    against the lossless warm run, over its first `new_tokens` greedy tokens."""
    lines = [
        "| tokens | KV | bytes of bf16's | KV mean rel. error | greedy tokens equal "
        "| forced top-1 agreement | mean / max abs. Δ logprob |",
        "|---|---|---|---|---|---|---|",
    ]
    for point in record["points"]:
        floor = {"k_mean_rel_err": 0.0, "vs_lossless_warm": point["naive"]["vs_cold"]}
        for codec in ("floor", *CODECS[1:], VLLM_FP8):
            row = floor if codec == "floor" else point[codec]
            vs = row["vs_lossless_warm"]
            size = row.get("chunk_bytes_over_bf16", 0.5 if codec == VLLM_FP8 else 1.0)
            err = row.get("k_mean_rel_err")
            name = {
                "floor": "kvtier bf16 against cold (the noise floor)",
                VLLM_FP8: "vLLM fp8 (e4m3, scale 1)",
            }.get(codec, f"kvtier {codec}")
            lines.append(
                f"| {point['tokens']:,} | {name} | {size:.3f} "
                f"| {'-' if err is None else f'{err:.4f}'} "
                f"| {vs['greedy_leading_equal']} of {point['new_tokens']} "
                f"| {vs['forced_top1_agreement']:.2f} "
                f"| {vs['forced_mean_abs_dlogprob']:.3f} / {vs['forced_max_abs_dlogprob']:.3f} |"
            )
    lines.append(f"\n{record['machine']}, {record['date']}, weights {record['weights']}.")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("output", nargs="?", default="results/gpu/kv-codec.json")
    ap.add_argument("--report", action="store_true", help="print OUTPUT's table (markdown)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    if args.report:
        print(markdown(json.loads(Path(args.output).read_text())))
        return
    model = build_model()
    points = [measure(model, n, args.new, args.repeats) for n in args.lengths]
    record = {
        "machine": machine_name(torch.device("cuda")),
        "date": dt.date.today().isoformat(),
        "model": LLAMA_8B,
        "weights": "random (seed 0), bf16",
        "attention": "sdpa",
        "command": "python3 -m kvtier_tools.bench.profiles.kv_codec " + " ".join(sys.argv[1:]),
        "points": points,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
