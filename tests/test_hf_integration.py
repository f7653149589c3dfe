"""transformers integration on CPU: same greedy tokens and logits with and without kvtier."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from kvtier.config import KvtierConfig
from kvtier.integrations.hf import HFSession

SMALL = dict(
    vocab_size=1000,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)


@pytest.fixture(
    params=[(LlamaForCausalLM, LlamaConfig), (Qwen2ForCausalLM, Qwen2Config)],
    ids=["llama", "qwen2"],
)
def model(request):
    torch.manual_seed(0)
    cls, cfg_cls = request.param
    cfg = cfg_cls(**SMALL)
    cfg._attn_implementation = "sdpa"
    return cls(cfg).eval()


def test_generate_equals_transformers_and_second_prompt_hits(model):
    ids = torch.randint(0, 1000, (1, 700), generator=torch.Generator().manual_seed(1))
    session = HFSession(
        model,
        KvtierConfig(save_unfull_chunk=False, chunk_size=64, max_local_cpu_size=0.05),
        max_len=800,
    )
    reference = model.generate(ids, max_new_tokens=10, do_sample=False)[0, 700:].tolist()
    assert session.generate(ids, 10) == reference  # cold: stores 640 tokens
    assert session.engine.lookup(ids[0]) == 640
    assert session.generate(ids, 10) == reference  # warm: loads them
    assert session.engine.stats.retrieved_tokens == 640


def test_warm_logits_match_and_the_context_matters(model):
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 1000, (1, 300), generator=gen)
    session = HFSession(
        model,
        KvtierConfig(save_unfull_chunk=False, chunk_size=64, max_local_cpu_size=0.05),
        max_len=400,
    )
    cold = session.prefill(ids, use_cache=False).logits
    session.prefill(ids)  # store
    warm = session.prefill(ids)
    assert warm.hit_tokens == 256
    err = (warm.logits - cold).abs().max().item()
    other = ids.clone()
    other[0, :64] = torch.randint(0, 1000, (64,), generator=gen)
    effect = (session.prefill(other, use_cache=False).logits - cold).abs().max().item()
    assert err < 1e-4 and effect > 100 * max(err, 1e-6), (err, effect)


def test_prompt_longer_than_session_is_refused(model):
    session = HFSession(
        model,
        KvtierConfig(save_unfull_chunk=False, chunk_size=64, max_local_cpu_size=0.05),
        max_len=100,
    )
    with pytest.raises(ValueError, match="max_len"):
        session.prefill(torch.zeros(1, 101, dtype=torch.long))


def test_layerwise_load_gives_the_same_result(model):
    ids = torch.randint(0, 1000, (1, 300), generator=torch.Generator().manual_seed(3))
    session = HFSession(
        model,
        KvtierConfig(save_unfull_chunk=False, chunk_size=64, max_local_cpu_size=0.05),
        max_len=400,
    )
    cold = session.prefill(ids, use_cache=False).logits
    session.prefill(ids)  # store
    whole = session.prefill(ids, layerwise=False)
    session.buffers[0].zero_()  # nothing left over from the last load
    layered = session.prefill(ids, layerwise=True)
    assert layered.hit_tokens == whole.hit_tokens == 256
    assert torch.equal(layered.logits, whole.logits)
    assert (layered.logits - cold).abs().max().item() < 1e-4
    # nothing left pinned
    assert session.engine.pool.used_bytes == 4 * session.engine.pool.block_bytes
    assert all(not c.block.pinned for c in session.engine.tiers.cpu._chunks.values())


def test_layerwise_store_stores_the_same_kv_as_storing_after(model):
    ids = torch.randint(0, 1000, (1, 300), generator=torch.Generator().manual_seed(5))
    cfg = KvtierConfig(save_unfull_chunk=False, chunk_size=64, max_local_cpu_size=0.05)
    after, layered = HFSession(model, cfg, max_len=400), HFSession(model, cfg, max_len=400)
    cold = after.prefill(ids, layerwise=False).logits
    # storing changes nothing computed
    assert torch.equal(layered.prefill(ids, layerwise=True).logits, cold)
    keys = [s.key for s in after.engine.spans(ids[0])]
    assert layered.engine.lookup(ids[0]) == after.engine.lookup(ids[0]) == 256
    for key in keys:
        a, b = after.engine.tiers.cpu.get(key), layered.engine.tiers.cpu.get(key)
        assert torch.equal(a.block.data, b.block.data)  # the same bytes, chunk for chunk
        a.block.release(), b.block.release()
    warm = layered.prefill(ids, layerwise=True)  # and they load back as well
    assert warm.hit_tokens == 256 and (warm.logits - cold).abs().max().item() < 1e-4


def test_a_session_on_another_node_loads_the_prefix_from_the_store_server(model):
    from kvtier_tools.dev.localservers import kvtier_server

    ids = torch.randint(0, 1000, (1, 700), generator=torch.Generator().manual_seed(4))
    reference = model.generate(ids, max_new_tokens=10, do_sample=False)[0, 700:].tolist()
    with kvtier_server(0.0625) as srv:
        cfg = KvtierConfig(
            save_unfull_chunk=False,
            chunk_size=64,
            max_local_cpu_size=0.05,
            local_cpu=False,
            remote_url=srv.url,
        )
        first = HFSession(model, cfg, max_len=800)
        assert first.generate(ids, 10) == reference
        assert first.engine.flush(timeout=10)
        second = HFSession(model, cfg, max_len=800)
        assert second.prefill(ids).hit_tokens == 640
        assert second.generate(ids, 10) == reference
        first.engine.close(), second.engine.close()


def test_layerwise_from_the_store_server_and_a_chunk_that_fails_its_check_is_computed_again(model):
    # CPU tier off, server on this host: the prefix is lent in one lease and loaded
    # layer by layer; a chunk whose bytes changed is found at the end, and the
    # prompt is computed again, so the logits are still the cold ones.
    from kvtier.keys import wire_key
    from kvtier.remote import open_store
    from kvtier_tools.dev.localservers import kvtier_server

    ids = torch.randint(0, 1000, (1, 300), generator=torch.Generator().manual_seed(5))
    with kvtier_server(0.0625) as srv:
        cfg = KvtierConfig(
            save_unfull_chunk=False,
            chunk_size=64,
            max_local_cpu_size=0.05,
            local_cpu=False,
            remote_url=srv.url,
        )
        session = HFSession(model, cfg, max_len=400)
        cold = session.prefill(ids, use_cache=False).logits
        session.prefill(ids)  # store
        assert session.engine.flush(timeout=10)
        lent = session.engine.tiers.tier("remote").stats.lent
        warm = session.prefill(ids, layerwise=True)
        assert warm.hit_tokens == 256 and session.engine.tiers.tier("remote").stats.lent == lent + 4
        assert (warm.logits - cold).abs().max().item() < 1e-4
        store = open_store(srv.url, 5)
        key = wire_key(session.engine.spans(ids[0])[2].key)
        value = bytearray(store.get([key])[0])
        value[-1] ^= 0x40
        store.put([key], [bytes(value)])
        again = session.prefill(ids, layerwise=True)
        assert again.hit_tokens == 0  # computed again, not from the KV that was loaded
        assert (again.logits - cold).abs().max().item() < 1e-4
        session.engine.close(), store.close()
