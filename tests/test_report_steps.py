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


def step(at: float, ms: float, prefills: dict[str, int], decodes: int, new: dict) -> list[dict]:
    """A step's lines: scheduled at `at` (its schedule 1 ms), its forward queued in `ms` and its
    sampling in ms / 5, its output taken in `ms` + 10 ms after `at`, giving the first token of
    the requests it finished (all its prefills here)."""
    n = sum(prefills.values()) + decodes
    sample = ms / 5
    return [
        {"k": "s", "t": at, "d": 1e-3, "n": n, "p": prefills, "dec": decodes,
         "new": [[r, c] for r, c in new.items()]},
        {"k": "x", "t": at + 1e-3, "d": ms * 1e-3},
        {"k": "y", "t": at + (1 + ms) * 1e-3, "d": sample * 1e-3},
        {"k": "u", "t": at + (ms + 10) * 1e-3, "d": 0, "n": n, "first": list(prefills)},
    ]  # fmt: skip


def arrival(at: float, rid: str, n: int) -> dict:
    return {"k": "a", "t": at, "d": 0, "id": rid, "n": n}


def write_server(folder: Path, t0: float) -> None:
    """A warm-up request, then a round of two: r0 (turn 0, 600 tokens in one step) and r1
    (turn 1, 300 new tokens on 100 cached, beside r0's first decode), then a decode step."""
    rows = [
        arrival(t0, "warm", 10),
        *step(t0, 1, {"warm": 10}, 0, {"warm": 0}),
        arrival(t0 + 1.0, "r0", 600),
        *step(t0 + 1.0, 40, {"r0": 600}, 0, {"r0": 0}),
        arrival(t0 + 1.051, "r1", 400),
        *step(t0 + 1.052, 18, {"r1": 300}, 1, {"r1": 100}),
        *step(t0 + 1.081, 0, {}, 2, {}),
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
    assert steps[1].execute == pytest.approx(0.04) and steps[1].host == pytest.approx(0.048)
    assert steps[2].cached == {"r1": 100} and steps[2].schedule == pytest.approx(0.001)
    (r,) = rounds(arrivals, steps, per_round=2)  # the warm-up is no round
    assert list(r.arrivals) == ["r0", "r1"] and len(r.steps) == 3
    assert ttfts(r) == pytest.approx([50.0, 29.0])
    # a round cut short is left out
    assert rounds(arrivals, steps, per_round=3) == []
    lines = report([tmp_path / "kvtier"], per_round=2, window=1.0, requests=2)
    assert lines[1] == "round 1, kvtier: 3 steps in 1.0 s"
    assert lines[2].split() == ["0.0", "50.0", "48.0", "600", "0:600", "first", "0"]
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
        "| decodes | 1 | 1.00 | 0.00 | 0.00 |",
        "| prefill <= 512, turns 1-2 | 1 | 1.00 | 18.00 | 3.60 |",
        "| prefill > 512 | 1 | 1.00 | 40.00 | 8.00 |",
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
