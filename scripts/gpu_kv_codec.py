"""Accuracy (and local speed) of the lossy KV codecs on the transformers Llama, on a GPU.

    python3 scripts/gpu_kv_codec.py [OUT_JSON] [--lengths 4096 16384] [--new 32]

The Llama-3.1-8B-shaped model of `kvtier bench ttft` (random weights, bf16,
SDPA). Per prompt length and codec (naive = lossless, int8, fp8), one
session with the CPU tier: the prompt is computed cold (kvtier off), then
stored, then loaded warm through the codec. Reported:
  - K and V of the loaded prefix against the cold run's: max and mean
    absolute error, and the mean error over the mean |x|
  - the first generated token's distribution: max |Δ logprob| over the
    vocabulary and Δ logprob of the cold greedy token
  - greedy decoding of `--new` tokens: how many equal the cold run's, and
    how many lead before the first difference
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtier.bench.offload import machine_name, timed  # noqa: E402
from kvtier.bench.ttft import LLAMA_8B, _kv_bytes_per_token, build_model  # noqa: E402
from kvtier.config import KvtierConfig  # noqa: E402
from kvtier.integrations.hf import HFSession  # noqa: E402

CODECS = ("naive", "int8", "fp8")


def kv_of(session: HFSession, n: int) -> torch.Tensor:
    """[L, 2, H, n, D]: the session's K and V of the first n tokens."""
    return torch.stack([b[:, 0, :, :n] for b in session.buffers])


def measure(model, tokens: int, new: int, repeats: int) -> dict:
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    pool_gib = (tokens + 512) * _kv_bytes_per_token(model) * 1.05 / 1024**3
    out: dict = {"tokens": tokens}
    cold_tokens = cold_logp = cold_kv = None
    for codec in CODECS:
        cfg = KvtierConfig(chunk_size=256, max_local_cpu_size=pool_gib, remote_serde=codec)
        session = HFSession(model, cfg, max_len=tokens + new)
        with torch.inference_mode():
            if cold_tokens is None:
                cold_tokens = session.generate(ids, new, use_cache=False)
                cold_logp = torch.log_softmax(session.prefill(ids, use_cache=False).logits.float(), -1)
            session.prefill(ids)  # a miss: computes the prompt and stores its chunks through the codec
            if cold_kv is None:  # the KV as computed
                cold_kv = kv_of(session, tokens).clone()
            warm = session.prefill(ids)
            hit = warm.hit_tokens
            warm_kv = kv_of(session, hit).float()
            ref = cold_kv[..., :hit, :].float()
            err = (warm_kv - ref).abs()
            logp = torch.log_softmax(warm.logits.float(), -1)
            greedy = int(cold_logp.argmax())
            warm_tokens = session.generate(ids, new)
            times = [timed(lambda: session.prefill(ids), torch.device("cuda")) for _ in range(repeats)]
        lead = next((i for i, (a, b) in enumerate(zip(cold_tokens, warm_tokens)) if a != b), new)
        out[codec] = {
            "hit_tokens": hit,
            "chunk_bytes_over_bf16": round(session.engine.chunk_bytes_per_token / _kv_bytes_per_token(model), 4),
            "k_max_abs_err": float(err[:, 0].max()), "k_mean_abs_err": float(err[:, 0].mean()),
            "v_max_abs_err": float(err[:, 1].max()), "v_mean_abs_err": float(err[:, 1].mean()),
            "k_mean_rel_err": float(err[:, 0].mean() / ref[:, 0].abs().mean()),
            "v_mean_rel_err": float(err[:, 1].mean() / ref[:, 1].abs().mean()),
            "first_token_max_abs_dlogprob": float((logp - cold_logp).abs().max()),
            "first_token_greedy_dlogprob": float(logp[0, greedy] - cold_logp[0, greedy]),
            "greedy_equal": sum(a == b for a, b in zip(cold_tokens, warm_tokens)), "greedy_leading_equal": lead,
            "greedy_of": new, "warm_cpu_s": round(statistics.median(times), 4),
        }
        print(json.dumps({"tokens": tokens, "codec": codec, **out[codec]}), flush=True)
        session.engine.close()
        del session
        torch.cuda.empty_cache()
    for codec in CODECS[1:]:
        out[codec]["warm_cpu_over_lossless"] = round(out[codec]["warm_cpu_s"] / out["naive"]["warm_cpu_s"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("output", nargs="?", default="results/gpu/kv-codec.json")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    model = build_model()
    points = [measure(model, n, args.new, args.repeats) for n in args.lengths]
    record = {"machine": machine_name(torch.device("cuda")), "date": dt.date.today().isoformat(),
              "model": LLAMA_8B, "weights": "random (seed 0), bf16", "attention": "sdpa",
              "command": "python3 scripts/gpu_kv_codec.py " + " ".join(sys.argv[1:]), "points": points}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
