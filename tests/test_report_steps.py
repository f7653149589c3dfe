"""kvtier_tools.bench.report_steps on a step file written by hand: the rounds, each request's
first token, and the tables beside a chat run's records (the recorder itself runs inside real
vLLM in tests/test_vllm_chat.py)."""

import json
from pathlib import Path

import pytest

from kvtier_tools.bench.report_steps import (
    beside_records,
    by_turn,
    host_by_kind,
    read,
    report,
    rounds,
    ttfts,
)


def write_server(folder: Path, t0: float) -> None:
    """A warm-up request, then a round of two: r0 (turn 0, 600 tokens, two steps) and r1
    (turn 1, 300 tokens, one step beside r0's first decode)."""
    ms = 1e-3
    rows = [
        {"k": "a", "t": t0, "d": 0, "id": "warm", "n": 10},
        {"k": "s", "t": t0, "d": ms, "n": 10, "p": {"warm": 10}, "dec": 0, "new": [["warm", 0]]},
        {"k": "x", "t": t0, "d": ms, "n": 0},
        {"k": "y", "t": t0, "d": ms},
        {"k": "u", "t": t0 + 5 * ms, "d": 0, "n": 10, "first": ["warm"]},
        {"k": "a", "t": t0 + 1.0, "d": 0, "id": "r0", "n": 600},
        {
            "k": "s",
            "t": t0 + 1.0,
            "d": 2 * ms,
            "n": 600,
            "p": {"r0": 600},
            "dec": 0,
            "new": [["r0", 0]],
        },
        {"k": "x", "t": t0 + 1.0, "d": 20 * ms},
        {"k": "y", "t": t0 + 1.02, "d": 4 * ms},
        {"k": "u", "t": t0 + 1.05, "d": 0, "n": 600, "first": ["r0"]},
        {"k": "a", "t": t0 + 1.051, "d": 0, "id": "r1", "n": 400},
        {
            "k": "s",
            "t": t0 + 1.052,
            "d": 1 * ms,
            "n": 301,
            "p": {"r1": 300},
            "dec": 1,
            "new": [["r1", 100]],
        },
        {"k": "x", "t": t0 + 1.053, "d": 10 * ms},
        {"k": "y", "t": t0 + 1.063, "d": 2 * ms},
        {"k": "u", "t": t0 + 1.08, "d": 0, "n": 301, "first": ["r1"]},
        {"k": "s", "t": t0 + 1.081, "d": 0.5 * ms, "n": 2, "p": {}, "dec": 2, "new": []},
        {"k": "x", "t": t0 + 1.082, "d": 1 * ms},
        {"k": "y", "t": t0 + 1.083, "d": 1 * ms},
        {"k": "u", "t": t0 + 1.09, "d": 0, "n": 2, "first": []},
    ]
    folder.mkdir(parents=True)
    (folder / "steps-7.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


# the client's view of the round: r0 sent at 0, r1 at 40 ms; first tokens 70 / 50 ms later
REQUESTS = [
    {"conversation": 0, "turn": 0, "prompt_tokens": 600, "sent_s": 0.0, "ttft_s": 0.07},
    {"conversation": 0, "turn": 1, "prompt_tokens": 400, "sent_s": 0.04, "ttft_s": 0.05},
]


def test_a_round_after_the_warm_up_and_each_requests_first_token(tmp_path):
    write_server(tmp_path / "kvtier", 1000.0)
    arrivals, steps = read(tmp_path / "kvtier")
    assert [s.tokens for s in steps] == [10, 600, 301, 2]
    assert steps[1].execute == pytest.approx(0.02) and steps[1].host == pytest.approx(0.024)
    assert steps[2].cached == {"r1": 100} and steps[2].schedule == pytest.approx(0.001)
    (r,) = rounds(arrivals, steps, per_round=2)  # the warm-up is no round
    assert list(r.arrivals) == ["r0", "r1"] and len(r.steps) == 3
    assert ttfts(r) == pytest.approx([50.0, 29.0])
    # a round cut short is left out
    assert rounds(arrivals, steps, per_round=3) == []
    lines = report([tmp_path / "kvtier"], per_round=2, window=1.0, requests=2)
    assert lines[1] == "round 1, kvtier: 3 steps in 1.0 s"
    assert lines[2].split() == ["0.0", "50.0", "24.0", "600", "0:600", "first", "0"]
    assert lines[3].split()[-4:] == ["1:300+h100", "1d", "first", "1"]


def test_the_turn_and_step_tables_beside_the_clients_records(tmp_path):
    write_server(tmp_path / "kvtier", 1000.0)
    rs = rounds(*read(tmp_path / "kvtier"), per_round=2)
    table = by_turn(rs, [REQUESTS])
    # r1: scheduled 1 ms after it arrived, its first token's step out 28 ms later; it arrived
    # 51 ms after r0 but was sent 40 ms after it (in: 11 ms), and the client saw its first
    # token 90 ms after r0's send where the engine had it 80 ms after r0's arrival (out: 10)
    assert table[2] == "| 0 | 1 | 0.0 | 50.0 | 0.0 | 20.0 | 70.0 |"
    assert table[3] == "| 1 | 1 | 1.0 | 28.0 | 11.0 | 10.0 | 50.0 |"
    kinds = host_by_kind(rs, [REQUESTS])
    assert kinds[2:] == [
        "| decodes | 1 | 0.50 | 1.00 | 1.00 |",
        "| prefill <= 512, turns 1-2 | 1 | 1.00 | 10.00 | 2.00 |",
        "| prefill > 512 | 1 | 2.00 | 20.00 | 4.00 |",
    ]
    packed = {
        "kvtier#1": {
            "workload": {},
            "request_fields": list(REQUESTS[0]),
            "requests": [list(q.values()) for q in REQUESTS],
            "summary": {},
        }
    }
    (tmp_path / "chat.json").write_text(json.dumps(packed))
    lines = beside_records([tmp_path / "kvtier"], tmp_path / "chat.json", per_round=2)
    assert lines[0] == "kvtier: 1 rounds" and table[3] in lines and kinds[-1] in lines
