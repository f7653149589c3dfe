import subprocess
import sys

import numpy as np
import pytest

from kvtier.keys import KVFormat, chunk_spans

FMT = KVFormat("m", "flash_attn", "bfloat16")


def test_prefix_chaining():
    a = chunk_spans(list(range(1000)), FMT, 256, False)
    b = chunk_spans(list(range(768)) + [5] * 232, FMT, 256, False)
    assert [s.end for s in a] == [256, 512, 768]
    assert [s.key for s in a] == [s.key for s in b]  # same first 768 tokens
    c = chunk_spans([1] + list(range(1, 1000)), FMT, 256, False)
    assert all(x.key != y.key for x, y in zip(a, c))  # first token differs: every key differs


def test_unfull_chunk_follows_config():
    assert [s.end for s in chunk_spans(range(600), FMT, 256, True)] == [256, 512, 600]
    assert [s.end for s in chunk_spans(range(600), FMT, 256, False)] == [256, 512]
    # A partial chunk's key differs from the full chunk over the same start.
    assert chunk_spans(range(600), FMT, 256, True)[2].key != chunk_spans(range(768), FMT, 256, True)[2].key


def test_format_is_part_of_the_key():
    toks = list(range(256))
    keys = {chunk_spans(toks, f, 256, False)[0].key for f in [
        FMT, KVFormat("other", "flash_attn", "bfloat16"), KVFormat("m", "mla", "bfloat16"),
        KVFormat("m", "flash_attn", "float16"), KVFormat("m", "flash_attn", "bfloat16", 1, 2)]}
    assert len(keys) == 5


def test_golden_digest_is_stable():
    # Pinned so that a change of the hash (which would orphan every stored
    # chunk in shared tiers) is a deliberate, versioned decision.
    d = chunk_spans(list(range(256)), FMT, 256, False)[0].key.digest.hex()
    assert d == GOLDEN


def test_same_keys_in_processes_with_different_hash_seeds():
    code = "from kvtier.keys import *; print(chunk_spans(list(range(512)), KVFormat('m','flash_attn','bfloat16'), 256, False)[1].key.digest.hex())"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout for seed in ("0", "1", "random")}
    assert len(outs) == 1


def test_token_range_checked():
    with pytest.raises(ValueError):
        chunk_spans(np.array([-1] * 256), FMT, 256, False)


GOLDEN = "986edfd8d75cbe5b3ff63276534329cf"


def test_span_memo_gives_the_spans_of_the_tokens_it_is_given():
    from kvtier.keys import SpanMemo

    fmt = KVFormat("m", "kv", "bfloat16")
    memo = SpanMemo(fmt, 4, save_unfull_chunk=False)
    prompt = np.arange(18)
    assert memo.spans(prompt, "r") == chunk_spans(prompt, fmt, 4, False)
    assert memo.spans(prompt[:10], "r") == chunk_spans(prompt[:10], fmt, 4, False)  # a prefix: reused
    other = prompt.copy()
    other[0] = 99
    assert memo.spans(other, "r") == chunk_spans(other, fmt, 4, False)  # other tokens: hashed anew
    longer = np.arange(30)
    assert memo.spans(longer, "r") == chunk_spans(longer, fmt, 4, False)


def test_token_bytes_of_a_list_and_of_an_array_agree():
    import numpy as np
    import pytest

    from kvtier.keys import token_bytes

    toks = [0, 1, 2**32 - 1, 128000, 7]
    assert token_bytes(toks) == np.asarray(toks, dtype="<u4").tobytes() == token_bytes(np.asarray(toks))
    for bad in ([-1], [2**32]):
        with pytest.raises(ValueError, match="token ids"):
            token_bytes(bad)
        with pytest.raises(ValueError, match="token ids"):
            token_bytes(np.asarray(bad, dtype=np.int64))


def test_span_memo_with_partial_chunks_hashes_only_what_follows_the_shared_whole_chunks(monkeypatch):
    """A request's lookup (its prompt, a partial last chunk), its load (the hit: whole chunks)
    and its store (the prompt again, or with its output) share the prompt's whole chunks: each
    later call hashes only what follows them, and gets what hashing it all gets."""
    import kvtier.keys as keys
    from kvtier.keys import SpanMemo

    fmt = KVFormat("m", "kv", "bfloat16")
    memo = SpanMemo(fmt, 4, save_unfull_chunk=True)
    hashed = []
    real = keys._chained
    monkeypatch.setattr(keys, "_chained", lambda prev, data: hashed.append(len(data) // 4) or real(prev, data))
    prompt = np.arange(18)
    cases = [(prompt, [4, 4, 4, 4, 2]),  # the lookup: everything
             (prompt[:16], []),  # the hit's load: its whole chunks known
             (prompt, [2]),  # the store: the partial last chunk only
             (prompt[:17], [1]),  # another tail
             (np.arange(23), [4, 3]),  # the prompt and its output: from the 16th token on
             (np.arange(18), [2])]  # the longest tokens of the request stayed in the memo
    for tokens, expected in cases:
        hashed.clear()
        got = memo.spans(tokens, "r")
        assert hashed == expected, (len(tokens), hashed)
        assert got == keys.chunk_spans(tokens, fmt, 4, True)
    changed = np.arange(23)
    changed[9] = 99  # a token inside the third chunk: the first two are shared, the rest hashed anew
    for tokens, rid, expected in [(changed, "r", [4, 4, 4, 3]), (prompt, "other", [4, 4, 4, 4, 2])]:
        want = keys.chunk_spans(tokens, fmt, 4, True)
        hashed.clear()
        assert memo.spans(tokens, rid) == want and hashed == expected, hashed
