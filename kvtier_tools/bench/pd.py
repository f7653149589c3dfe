"""`kvtier bench pd`: a prefiller's KV into a decoder's buffer, as the PD guide runs it.

Two processes, each a real kvtier piece: this one is the sender (a paged KV
cache of random Llama-3.1-8B-shaped KV, vLLM's flash-attn layout, random
block ids, and a PdSender), the other the receiver (a PdBuffer on its device
with its init and alloc ports, and a CacheEngine over its own paged cache).
Per run: the sender pushes `tokens` tokens ("prefill done" → Commit), then
the receiver loads them from its buffer into its paged cache ("loaded") and
answers with a checksum of what it loaded, compared with the sender's before
any figure counts. The limit, measured in the same run: a plain torch copy of
the same bytes from the sender's device to the receiver's.

    kvtier bench pd --sender-device cuda:0 --receiver-device cuda:1 --channels cuda_ipc nixl tcp
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from kvtier_tools.bench.offload import OffloadShape
from kvtier_tools.dev.localservers import free_ports

FMT_MODEL = "llama-3.1-8b-shape"


def per_token(shape: OffloadShape) -> int:
    """Bytes of KV per token of `shape` (flash-attn layout: K and V per layer)."""
    return shape.layers * 2 * shape.kv_heads * shape.head_dim * shape.torch_dtype.itemsize


@dataclass
class PdRun:
    channel: str
    tokens: int
    # cuda_ipc: chunks in a step's first and largest Alloc ("4,16"), "step", "sync-commit",
    # "forward=MS" (the send made as vLLM makes it: behind a forward still on the GPU, timed from
    # its end)
    pieces: str = "default"
    send_ms: list[float] = field(default_factory=list)
    load_ms: list[float] = field(default_factory=list)
    done_to_loaded_ms: list[float] = field(default_factory=list)
    copy_ms: list[float] = field(default_factory=list)
    # the sender's Alloc, write, Commit
    phases_ms: list[tuple[float, float, float]] = field(default_factory=list)
    # the sender's host work before the Alloc (the keys)
    keys_ms: list[float] = field(default_factory=list)
    # and after the Commit (log lines, the proxy's notice)
    after_ms: list[float] = field(default_factory=list)
    # GPU time from the KV written to the last write done (events)
    tail_ms: list[float] = field(default_factory=list)

    def summary(self, bytes_per_token: int) -> dict:
        nbytes = self.tokens * bytes_per_token
        send, copy = statistics.median(self.send_ms), statistics.median(self.copy_ms)
        return {
            "channel": self.channel,
            "tokens": self.tokens,
            "pieces": self.pieces,
            "GB": round(nbytes / 1e9, 3),
            "send_ms": round(send, 2),
            "send_GBps": round(nbytes / send / 1e6, 1),
            "copy_ms": round(copy, 2),
            "copy_GBps": round(nbytes / copy / 1e6, 1),
            "ratio_to_copy": round(copy / send, 3),
            "load_ms": round(statistics.median(self.load_ms), 2),
            "alloc_write_commit_ms": [
                round(statistics.median(p[i] for p in self.phases_ms), 2) for i in range(3)
            ],
            "keys_ms": round(statistics.median(self.keys_ms), 2),
            "after_commit_ms": round(statistics.median(self.after_ms), 2),
            "gpu_tail_ms": round(statistics.median(self.tail_ms), 2) if self.tail_ms else None,
            "done_to_loaded_ms": round(statistics.median(self.done_to_loaded_ms), 2),
        }


def _paged(shape: OffloadShape, tokens: int, device: str, fill: bool):
    from kvtier.transfer import PagedKV

    blocks = tokens // shape.block_size + 64
    make = torch.randn if fill else torch.zeros
    layers = [
        make(shape.layer_shape(blocks), device=device).to(shape.torch_dtype)
        for _ in range(shape.layers)
    ]
    return PagedKV.wrap(layers, "flash_attn"), layers


def _slots(blocks: int, block_size: int, tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(blocks, generator=g)[: -(-tokens // block_size)]
    return (ids[:, None] * block_size + torch.arange(block_size)[None, :]).flatten()[:tokens]


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128000, (n,), generator=g).tolist()


def checksum(layers: list[torch.Tensor], slots: torch.Tensor, block_size: int) -> int:
    """A position-weighted sum of the KV at `slots`, in their order (device-side)."""
    total = 0
    dev = layers[0].device
    block, offset = slots.to(dev) // block_size, slots.to(dev) % block_size
    for i, layer in enumerate(layers):
        x = layer[:, block, offset].contiguous().view(torch.int16).to(torch.int64).flatten()
        w = torch.arange(x.numel(), device=dev) % 1009 + i + 1
        total += int((x * w).sum())
    return total


def _config(
    shape: OffloadShape,
    role: str,
    channel: str,
    device: str,
    buffer_bytes: int,
    init: int,
    alloc: int,
):
    from kvtier.config import KvtierConfig

    dev = "cuda" if device.startswith("cuda") else "cpu"
    return KvtierConfig(
        chunk_size=shape.chunk_size,
        local_cpu=False,
        max_local_cpu_size=1.0,
        save_unfull_chunk=True,
        enable_pd=True,
        pd_role=role,
        transfer_channel=channel,
        pd_buffer_size=buffer_bytes,
        pd_buffer_device=dev,
        pd_peer_host="127.0.0.1",
        pd_peer_init_port=init,
        pd_peer_alloc_port=alloc,
        blocking_timeout_secs=60.0,
        pd_allocation_timeout_sec=30.0,
    )


def serve_receiver(args: argparse.Namespace) -> None:
    """The receiver process: buffer and ports, then load commands from stdin."""
    from kvtier.engine import CacheEngine
    from kvtier.keys import KVFormat
    from kvtier.pd.build import make_buffer, start_receiver

    shape = OffloadShape(**json.loads(args.shape))
    if args.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(args.device))
    kv, layers = _paged(shape, args.max_tokens, args.device, fill=False)
    fmt = KVFormat(FMT_MODEL, "flash_attn", shape.dtype)
    config = _config(
        shape,
        "receiver",
        args.channel,
        args.device,
        args.buffer_bytes,
        args.init_port,
        args.alloc_port,
    )
    buffer = make_buffer(config, kv, fmt)
    receiver = start_receiver(config, buffer, 0)
    engine = CacheEngine(config, kv, fmt, cpu=buffer.tier)
    print("READY", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        tokens = _tokens(cmd["tokens"], cmd["seed"])
        slots = _slots(kv.num_blocks, shape.block_size, cmd["tokens"], cmd["seed"] + 1)
        _sync(args.device)
        t0 = time.perf_counter()
        mask = engine.retrieve(tokens, slots)
        _sync(args.device)
        load_ms = (time.perf_counter() - t0) * 1e3
        buffer.release(cmd["req_id"])
        reply = {
            "load_ms": load_ms,
            "loaded": int(mask.sum()),
            "checksum": checksum(layers, slots, shape.block_size),
        }
        print("RESULT " + json.dumps(reply), flush=True)
    receiver.close()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def run_pd(
    shape: OffloadShape,
    token_counts: list[int],
    channels: list[str],
    sender_device: str,
    receiver_device: str,
    repeats: int,
    pieces: tuple[str, ...] = ("default",),
) -> dict:
    """`pieces` (cuda_ipc): A/B of how a step is reserved and committed, paired: each
    repeat sends once each way in turn, to one receiver: "default" (the sender's), "F,M"
    (first piece F chunks, doubling up to M), "step" (one Alloc), "gather-after-alloc" (no
    gather into the ring while the Alloc travels), "sync-commit" (the Commit
    sent after the writes are done), "group=MiB" (the writes' ring slots and groups of that
    size), "first=MiB" (the step's first group of that size, growing to the slot's),
    "forward=MS" (the default sender called as vLLM calls it, at wait_for_save: behind a
    forward of MS ms still running on the GPU, which wrote the KV; timed from that
    forward's end to the Commit done, what a decoder waits for after the last forward).

    A lone send ("default") is timed from the sender's call: the prompt's keys, the Alloc's
    round trip and the launches are in it. Inside vLLM they run while the GPU computes the
    step's forward (its host launches the forward and calls wait_for_save at once)."""
    max_tokens = max(token_counts)
    if sender_device.startswith("cuda"):
        torch.cuda.set_device(torch.device(sender_device))
    kv, layers = _paged(shape, max_tokens, sender_device, fill=True)
    bench = _PdBench(shape, kv, layers, sender_device, receiver_device, repeats)
    runs: list[PdRun] = []
    for channel in channels:
        with _Receiver(shape, channel, receiver_device, max_tokens) as receiver:
            runs += _channel_runs(
                bench, receiver, token_counts, pieces if channel == "cuda_ipc" else ("default",)
            )
    return {
        "shape": asdict(shape),
        "sender_device": sender_device,
        "receiver_device": receiver_device,
        "machine": _machine(sender_device, receiver_device),
        "date": time.strftime("%Y-%m-%d"),
        "repeats": repeats,
        "runs": [r.summary(per_token(shape)) | {"raw": asdict(r)} for r in runs],
    }


@dataclass(frozen=True)
class _PdBench:
    """The sender's side of the benchmark: its paged KV and where the bytes go."""

    shape: OffloadShape
    kv: Any  # PagedKV
    layers: list
    sender_device: str
    receiver_device: str
    repeats: int


class _Receiver:
    """The receiving process (`--serve-receiver`): its buffer, its ports, and the requests it
    loads."""

    def __init__(self, shape: OffloadShape, channel: str, device: str, max_tokens: int) -> None:
        self.init, self.alloc = free_ports(2)
        buffer_bytes = (max_tokens // shape.chunk_size + 2) * shape.chunk_size * per_token(shape)
        cmd = [
            sys.executable,
            "-m",
            "kvtier_tools.bench.pd",
            "--serve-receiver",
            "--device",
            device,
            "--channel",
            channel,
            "--buffer-bytes",
            str(buffer_bytes),
            "--init-port",
            str(self.init),
            "--alloc-port",
            str(self.alloc),
            "--max-tokens",
            str(max_tokens),
            "--shape",
            json.dumps(asdict(shape)),
        ]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=os.environ.copy()
        )
        self.channel = channel

    def __enter__(self) -> _Receiver:
        if _read_line(self.proc, "READY") is None:
            self.__exit__()
            raise RuntimeError(f"the {self.channel} receiver did not start")
        return self

    def load(self, n: int, seed: int) -> dict:
        """The receiver loads request `r{seed}` into its pages; its load time and checksum."""
        self.proc.stdin.write(json.dumps({"tokens": n, "seed": seed, "req_id": f"r{seed}"}) + "\n")
        self.proc.stdin.flush()
        return json.loads(_read_line(self.proc, "RESULT ") or "{}")

    def __exit__(self, *exc) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _channel_runs(
    bench: _PdBench, receiver: _Receiver, token_counts: list[int], variants: tuple[str, ...]
) -> list[PdRun]:
    from kvtier.engine import CacheEngine
    from kvtier.keys import KVFormat
    from kvtier.pd.sender import PdSender

    shape = bench.shape
    channel = receiver.channel
    sender_device = bench.sender_device
    receiver_device = bench.receiver_device
    # The sender's staging (tcp, nixl) sits where its KV is, as in the guide's config.
    config = _config(
        shape,
        "sender",
        channel,
        sender_device,
        1 << 30 if channel != "cuda_ipc" else 0,
        receiver.init,
        receiver.alloc,
    )
    engine = CacheEngine(config, bench.kv, KVFormat(FMT_MODEL, "flash_attn", shape.dtype))
    sender = PdSender(engine, config, 0)
    default, rings = (sender.pieces, sender.early_commit, sender.gather_early), {}
    runs = []
    for n in token_counts:
        pairs = {v: PdRun(channel, n, v) for v in variants}
        src = torch.empty(n * per_token(shape), dtype=torch.uint8, device=sender_device)
        dst = torch.empty(n * per_token(shape), dtype=torch.uint8, device=receiver_device)
        # the first is a warm-up (connection, IPC mapping, kernels)
        for r in range(bench.repeats + 1):
            for k, (variant, run) in enumerate(pairs.items()):
                _set_variant(sender, variant, default, rings)
                forward_ms = (
                    float(variant.removeprefix("forward="))
                    if variant.startswith("forward=")
                    else 0.0
                )
                times = _one_send(bench, sender, receiver, n, 1000 * n + 10 * r + k, forward_ms)
                copy_ms = _copy_ms(src, dst, sender_device, receiver_device)
                if r:
                    stats = sender.stats
                    for name, value in (
                        *times.items(),
                        ("copy_ms", copy_ms),
                        ("phases_ms", stats.last_ms),
                        ("keys_ms", stats.last_keys_ms),
                        ("after_ms", stats.last_after_ms),
                        ("tail_ms", stats.last_tail_ms),
                    ):
                        getattr(run, name).append(value)
        del src, dst
        for run in pairs.values():
            runs.append(run)
            s = run.summary(per_token(shape))
            print(
                f"{channel:9s} {run.pieces:>11s} {n:6d} tokens {s['GB']:.2f} GB | "
                f"send {s['send_ms']} ms = "
                f"{s['send_GBps']} GB/s ({s['ratio_to_copy']} of copy {s['copy_GBps']} GB/s) | "
                f"load {s['load_ms']} "
                f"ms | done->loaded {s['done_to_loaded_ms']} ms | keys {s['keys_ms']} "
                f"alloc/write/commit "
                f"{s['alloc_write_commit_ms']} after {s['after_commit_ms']} ms",
                flush=True,
            )
    sender.close()
    engine.close()
    return runs


def _set_variant(sender, variant: str, default: tuple, rings: dict) -> None:
    """The sender's way of reserving, writing and committing for `variant` (see `run_pd`);
    `default`: its own (pieces, early_commit, gather_early); `rings`: cuda_ipc's writers by group
    size ("default": the sender's own, once it has connected)."""
    from kvtier.pd.ipc_writes import IpcWriter

    sender.pieces, sender.early_commit, sender.gather_early = default
    channel = sender.channel
    if channel.ipc is not None:
        rings.setdefault("default", channel.ipc)
        channel.ipc = rings["default"]
    if variant == "sync-commit":
        sender.early_commit = False
    elif variant == "gather-after-alloc":
        sender.gather_early = False
    elif variant.startswith(("group=", "first=")) and channel.ipc is not None:
        if variant not in rings:
            mib = int(variant.split("=")[1]) << 20
            sizes = (mib, mib) if variant.startswith("group=") else (IpcWriter.GROUP_BYTES, mib)
            rings[variant] = IpcWriter(channel.ipc.device, sender.engine.pool.block_bytes, *sizes)
        channel.ipc = rings[variant]
    elif variant not in ("default", "gather-after-alloc") and not variant.startswith(
        ("group=", "first=", "forward=")
    ):
        sender.pieces = None if variant == "step" else tuple(int(x) for x in variant.split(","))


def _one_send(
    bench: _PdBench, sender, receiver: _Receiver, n: int, seed: int, forward_ms: float = 0.0
) -> dict[str, float]:
    """One request sent and loaded on the other side, checked: its send, load and end-to-end
    times. With `forward_ms`, the send is called behind a stand-in forward of that many ms
    queued on the sender's GPU (a spinning kernel, as vLLM's host calls wait_for_save while
    its forward runs), and its time counts from that forward's end (CUDA events) to the
    Commit done and every write landed."""
    from kvtier.pd.sender import Target

    shape, sender_device = bench.shape, bench.sender_device
    tokens, slots = _tokens(n, seed), _slots(bench.kv.num_blocks, shape.block_size, n, seed + 1)
    want = checksum(bench.layers, slots, shape.block_size)
    _sync(sender_device)
    forward = _Forward(sender_device, forward_ms) if forward_ms > 0 else None
    t0 = time.perf_counter()
    if forward is not None:
        forward.mark_call()
    sent = sender.send(
        Target("127.0.0.1", receiver.init, receiver.alloc, f"r{seed}"),
        tokens,
        slots,
        start=0,
        last=True,
    )
    _sync(sender_device)
    t1 = time.perf_counter()
    if forward is not None:
        t1 -= forward.left_at_call_ms() / 1e3
    reply = receiver.load(n, seed)
    t2 = time.perf_counter()
    if sent != n or reply["loaded"] != n or reply["checksum"] != want:
        raise RuntimeError(
            f"{receiver.channel}, {n} tokens: sent {sent}, loaded {reply['loaded']}, "
            f"checksum {reply['checksum']} != {want}: the data did not arrive intact"
        )
    return {
        "send_ms": (t1 - t0) * 1e3,
        "load_ms": reply["load_ms"],
        "done_to_loaded_ms": (t2 - t0) * 1e3,
    }


class _Forward:
    """A stand-in for the step's forward: a kernel spinning `ms` on the current stream, then
    an event at its end; the sender is called while it runs."""

    CALIBRATE_CYCLES = 20_000_000
    _cycles_per_ms: dict[str, float] = {}

    def __init__(self, device: str, ms: float) -> None:
        dev = torch.device(device)
        if device not in self._cycles_per_ms:
            self._cycles_per_ms[device] = self.CALIBRATE_CYCLES / _spin_ms(
                dev, self.CALIBRATE_CYCLES
            )
        torch.cuda._sleep(int(ms * self._cycles_per_ms[device]))
        self.end = torch.cuda.Event(enable_timing=True)
        self.end.record(torch.cuda.current_stream(dev))
        self.call = torch.cuda.Event(enable_timing=True)
        self._side = torch.cuda.Stream(dev)  # idle: its event is stamped when the host records it

    def mark_call(self) -> None:
        self.call.record(self._side)

    def left_at_call_ms(self) -> float:
        """How long the forward still ran after the sender was called (0 if it had ended)."""
        self.end.synchronize()
        return max(0.0, self.call.elapsed_time(self.end))


def _spin_ms(device: torch.device, cycles: int) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    stream = torch.cuda.current_stream(device)
    torch.cuda._sleep(cycles // 10)  # the clocks up
    a.record(stream)
    torch.cuda._sleep(cycles)
    b.record(stream)
    b.synchronize()
    return a.elapsed_time(b)


def _copy_ms(
    src: torch.Tensor, dst: torch.Tensor, sender_device: str, receiver_device: str
) -> float:
    """A plain device copy of the same bytes: the limit."""
    _sync(sender_device)
    c0 = time.perf_counter()
    dst.copy_(src)
    _sync(sender_device)
    _sync(receiver_device)
    return (time.perf_counter() - c0) * 1e3


def _read_line(proc: subprocess.Popen, prefix: str) -> str | None:
    """The rest of the receiver's next line starting with `prefix` (libraries print too)."""
    for line in proc.stdout:  # type: ignore[union-attr]
        if line.startswith(prefix):
            return line[len(prefix) :].strip()
    return None


def _machine(*devices: str) -> str:
    names = sorted(
        {
            torch.cuda.get_device_name(torch.device(d)) if d.startswith("cuda") else "cpu"
            for d in devices
        }
    )
    return ", ".join(names) + f"; {' -> '.join(devices)}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--serve-receiver", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--channel", default="tcp")
    p.add_argument("--buffer-bytes", type=int, default=0)
    p.add_argument("--init-port", type=int, default=0)
    p.add_argument("--alloc-port", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=0)
    p.add_argument("--shape", default="{}")
    serve_receiver(p.parse_args())


if __name__ == "__main__":
    main()
