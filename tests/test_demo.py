"""The README's demo, end to end: OpenAI server, streaming client, TTFT."""

import pytest

from kvtier_tools.dev.demo import run_demo

pytestmark = pytest.mark.vllm


def test_demo_warm_ttft_is_under_a_third_of_cold(tmp_path, capsys):
    result = run_demo(tmp_path, prompt_tokens=4200)
    out = capsys.readouterr().out
    assert "Cold TTFT" in out and "Warm TTFT" in out and "x faster" in out
    assert f"CPU model dtype: {result.dtype}" in out and result.dtype in ("bfloat16", "float32")
    (cold_total, cold_hit, _), (warm_total, warm_hit, warm_load) = result.hit_lines[:2]
    assert warm_total == cold_total >= 4096 and cold_hit == 0
    assert warm_total - 256 <= warm_hit < warm_total and warm_load == warm_hit
    assert result.warm_ttft <= result.cold_ttft / 3, (result.cold_ttft, result.warm_ttft)
