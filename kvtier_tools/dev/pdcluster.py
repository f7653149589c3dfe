"""LMCache's disaggregated-prefill guide (1P1D) on loopback: a decoder and a prefiller
(vLLM's OpenAI server with kvtier, as the guide configures them) and `kvtier proxy`.

    with pd_cluster(model_dir, workdir, "tcp") as c:
        c.url          the proxy: send requests here
        c.prefiller    demo.Server (kill/start keep its port)
        c.decoder      demo.Server; its init and alloc ports are in its config, so a
                       restarted decoder is found where it was

On a GPU both servers share it and the decoder's buffer is GPU memory; on CPU
the model runs in float32 (vLLM's CPU attention then keeps tokens one by one,
so hits need not end on a block boundary) with CPU buffers.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier_tools.dev.cpu_dtype import model_dtype
from kvtier_tools.dev.demo import Server, start_side_by_side, vllm_server
from kvtier_tools.dev.localservers import free_ports, wait_for_port


def on_gpu() -> bool:
    return model_dtype().device == "cuda"


def pd_dtype() -> str:
    return "bfloat16" if on_gpu() else "float32"


def connector(role: str, rpc: str, engine: str = "kvtier") -> dict:
    """The guide's kv-transfer-config; `engine` "lmcache": LMCache's own connector (GPU machine)."""
    name = (
        {"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.integrations.vllm"}
        if engine == "kvtier"
        else {"kv_connector": "LMCacheConnectorV1"}
    )
    return {
        **name,
        "kv_role": role,
        "kv_connector_extra_config": {"discard_partial_chunks": False, "lmcache_rpc_port": rpc},
    }


def _write_configs(
    tmp: Path,
    channel: str,
    init: int,
    alloc: int,
    notify: int,
    buffer_bytes: int,
    sender_buffer_bytes: int,
) -> None:
    """The guide's two config files (on CPU: the buffer in CPU RAM)."""
    device = "cuda" if on_gpu() else "cpu"
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "prefiller.yaml").write_text(
        f'local_cpu: False\nenable_pd: True\ntransfer_channel: "{channel}"\npd_role: "sender"\n'
        f'pd_proxy_host: "127.0.0.1"\npd_proxy_port: {notify}\n'
        f"pd_buffer_size: {sender_buffer_bytes}\n"
        f'pd_buffer_device: "{device}"\nchunk_size: 256\nmax_local_cpu_size: 0.05\n'
    )
    (tmp / "decoder.yaml").write_text(
        f'local_cpu: False\nenable_pd: True\ntransfer_channel: "{channel}"\npd_role: "receiver"\n'
        f'pd_peer_host: "127.0.0.1"\npd_peer_init_port: {init}\npd_peer_alloc_port: {alloc}\n'
        f'pd_buffer_size: {buffer_bytes}\npd_buffer_device: "{device}"\n'
        "chunk_size: 256\nmax_local_cpu_size: 0.05\n"
    )


def _placement(tp: int, split_cores: bool, two_gpus: bool) -> dict[str, dict[str, str]]:
    """Each server's own environment: its cores (CPU) or its GPU."""
    if two_gpus:
        return {
            "decoder": {"CUDA_VISIBLE_DEVICES": "1,0"},
            "prefiller": {"CUDA_VISIBLE_DEVICES": "0,1"},
        }
    if split_cores and tp == 1 and not on_gpu():
        return {
            "decoder": {"VLLM_CPU_OMP_THREADS_BIND": "0"},
            "prefiller": {"VLLM_CPU_OMP_THREADS_BIND": "1"},
        }
    return {"decoder": {}, "prefiller": {}}


def _engine_env(engine: str) -> dict[str, str]:
    if engine == "lmcache":  # its guide's UCX transports; its chunk keys hash with Python's hash()
        return {"UCX_TLS": "cuda_ipc,cuda_copy,tcp", "PYTHONHASHSEED": "0"}
    return {} if on_gpu() else {"UCX_TLS": "tcp,self,sm"}


@dataclass
class Cluster:
    prefiller: Server  # the first
    decoder: Server
    url: str  # the proxy's
    proxy: subprocess.Popen
    decoder_ports: tuple[int, int]  # its PD init and alloc ports (rank 0)
    prefillers: list[Server]


@contextlib.contextmanager
def pd_cluster(
    model_dir: Path,
    tmp: Path,
    channel: str,
    tp: int = 1,
    env: dict[str, str] | None = None,
    split_cores: bool = False,
    extra_args: Sequence[str] = (),
    two_gpus: bool = False,
    buffer_bytes: int = 64 << 20,
    max_model_len: int = 4096,
    gpu_util: float = 0.4,
    eager: bool = True,
    decoder_prefix_cache: bool = False,
    engine: str = "kvtier",
    prefillers: int = 1,
    prefiller_args: Callable[[int], Sequence[str]] | None = None,
    prefiller_prefix_cache: bool = False,
    proxy_args: Sequence[str] = (),
) -> Iterator[Cluster]:
    """The guide's 1P1D: decoder, prefiller (each with `tp` ranks) and `kvtier proxy`.
    `split_cores` (CPU, tp 1): the decoder's OpenMP threads on core 0, the prefiller's on
    core 1, so that one starting up is not starved by the other's spinning threads.
    `two_gpus` (tp 1): the prefiller computes on GPU 0, the decoder on GPU 1; each process
    sees both (CUDA_VISIBLE_DEVICES 0,1 and 1,0), so the prefiller can map the decoder's
    buffer over CUDA IPC. `buffer_bytes`: the decoder's pd_buffer_size. `decoder_prefix_cache`:
    vLLM's prefix cache on in the decoder, with its dev endpoints (POST /reset_prefix_cache).
    `engine` "lmcache" (GPU machine, LMCache installed, `channel` nixl): LMCache 0.5.x's PD
    backend in both servers, as its guide runs it (UCX_TLS=cuda_ipc,cuda_copy,tcp; the sender's
    buffer as large as the decoder's: it holds a request's chunks; one PYTHONHASHSEED, which
    its chunk keys hash with), `kvtier proxy --pd-engine lmcache` in front. `prefillers`: how
    many (each its own server, started beside the decoder but on one GPU), `prefiller_args(i)`
    the extra arguments of prefiller i, `prefiller_prefix_cache` vLLM's prefix cache on in
    them, `proxy_args` the proxy's extra flags."""
    init, alloc, notify, port = free_ports(4)
    _write_configs(
        tmp,
        channel,
        init,
        alloc,
        notify,
        buffer_bytes,
        buffer_bytes if engine == "lmcache" else 64 << 20,
    )
    env = {**_engine_env(engine), "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    args = list(extra_args)
    # decoder rank r listens on the init and alloc ports + r; the sender's rank r finds it there
    if tp > 1:
        args += ["--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp"]
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % 2) for r in range(tp))
    cores = _placement(tp, split_cores, two_gpus)
    server = {
        "dtype": pd_dtype(),
        "max_model_len": max_model_len,
        "extra_args": args,
        "eager": eager,
        "gpu_memory_utilization": gpu_util,
    }
    dev_mode = {"VLLM_SERVER_DEV_MODE": "1"} if decoder_prefix_cache else {}
    with contextlib.ExitStack() as stack:
        decoder = vllm_server(
            model_dir,
            tmp / "decoder",
            env={
                **env,
                **cores["decoder"],
                **dev_mode,
                "LMCACHE_CONFIG_FILE": str(tmp / "decoder.yaml"),
            },
            kv_connector=connector("kv_consumer", "consumer1", engine),
            prefix_caching=decoder_prefix_cache,
            **server,
        )
        prefiller_servers = [
            vllm_server(
                model_dir,
                tmp / ("prefiller" if i == 0 else f"prefiller{i}"),
                env={
                    **env,
                    **cores["prefiller"],
                    "LMCACHE_CONFIG_FILE": str(tmp / "prefiller.yaml"),
                },
                kv_connector=connector("kv_producer", f"producer{i + 1}", engine),
                prefix_caching=prefiller_prefix_cache,
                **{
                    **server,
                    "extra_args": [*args, *(prefiller_args(i) if prefiller_args else ())],
                },
            )
            for i in range(prefillers)
        ]
        if on_gpu() and not two_gpus:  # one GPU: each start's memory profile counts the other's
            dec, *pres = [stack.enter_context(cm) for cm in [decoder, *prefiller_servers]]
        else:  # side by side: a prefiller's sender reaches the decoder at its first request
            dec, *pres = start_side_by_side(stack, [decoder, *prefiller_servers])
        pre = pres[0]
        cmd = [
            sys.executable,
            "-m",
            "kvtier.cli",
            "proxy",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prefiller-host",
            "127.0.0.1",
            "--prefiller-port",
            ",".join(p.url.rsplit(":", 1)[1] for p in pres),
            "--num-prefillers",
            str(prefillers),
            "--decoder-host",
            "127.0.0.1",
            "--decoder-port",
            dec.url.rsplit(":", 1)[1],
            "--decoder-init-port",
            str(init),
            "--decoder-alloc-port",
            str(alloc),
            "--proxy-host",
            "127.0.0.1",
            "--proxy-port",
            str(notify),
            "--num-decoders",
            "1",
            "--pd-engine",
            engine,
            *proxy_args,
        ]
        with open(tmp / "proxy.log", "wb") as log:
            proxy = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for_port(port, 60, proxy)
            yield Cluster(pre, dec, f"http://127.0.0.1:{port}", proxy, (init, alloc), pres)
        finally:
            proxy.send_signal(signal.SIGINT)
            try:
                proxy.wait(10)
            except subprocess.TimeoutExpired:
                proxy.kill()
                proxy.wait()
