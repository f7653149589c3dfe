"""How fast the host-to-device copies of a layerwise load can go, by shape (GPU).

    python3 scripts/gpu_copy_shapes.py OUT.json [chunks]

A pinned host buffer of `chunks` chunks laid out as the CPU tier and the store
server hold them ([chunk][layer][1 MiB]: 32 layers of 256 Llama-8B tokens),
copied to the GPU: as one contiguous copy (the ttft bench's floor), one 2-D
copy per layer (what a layerwise load queues), the same spread over two
streams, one copy per chunk and layer, and the layer-major layout's one
contiguous copy per layer. Medians of 7, GB/s and each over the contiguous copy."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kvtier.transfer import cudart  # noqa: E402

LAYERS, ROW = 32, 1 << 20


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


if __name__ == "__main__":
    out = Path(sys.argv[1])
    chunks = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    nbytes = chunks * LAYERS * ROW
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    h, d, chunk = host.data_ptr(), dev.data_ptr(), LAYERS * ROW

    def contiguous():
        with torch.cuda.stream(streams[0]):
            dev.copy_(host, non_blocking=True)

    def per_layer_2d(n_streams: int = 1):
        def run():
            for layer in range(LAYERS):
                cudart.memcpy2d(
                    d + layer * chunks * ROW,
                    ROW,
                    h + layer * ROW,
                    chunk,
                    ROW,
                    chunks,
                    streams[layer % n_streams],
                )

        return run

    def per_chunk_layer():
        for layer in range(LAYERS):
            for c in range(chunks):
                cudart.memcpy2d(
                    d + (layer * chunks + c) * ROW,
                    ROW,
                    h + c * chunk + layer * ROW,
                    ROW,
                    ROW,
                    1,
                    streams[0],
                )

    def layer_major():
        for layer in range(LAYERS):
            cudart.memcpy2d(
                d + layer * chunks * ROW,
                chunks * ROW,
                h + layer * chunks * ROW,
                chunks * ROW,
                chunks * ROW,
                1,
                streams[0],
            )

    shapes = {
        "contiguous": contiguous,
        "per_layer_2d": per_layer_2d(1),
        "per_layer_2d_two_streams": per_layer_2d(2),
        "per_chunk_and_layer": per_chunk_layer,
        "layer_major_per_layer": layer_major,
    }
    for fn in shapes.values():
        timed(fn)
    runs: dict[str, list[float]] = {k: [] for k in shapes}
    for _ in range(7):
        for name, fn in shapes.items():
            runs[name].append(timed(fn))
    med = {k: statistics.median(v) for k, v in runs.items()}
    report = {
        "chunks": chunks,
        "bytes": nbytes,
        "device": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "gbps": {k: round(nbytes / v / 1e9, 2) for k, v in med.items()},
        "over_contiguous": {k: round(med["contiguous"] / v, 3) for k, v in med.items()},
    }
    print(json.dumps(report, indent=1))
    out.write_text(json.dumps(report, indent=1) + "\n")
