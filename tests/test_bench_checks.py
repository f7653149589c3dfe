"""The token checks of the GPU harness (kvtier.bench.vllm), on the tokens of a real run
(H100, vLLM 0.26, 32k tokens, 2026-11-26): plain vLLM's own cold prefill and GPU prefix hit
part at the 4th token, a near-tie in bf16."""

from kvtier.bench.vllm import agrees

PLAIN = {"cold": [124956, 86041, 56463, 53607, 47691, 48236],
         "gpu_hit": [124956, 86041, 56463, 91666, 19827, 39878]}


def test_cold_tokens_agree_with_plain_vllm_equal_or_on_its_own_near_tie():
    assert agrees(PLAIN["cold"], PLAIN)
    # layerwise (PIECEWISE graphs) took the GPU hit's side of the tie, then went its own way
    assert agrees([124956, 86041, 56463, 91666, 123492, 69999], PLAIN)


def test_cold_tokens_that_part_from_plain_elsewhere_or_otherwise_disagree():
    assert not agrees([124956, 86041, 1, 53607, 47691, 48236], PLAIN)  # before the tie
    assert not agrees([124956, 86041, 56463, 7, 47691, 48236], PLAIN)  # at it, neither side
    assert not agrees([124956, 86041, 56463, 53607, 47691, 5], PLAIN)  # after it, plain's cold side
    assert not agrees(PLAIN["cold"], {})


def test_pd_tokens_may_part_from_the_decoders_hit_only_at_a_near_tie():
    from kvtier.bench.chat import Result
    from kvtier.bench.pd_vllm import verdict

    def res(ids, tops):
        r = Result(0, 0, 1, 0.0)
        r.output_ids, r.top_logprobs = ids, tops
        return r

    hit = res([5, 6, 7], [{5: -0.1, 9: -3.0}, {6: -0.70, 8: -0.71}, {7: -0.2, 1: -2.0}])
    assert verdict(res([5, 6, 7], hit.top_logprobs), hit) == "equal"
    near = res([5, 8, 2], [{5: -0.105, 9: -3.0}, {8: -0.69, 6: -0.70}, {2: -0.1}])
    assert verdict(near, hit) == "near-tie"
    far = res([5, 9, 7], [{5: -0.1}, {9: -0.2}, {7: -0.2}])  # a token the hit gave no weight
    assert verdict(far, hit) == "differ"
    moved = res([5, 8, 2], [{5: -0.9, 9: -3.0}, {8: -0.69}, {2: -0.1}])  # the logprob before moved
    assert verdict(moved, hit) == "differ"
