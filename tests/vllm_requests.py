"""Stand-ins of what the connector's scheduler side reads of vLLM's Request, for tests that
drive it without an engine."""

from types import SimpleNamespace


def vllm_request(
    request_id: str, prompt_token_ids: list[int] | None = None, **fields
) -> SimpleNamespace:
    """A request of plain text: no adapter, image, salt or prompt embeddings unless `fields` say;
    no block hashes (vLLM's prefix caching off) unless they do."""
    plain = {
        "block_hashes": [],
        "num_tokens": len(prompt_token_ids or ()),
        "kv_transfer_params": None,
        "lora_request": None,
        "mm_features": [],
        "cache_salt": None,
        "prompt_embeds": None,
    }
    return SimpleNamespace(
        request_id=request_id, prompt_token_ids=prompt_token_ids, **{**plain, **fields}
    )
