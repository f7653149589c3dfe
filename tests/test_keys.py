import subprocess
import sys

import numpy as np
import pytest

from kvtier.keys import PLAIN, Identity, Item, KVFormat, SpanMemo, chunk_spans, tail_span

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
    assert (
        chunk_spans(range(600), FMT, 256, True)[2].key
        != chunk_spans(range(768), FMT, 256, True)[2].key
    )


def test_format_is_part_of_the_key():
    toks = list(range(256))
    keys = {
        chunk_spans(toks, f, 256, False)[0].key
        for f in [
            FMT,
            KVFormat("other", "flash_attn", "bfloat16"),
            KVFormat("m", "mla", "bfloat16"),
            KVFormat("m", "flash_attn", "float16"),
            KVFormat("m", "flash_attn", "bfloat16", 1, 2),
        ]
    }
    assert len(keys) == 5


def test_golden_digest_is_stable():
    # Pinned so that a change of the hash (which would orphan every stored
    # chunk in shared tiers) is a deliberate, versioned decision.
    d = chunk_spans(list(range(256)), FMT, 256, False)[0].key.digest.hex()
    assert d == GOLDEN


def test_same_keys_in_processes_with_different_hash_seeds():
    code = (
        "from kvtier.keys import *; print(chunk_spans(list(range(512)), "
        "KVFormat('m','flash_attn','bfloat16'), 256, False)[1].key.digest.hex())"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
        ).stdout
        for seed in ("0", "1", "random")
    }
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
    # a prefix: reused
    assert memo.spans(prompt[:10], "r") == chunk_spans(prompt[:10], fmt, 4, False)
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
    assert (
        token_bytes(toks)
        == np.asarray(toks, dtype="<u4").tobytes()
        == token_bytes(np.asarray(toks))
    )
    for bad in ([-1], [2**32]):
        with pytest.raises(ValueError, match="token ids"):
            token_bytes(bad)
        with pytest.raises(ValueError, match="token ids"):
            token_bytes(np.asarray(bad, dtype=np.int64))


def test_span_memo_with_partial_chunks_hashes_only_what_follows_the_shared_whole_chunks(
    monkeypatch,
):
    """A request's lookup (its prompt, a partial last chunk), its load (the hit: whole chunks)
    and its store (the prompt again, or with its output) share the prompt's whole chunks: each
    later call hashes only what follows them, and gets what hashing it all gets."""
    import kvtier.keys as keys
    from kvtier.keys import SpanMemo

    fmt = KVFormat("m", "kv", "bfloat16")
    memo = SpanMemo(fmt, 4, save_unfull_chunk=True)
    hashed = []
    real = keys._chained
    monkeypatch.setattr(
        keys,
        "_chained",
        lambda prev, data, items=b"": hashed.append(len(data) // 4) or real(prev, data, items),
    )
    prompt = np.arange(18)
    cases = [
        (prompt, [4, 4, 4, 4, 2]),  # the lookup: everything
        (prompt[:16], []),  # the hit's load: its whole chunks known
        (prompt, [2]),  # the store: the partial last chunk only
        (prompt[:17], [1]),  # another tail
        (np.arange(23), [4, 3]),  # the prompt and its output: from the 16th token on
        (np.arange(18), [2]),
    ]  # the longest tokens of the request stayed in the memo
    for tokens, expected in cases:
        hashed.clear()
        got = memo.spans(tokens, "r")
        assert hashed == expected, (len(tokens), hashed)
        assert got == keys.chunk_spans(tokens, fmt, 4, True)
    changed = np.arange(23)
    # a token inside the third chunk: the first two are shared, the rest hashed anew
    changed[9] = 99
    for tokens, rid, expected in [(changed, "r", [4, 4, 4, 3]), (prompt, "other", [4, 4, 4, 4, 2])]:
        want = keys.chunk_spans(tokens, fmt, 4, True)
        hashed.clear()
        assert memo.spans(tokens, rid) == want and hashed == expected, hashed


def _keys(tokens, identity):
    return [s.key for s in chunk_spans(tokens, FMT, 256, True, identity=identity)]


def test_a_plain_identity_keys_as_the_tokens_alone():
    assert Identity.of() == PLAIN and _keys(list(range(600)), PLAIN) == _keys(
        list(range(600)), Identity.of()
    )


def test_an_adapter_or_a_salt_changes_every_chunk_s_key():
    """Two requests of one prompt under LoRA adapters A and B, or two cache_salts, share no
    chunk; the same adapter and salt share them all."""
    tokens = list(range(1000))
    variants = [
        PLAIN,
        Identity.of(adapter=b"A"),
        Identity.of(adapter=b"B"),
        Identity.of(salt="t1"),
        Identity.of(salt="t2"),
        Identity.of(adapter=b"A", salt="t1"),
        Identity.of(adapter=b"At1"),
    ]
    keys = [_keys(tokens, v) for v in variants]
    for i, a in enumerate(keys):
        for b in keys[i + 1 :]:
            assert not set(a) & set(b)
    assert _keys(tokens, Identity.of(adapter=b"A")) == keys[1]


def test_an_image_changes_the_chunks_from_the_one_that_holds_it_and_no_earlier():
    """Chunks wholly before a request's first item are shared with the same text under
    another image (as vLLM's prefix cache shares them); from the chunk its placeholders
    start in, nothing is."""
    tokens = list(range(1200))
    one = Identity.of(items=[Item(600, 64, b"1" * 16)])
    two = Identity.of(items=[Item(600, 64, b"2" * 16)])
    plain, a, b = _keys(tokens, PLAIN), _keys(tokens, one), _keys(tokens, two)
    assert a[:2] == b[:2] == plain[:2]  # [0, 512): before the image at 600
    assert all(x != y and x != z for x, y, z in zip(a[2:], b[2:], plain[2:]))
    assert _keys(tokens, Identity.of(items=[Item(600, 64, b"1" * 16)])) == a
    # another place: another KV
    moved = _keys(tokens, Identity.of(items=[Item(601, 64, b"1" * 16)]))
    assert moved[:2] == a[:2] and moved[2] != a[2]


def test_a_tail_keys_as_the_partial_chunk_a_prompt_was_stored_with():
    identity = Identity.of(salt="s", items=[Item(300, 40, b"x" * 16)])
    spans = chunk_spans(list(range(600)), FMT, 256, True, identity=identity)
    assert tail_span(list(range(700)), spans[1], 88, FMT, identity) == spans[2]
    first = chunk_spans(list(range(100)), FMT, 256, True, identity=identity)[0]
    assert tail_span(list(range(700)), None, 100, FMT, identity) == first


def test_an_identity_crosses_the_wire_whole_and_a_cut_one_is_refused():
    identity = Identity.of(adapter=b"A", items=[Item(9, 3, bytes(16)), Item(1, 2, b"z" * 16)])
    assert [i.offset for i in identity.items] == [1, 9]  # in placeholder order
    wire = identity.wire() + b"tokens"
    assert Identity.from_wire(wire) == (identity, len(wire) - 6)
    for cut in (wire[:19], identity.wire()[:-1]):
        with pytest.raises(ValueError):
            Identity.from_wire(cut)


def test_the_span_memo_never_reuses_spans_across_identities():
    memo = SpanMemo(FMT, 4, save_unfull_chunk=False)
    tokens = np.arange(16)
    memo.spans(tokens, "r")
    salted = Identity.of(salt="other tenant")
    assert memo.spans(tokens, "r", salted) == chunk_spans(tokens, FMT, 4, False, identity=salted)
