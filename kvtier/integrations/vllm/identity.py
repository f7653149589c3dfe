"""What identifies a vLLM request's KV besides its tokens, read from the request vLLM hands
the scheduler's connector: a `keys.Identity`, or why kvtier cannot key it (`Uncacheable`).

vLLM (0.26 to 0.33) folds into its own block hashes what changes a prompt's KV beyond its
token ids, and kvtier folds the same into its chunk keys:

    request.lora_request   the adapter: its name, its path, and a digest of its files (vLLM's
                           int id is per process; two instances must agree on a key)
    request.mm_features    each multimodal item's content hash (`identifier`) at its
                           placeholder tokens (`mm_position.offset`, `.length`)
    request.cache_salt     the salt (vLLM's per-tenant isolation of its prefix cache)

A request kvtier cannot key is served and neither looked up nor stored:

    prompt_embeds          embeddings instead of token ids: no ids identify their KV
    multimodal, no content hash   vLLM names items per request when both its prefix cache
                           and its multimodal processor cache are off (`renderer0-mm-7-image-0`,
                           a counter that starts again with every process): the same name
                           would mean another image in another process
    multimodal, unknown kind      an item of a modality kvtier does not know
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import xxhash

from kvtier.adapters import Stamp, adapter_bytes, adapter_files, files_digest, stamp
from kvtier.keys import PLAIN, Identity, Item
from kvtier.logs import get_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.lora.request import LoRARequest
    from vllm.v1.request import Request

log = get_logger(__name__)

# The modalities whose items are an input's content at its placeholder tokens, as vLLM hashes them.
MODALITIES = frozenset({"image", "video", "audio"})
_DIGEST_SEED = 0x6B7674696572_3001  # a multimodal item's (the adapters' files: adapters.py)


@dataclass(frozen=True)
class Uncacheable:
    """A request whose KV kvtier cannot key: served, never looked up nor stored."""

    kind: str  # a short name: the metric's label, and what is logged once
    reason: str


class Identities:
    """The identities of the scheduler's requests; each kind of refusal logged once, all counted."""

    def __init__(self, content_ids: bool = True) -> None:
        """`content_ids`: vLLM names multimodal items by their content (`for_vllm`)."""
        self._content_ids = content_ids
        self._adapters: dict[tuple[str, str], _Adapter] = {}  # (name, path) -> its files' digest
        self._said: set[str] = set()
        self.refused: dict[str, int] = {}  # kind -> requests, since the last `take_refused`

    @classmethod
    def for_vllm(cls, vllm_config: VllmConfig) -> Identities:
        """Items have content hashes unless vLLM has neither cache that needs them (module doc)."""
        mm = vllm_config.model_config.multimodal_config
        return cls(
            bool(vllm_config.cache_config.enable_prefix_caching)
            or (mm is not None and mm.mm_processor_cache_gb > 0)
        )

    def of(self, request: Request) -> Identity | Uncacheable:
        if request.prompt_embeds is not None:
            return self._refuse(
                "prompt_embeds",
                "its prompt is embeddings, not token ids: nothing identifies its KV",
            )
        items = []
        for feature in request.mm_features or ():
            if feature.modality not in MODALITIES:
                return self._refuse(
                    f"multimodal:{feature.modality}",
                    f"kvtier does not know how a {feature.modality!r} item decides KV",
                )
            if not self._content_ids or not feature.identifier:
                return self._refuse(
                    "multimodal:no-content-hash",
                    "vLLM names its multimodal items per request when both its prefix cache and "
                    "its multimodal processor cache are off (mm_processor_cache_gb 0): keep "
                    "either on for kvtier to cache such requests",
                )
            digest = xxhash.xxh3_128_digest(
                f"{feature.modality}\0{feature.identifier}".encode(), seed=_DIGEST_SEED
            )
            position = feature.mm_position
            items.append(Item(position.offset, position.length, digest))
        lora = request.lora_request
        adapter = self._adapter(lora) if lora is not None else b""
        salt = request.cache_salt or ""
        if not (adapter or salt or items):
            return PLAIN
        label = (lora.lora_int_id, lora.lora_name) if lora is not None else None
        return Identity.of(adapter, salt, items, lora=label)

    def take_refused(self) -> dict[str, int]:
        refused, self.refused = self.refused, {}
        return refused

    def _refuse(self, kind: str, reason: str) -> Uncacheable:
        self.refused[kind] = self.refused.get(kind, 0) + 1
        if kind not in self._said:
            self._said.add(kind)
            log.warning(
                "kvtier neither loads nor stores requests of this kind (%s): %s; they are served "
                "as without kvtier (said once, counted in kvtier_uncached_requests_total)",
                kind,
                reason,
            )
        return Uncacheable(kind, reason)

    def _adapter(self, lora: LoRARequest) -> bytes:
        """The bytes that identify an adapter: its name, its path and a digest of its files
        (read once per path while they do not change; kvtier/adapters.py)."""
        name, path = lora.lora_name, lora.lora_path or ""
        return adapter_bytes(name, path, self._files_digest(name, path))

    def _files_digest(self, name: str, path: str) -> bytes:
        """A digest of the adapter's files, hashed again only when their sizes or times change
        (vLLM reads them again when it loads the adapter anew); b"" where there are none here."""
        known = self._adapters.get((name, path))
        if known is not None and stamp(known.files) == known.stamp:
            return known.digest
        files = adapter_files(Path(path)) if path else []
        digest = files_digest(Path(path), files)
        self._adapters[(name, path)] = _Adapter(files, stamp(files), digest)
        if files:
            log.info(
                "LoRA adapter %s: %d files at %s hashed into its chunk keys (%s)",
                name,
                len(files),
                path,
                digest.hex()[:12],
            )
        else:
            log.info(
                "LoRA adapter %s: no local files at %r; its name and path identify its KV",
                name,
                path,
            )
        return digest


@dataclass(frozen=True)
class _Adapter:
    files: list[Path]
    stamp: Stamp | None
    digest: bytes
