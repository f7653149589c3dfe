"""`kvtier bench chaos --short` in CI: real vLLM (CPU build) with kvtier on CPU, disk and
a `kvtier server`, then a PD cluster with `kvtier proxy`, under a steady load while
every fault passes once (kvtier_tools/bench/chaos_faults.py). The promise: no request lost
(but the proxy's 502 while the decoder is dead), greedy outputs equal to plain
vLLM's, memory and open files flat, no wait on kvtier past its timeouts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvtier_tools.bench.chaos_faults import (
    DISK_FAULTS,
    PD_FAULTS,
    STORE_FAULTS,
    private_mounts_available,
)

pytestmark = [pytest.mark.vllm, pytest.mark.alone]  # its faults have bounds on wall time


@pytest.mark.timeout(1500)  # about 10 minutes: five vLLM starts, two of them restarts under load
def test_every_fault_under_load_costs_no_request_and_no_wrong_token(tmp_path):
    why = private_mounts_available()
    if why:
        pytest.skip(why)
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier.cli",
            "bench",
            "chaos",
            "--short",
            "--out",
            str(out),
            "--model-dir",
            str(tmp_path / "model"),
            "--work",
            str(tmp_path / "work"),
        ],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    record = json.loads((out / "chaos.json").read_text()) if (out / "chaos.json").exists() else None
    assert record is not None, done.stdout[-3000:] + done.stderr[-5000:]
    assert record["violations"] == [] and done.returncode == 0, (
        record["violations"],
        done.stdout[-4000:],
    )
    check(record)
    assert (out / "chaos-tiers.svg").read_text().startswith("<svg")


def check(record: dict) -> None:
    """What a short run's record must show besides an empty `violations`."""
    phases = {ph["phase"]: ph for part in record["parts"].values() for ph in part["phases"]}
    for fault in (*STORE_FAULTS, *DISK_FAULTS, *PD_FAULTS):
        assert fault in phases and f"after {fault}" in phases
    for name, ph in phases.items():  # the load ran through every phase, and answers came in each
        assert ph["sent"] >= 2 and ph["succeeded"] >= (0 if name == "decoder-killed" else 2), (
            name,
            ph,
        )
    # While the decoder was dead the proxy answered (502 at once); the prefiller's death cost
    # nothing.
    assert phases["decoder-killed"]["failed"] >= 1
    assert (
        phases["prefiller-killed"]["failed"] == 0 and phases["prefiller-killed"]["succeeded"] >= 2
    )
    for part in record["parts"].values():
        outputs = part["outputs"]
        assert (
            outputs["compared"] >= len(part["phases"]) and outputs["equal"] == outputs["compared"]
        )
        # outputs compared in each phase (none need succeed while the decoder is dead)
        assert all(n >= 1 for ph, n in outputs["per_phase"].items() if ph != "decoder-killed"), (
            outputs["per_phase"]
        )
    tiers = record["parts"]["tiers"]
    no_fault = next(ph for ph in tiers["phases"] if ph["phase"] == "no fault")
    assert no_fault["hit_rate"] > 0.5  # the workload reuses: most prompt tokens are kvtier hits
    assert tiers["recovery"]["store-killed"]["stores_remotely_again_s"] is not None


def test_the_promise_check_names_each_way_a_run_can_break_it():
    from kvtier_tools.bench.chaos_load import ChaosConfig, violations

    def phase(name, fault=None, **figures):
        return {
            "phase": name,
            "fault": fault,
            "failed": 0,
            "errors": {},
            "slowest_failure_s": None,
            "slowest_ttft_s": 0.2,
            "longest_waits_s": {"lookup_seconds": 0.1},
            **figures,
        }

    part = {
        "name": "tiers",
        "outputs": {"equal": 3, "compared": 3, "differing": []},
        "growth": {},
        "phases": [
            phase("no fault"),
            phase(
                "decoder-killed",
                "decoder-killed",
                failed=2,
                slowest_failure_s=0.1,
                errors={'HTTP 502: {"error": {"message": "decoder x unreachable"': 2},
            ),
        ],
    }
    record = {"parts": {"tiers": part}}
    assert violations(record, ChaosConfig()) == []
    part["phases"][0].update(
        failed=1,
        errors={"TimeoutError": 1},
        slowest_ttft_s=75.0,
        longest_waits_s={"lookup_seconds": 9.0},
    )
    part["phases"][1]["errors"]["HTTP 500: engine dead"] = 1
    part["outputs"] = {"equal": 2, "compared": 3, "differing": [{"index": 7}]}
    part["growth"] = {"vllm": {"rss": 0.2, "fds": 40}}
    found = "\n".join(violations(record, ChaosConfig()))
    for what in (
        "1 failed requests",
        "a stall",
        "a wait on kvtier of 9.00 s",
        "other than the proxy's 502",
        "1 of 3 outputs differ",
        "RSS grew 20.0%",
        "40 more open files",
    ):
        assert what in found, (what, found)
