"""Where a cuda_ipc send's time goes, each part timed alone (CUDA events, median of 5
after a warm-up), 4k, 16k and 32k tokens of Llama-3.1-8B-shaped KV:

    gather -> local    the gather kernel into chunks on the sender's own GPU
    gather -> peer     the same kernel writing straight into the other GPU (the old path)
    ring + copy        kvtier's IpcWriter: kernel into a local ring, copy engine into the peer
                       (its groups growing from one chunk to a slot)
    ring, flat groups  the same with every group a slot (256 MiB; before 2026-11-28 evening)
    copy               a plain torch copy of the same bytes, sender GPU -> receiver GPU (the limit)

    python3 -m kvtier_tools.bench.profiles.pd_write [--peer cuda:1]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from kvtier.engine import CacheEngine
from kvtier.keys import KVFormat
from kvtier.pd.ipc_writes import IpcWriter
from kvtier.transfer.cudart import DeviceBytes
from kvtier_tools.bench.offload import OffloadShape
from kvtier_tools.bench.pd import _config, _paged, _slots, per_token


def timed(fn, device: str) -> float:
    times = []
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[1:])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--peer", default="cuda:1" if torch.cuda.device_count() > 1 else "cuda:0")
    args = p.parse_args()
    shape, dev = OffloadShape(), "cuda:0"
    torch.cuda.set_device(dev)
    for n in (4096, 16384, 32768):
        kv, _ = _paged(shape, n, dev, fill=True)
        engine = CacheEngine(
            _config(shape, "sender", "cuda_ipc", dev, 0, 1, 2),
            kv,
            KVFormat("m", "flash_attn", shape.dtype),
        )
        slots = _slots(kv.num_blocks, shape.block_size, n, 7)
        spans = engine.spans(list(range(n)))
        per_chunk = shape.chunk_size * per_token(shape)
        nbytes = n * per_token(shape)
        local = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        peer = torch.empty(nbytes, dtype=torch.uint8, device=args.peer)
        peer.copy_(local)  # enables peer access (the kernel below writes through it)
        # The peer's memory as the sender sees a CUDA IPC mapping: an address on its own device.
        mapped = torch.as_tensor(DeviceBytes(peer.data_ptr(), nbytes), device=dev)
        local_views = [local[i * per_chunk : (i + 1) * per_chunk] for i in range(len(spans))]
        views = [mapped[i * per_chunk : (i + 1) * per_chunk] for i in range(len(spans))]
        ring = IpcWriter(torch.device(dev), per_chunk)
        flat = IpcWriter(torch.device(dev), per_chunk, first_bytes=IpcWriter.GROUP_BYTES)

        def through(writer: IpcWriter) -> None:
            step = writer.start(
                lambda places: engine.gather_addressed(slots, spans, places),
                spans,
                [per_chunk] * len(spans),
            )
            writer.write(step, views)[1].synchronize()

        def gather(part, buffers):
            engine.gather_into(slots, part, buffers)

        figures = {
            "gather -> local": timed(lambda: gather(spans, local_views), dev),
            "gather -> peer": timed(lambda: gather(spans, views), dev),
            "ring + copy": timed(lambda: through(ring), dev),
            "ring, flat groups": timed(lambda: through(flat), dev),
            "copy": timed(lambda: mapped.copy_(local), dev),
        }
        copy = figures["copy"]
        for name, ms in figures.items():
            print(
                f"{n:6d} tokens {nbytes / 1e9:.2f} GB {dev}->{args.peer}  {name:16s} {ms:7.2f} ms "
                f"{nbytes / ms / 1e6:6.0f} GB/s  {copy / ms:.2f} of the copy",
                flush=True,
            )
        engine.close()


if __name__ == "__main__":
    main()
