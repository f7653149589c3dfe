"""Never another request's KV, inside real vLLM (CPU build): LoRA adapters, images,
cache_salt and prompt embeddings (kvtier/keys.py's Identity, integrations/vllm/identity.py).

Each check here fails when its part of the key is removed: the same tokens under adapter
B, another image or another salt would hit the chunks stored under A, the first image or
the first salt (a hit line says so), and the image's output would follow the first image.
"""

import logging
import re

import httpx
import pytest
from vllm_offline import hit_granularity, run_vllm
from vllm_requests import vllm_request

from kvtier_tools.dev.demo import HIT_LINE as HIT
from kvtier_tools.dev.demo import vllm_server
from kvtier_tools.dev.tinymodel import corpus_text
from kvtier_tools.dev.tinyvlm import IMAGE_TOKEN, make_lora_adapter, make_tiny_idefics3

pytestmark = pytest.mark.vllm
STORE = re.compile(r"Storing KV cache for (\d+) out of (\d+) tokens")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Two LoRA adapters of the tiny Llama in PEFT's format, of different seeded weights."""
    root = tmp_path_factory.mktemp("lora")
    return {"A": make_lora_adapter(root / "A", seed=1), "B": make_lora_adapter(root / "B", seed=2)}


@pytest.fixture(scope="module")
def prompt(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model)).encode(corpus_text())[2000:2700]


def _hits(log: str) -> list[int]:
    return [int(m[1]) for m in HIT.findall(log)]


def _close(a: dict, b: dict) -> bool:
    """The same greedy tokens, with logprobs equal up to the arithmetic of another batch shape."""
    return (
        a["token_ids"] == b["token_ids"]
        and max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])) < 2e-2
    )


def test_an_adapter_never_loads_another_adapter_s_kv_and_prompt_embeds_are_not_cached(
    tiny_model, adapters, prompt, tmp_path
):
    """One prompt under B, then (kvtier's tiers and vLLM's cache reset) under A, B, A: B's
    second output is its first, plain vLLM's (nothing was stored then), and it hits nothing;
    A's second hits A's chunks and equals A's first. A prompt of embeddings is served twice
    and never cached."""
    under = {name: {"ids": prompt, "lora": name} for name in adapters}
    embeds = {"ids": prompt, "embeds": True}
    order = [under["B"], "RESET", under["A"], under["B"], under["A"], embeds, embeds]
    out, log = run_vllm(tiny_model, order, tmp_path, kv_role="kv_both", lora=adapters, embeds=True)
    b_alone, _, a_first, b_after_a, a_again, embeds_first, embeds_again = out
    g = hit_granularity()
    assert _hits(log) == [0, 0, 0, 512 - 512 % g]  # the embeddings' requests are not looked up
    assert a_first["token_ids"] != b_alone["token_ids"]  # the adapters change the output
    assert (
        _close(b_after_a, b_alone)
        and _close(a_again, a_first)
        and _close(embeds_again, embeds_first)
    )
    assert [int(m[0]) for m in STORE.findall(log)] == [512, 512, 512]  # B, A (after the reset), B
    assert log.count("kvtier neither loads nor stores requests of this kind (prompt_embeds)") == 1


def test_adapters_and_cache_salts_through_the_openai_server(tiny_model, adapters, prompt, tmp_path):
    """`--enable-lora --lora-modules`, and the completions API's cache_salt: two adapters or
    two salts never share a chunk; the same adapter or salt hits, and answers as before. A
    prompt of embeddings is answered, never looked up, and counted in /metrics."""
    lora_args = [
        "--enable-prompt-embeds",
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--lora-modules",
    ]
    lora_args += [f"{name}={path}" for name, path in adapters.items()]
    env = {"LMCACHE_CHUNK_SIZE": "256", "LMCACHE_SAVE_UNFULL_CHUNK": "false"}
    with vllm_server(
        tiny_model, tmp_path, env=env, max_model_len=4096, extra_args=lora_args
    ) as server:

        def complete(model: str, salt: str | None = None) -> list[int]:
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": 8,
                "temperature": 0,
                **({"cache_salt": salt} if salt else {}),
            }
            reply = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
            assert reply.status_code == 200, reply.text
            return reply.json()["choices"][0]["text"]

        base = str(tiny_model)
        texts = [
            complete("A"),
            complete("B"),
            complete("A"),
            complete(base, "tenant-1"),
            complete(base, "tenant-2"),
            complete(base, "tenant-1"),
            complete(base),
        ]
        embeds = {
            "model": base,
            "prompt_embeds": _embeddings_b64(tiny_model, prompt),
            "max_tokens": 4,
        }
        for _ in range(2):
            assert (
                httpx.post(server.url + "/v1/completions", json=embeds, timeout=300).status_code
                == 200
            )
        hits = [h[1] for h in server.hit_lines()]
        metrics = _uncached(server.url)
    g = hit_granularity()
    assert hits == [0, 0, 512 - 512 % g, 0, 0, 512 - 512 % g, 0]
    assert texts[0] == texts[2] != texts[1] and texts[3] == texts[5]
    assert metrics == {"prompt_embeds": 2.0}


def _embeddings_b64(model, ids: list[int]) -> str:
    """The prompt's input embeddings as the completions API takes them (torch.save, base64)."""
    import base64
    import io

    import torch
    from safetensors import safe_open

    with safe_open(str(model / "model.safetensors"), "pt") as f:
        table = f.get_tensor("model.embed_tokens.weight")
    buffer = io.BytesIO()
    torch.save(table[ids].to(torch.float32), buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def _uncached(url: str) -> dict[str, float]:
    """kvtier_uncached_requests_total by kind, from vLLM's /metrics (its stats come every few
    steps: read until they are in)."""
    import time

    pattern = re.compile(r'^kvtier_uncached_requests_total\{[^}]*kind="([^"]+)"[^}]*\} (\S+)', re.M)
    deadline = time.monotonic() + 30
    while True:
        found = {
            k: float(v) for k, v in pattern.findall(httpx.get(url + "/metrics", timeout=30).text)
        }
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    return make_tiny_idefics3(tmp_path_factory.mktemp("model") / "tiny-idefics3")


def test_another_image_behind_the_same_text_shares_only_the_chunks_before_it(idefics3, tmp_path):
    """The same text with image 2, then (kvtier's tiers reset) images 1, 2, 1: each output is
    its image's first, plain vLLM's (nothing was stored then); image 2 loads only the whole
    chunks before the image's tokens (the text image 1 stored), and image 1 again hits all of
    its stored chunks."""
    # close after it: it shows
    text = corpus_text()[5000:7000] + IMAGE_TOKEN + corpus_text()[9000:9040]
    one, two = {"text": text, "image": 1}, {"text": text, "image": 2}
    # kvtier's default: the tail too
    out, log = run_vllm(
        idefics3,
        [two, "RESET", one, two, one],
        tmp_path,
        kv_role="kv_both",
        max_tokens=6,
        env={"LMCACHE_SAVE_UNFULL_CHUNK": "true"},
    )
    two_alone, _, one_first, two_after_one, one_again = out
    before = _image_offset(idefics3, text)
    total = [int(m[0]) for m in HIT.findall(log)][0]
    g = hit_granularity()
    # two whole chunks before the image, which is in the partial third
    assert 512 < before < total < 768
    assert _hits(log) == [0, 0, 512 - 512 % g, total - 1 - (total - 1) % g]
    assert one_first["token_ids"] != two_alone["token_ids"]  # the images change the answer
    assert _close(two_after_one, two_alone) and _close(one_again, one_first)


def _image_offset(model, text: str) -> int:
    """Where the image's tokens start in `text`'s prompt (its first `<fake_token_around_image>`),
    as the model's processor writes it (what vLLM's does)."""
    from transformers import AutoProcessor

    from kvtier_tools.dev.tinyvlm import seeded_image

    processor = AutoProcessor.from_pretrained(str(model))
    ids = processor(text=text, images=[seeded_image(1)])["input_ids"][0]
    return list(ids).index(processor.fake_image_token_id)


def _feature(
    modality: str = "image", identifier: str = "content-hash-1", offset: int = 10, length: int = 4
):
    from types import SimpleNamespace

    return SimpleNamespace(
        modality=modality,
        identifier=identifier,
        mm_position=SimpleNamespace(offset=offset, length=length),
    )


def _lora(name: str, path, int_id: int = 1):
    from types import SimpleNamespace

    return SimpleNamespace(lora_name=name, lora_int_id=int_id, lora_path=str(path))


class _Said(logging.Handler):
    """The messages kvtier's logger emits while it is attached (its own handler writes to
    whatever stderr was when it was made, which pytest-xdist's workers capture elsewhere)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_what_a_request_is_keyed_by_and_what_is_refused():
    """Identities.of reads the adapter, the items and the salt; a request of prompt
    embeddings, an item of an unknown modality, or items named per request (vLLM's caches
    off) are refused, said once per kind, and counted."""
    from kvtier.integrations.vllm.identity import Identities, Uncacheable
    from kvtier.keys import PLAIN

    identities = Identities()
    assert identities.of(vllm_request("r", [1, 2])) == PLAIN
    image = identities.of(vllm_request("r", [1, 2], mm_features=[_feature()]))
    assert [(i.offset, i.length) for i in image.items] == [(10, 4)] and image.root == PLAIN.root
    other = identities.of(
        vllm_request("r", [1, 2], mm_features=[_feature(identifier="content-hash-2")])
    )
    assert other.items[0].digest != image.items[0].digest
    salted = identities.of(vllm_request("r", [1, 2], cache_salt="t1"))
    assert (
        salted.root != PLAIN.root != identities.of(vllm_request("r", [1, 2], cache_salt="t2")).root
    )
    refused = [
        vllm_request("e", None, prompt_embeds=object()),
        vllm_request("e", None, prompt_embeds=object()),
        vllm_request("m", [1], mm_features=[_feature("point_cloud")]),
    ]
    said = _Said()
    logging.getLogger("kvtier").addHandler(said)
    try:
        assert all(isinstance(identities.of(r), Uncacheable) for r in refused)
        named = Identities(content_ids=False).of(vllm_request("m", [1], mm_features=[_feature()]))
    finally:
        logging.getLogger("kvtier").removeHandler(said)
    assert isinstance(named, Uncacheable) and named.kind == "multimodal:no-content-hash"
    assert identities.take_refused() == {"prompt_embeds": 2, "multimodal:point_cloud": 1}
    assert identities.take_refused() == {}
    assert sum("kvtier neither loads nor stores" in m for m in said.messages) == 3  # once a kind


def test_an_adapter_is_keyed_by_its_name_its_path_and_its_files(tmp_path):
    """vLLM's int id of an adapter is per process: two instances agree on a key through
    the adapter's name, path and files; new weights under the same name are another key."""
    from kvtier.adapters import identity_of
    from kvtier.integrations.vllm.identity import Identities

    path = make_lora_adapter(tmp_path / "A", seed=1)
    identities = Identities()

    def root(lora) -> bytes:
        return identities.of(vllm_request("r", [1], lora_request=lora)).root

    first = root(_lora("A", path, int_id=1))
    assert root(_lora("A", path, int_id=7)) == first  # another process's id
    assert identity_of("A", str(path)).root == first  # `kvtier controller --lora-name/--lora-path`
    assert Identities().of(vllm_request("r", [1], lora_request=_lora("A", path))).root == first
    assert root(_lora("B", path)) != first
    weights = path / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")  # retrained in place
    assert root(_lora("A", path)) != first
    assert identities.of(vllm_request("r", [1], lora_request=_lora("A", path))).lora == (1, "A")
