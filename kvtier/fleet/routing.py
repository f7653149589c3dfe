"""Which node a request goes to: round robin (the default), or by KV (`--route kv`). A node is
a prefiller of `kvtier proxy` or an instance of `kvtier router`.

KV-aware routing sends each request to the node that holds the longest prefix of its
prompt, as the nodes' KV events say (kvtier/fleet/index.py, fed by each node's vLLM event
publisher: `--prefiller-kv-events-port`, `--kv-events-port`), weighed against what each is
already working on: a node's score is the tokens of the prompt it holds, less
`--route-load-tokens` for each request the proxy has in flight there. Ties, and prompts no
one holds, go round robin. The prompt's token ids come from the request (a completion whose
`prompt` is token ids) or from vLLM's `/tokenize` on the first node up (text, or a
chat's messages under the model's template): one more round trip of a millisecond or so.
Where tokenizing fails, the request goes round robin: routing is a hint, never a reason to
fail a request.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import aiohttp

from kvtier.fleet.feed import EventFeed
from kvtier.fleet.index import PrefixIndex
from kvtier.fleet.upstreams import Upstreams
from kvtier.logs import get_logger

log = get_logger(__name__)

ROUTES = ("round-robin", "kv")
TOKENIZE_TIMEOUT = 5.0  # s for a /tokenize call


class KvRouter:
    """Picks a node by the prefix it holds and its load (see the module's docstring)."""

    def __init__(
        self,
        nodes: Upstreams,
        urls: list[str],
        events: Mapping[str, str],
        load_tokens: int,
    ) -> None:
        self.nodes, self.urls, self.load_tokens = nodes, urls, load_tokens
        self.index = PrefixIndex()
        self.feed = EventFeed(events, self.index)
        self.inflight: Counter[int] = Counter()
        self.routed_last = ""  # "kv": the last pick was by a held prefix; "round-robin": not

    async def pick(
        self, n: int, endpoint: str, body: Mapping[str, Any], session: aiohttp.ClientSession
    ) -> int | None:
        """The node for this request (None: none is up)."""
        first = self.nodes.pick(n)
        if first is None:
            return None
        tokens = await self._tokens(first, endpoint, body, session)
        held = self._held(tokens, _lora(body))
        best, best_score = first, self._score(first, held)
        for k in range(1, len(self.urls)):
            i = (n + k) % len(self.urls)
            score = self._score(i, held)
            if self.nodes.is_up(i) and score > best_score:
                best, best_score = i, score
        self.routed_last = "kv" if held.get(self.urls[best], 0) else "round-robin"
        return best

    def started(self, i: int) -> None:
        self.inflight[i] += 1

    def ended(self, i: int) -> None:
        self.inflight[i] -= 1

    def _held(self, tokens: list[int], lora: str | None) -> dict[str, int]:
        """Per node URL, the tokens of the prompt it holds: the adapter's own blocks, or
        where none are known (the model named is the base model), the base model's."""
        if not tokens:
            return {}
        held = self.index.match(tokens, lora) if lora else {}
        return held or self.index.match(tokens, None)

    def _score(self, i: int, held: Mapping[str, int]) -> int:
        return held.get(self.urls[i], 0) - self.load_tokens * self.inflight[i]

    async def _tokens(
        self, i: int, endpoint: str, body: Mapping[str, Any], session: aiohttp.ClientSession
    ) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        ask: dict[str, Any] = {"model": body.get("model")}
        if endpoint.endswith("/chat/completions"):
            ask["messages"] = body.get("messages")
        elif isinstance(prompt, str):
            ask["prompt"] = prompt
        else:
            return []  # a batch of prompts: round robin
        try:
            async with session.post(
                self.urls[i] + "/tokenize",
                json=ask,
                timeout=aiohttp.ClientTimeout(total=TOKENIZE_TIMEOUT),
            ) as resp:
                if resp.status != 200:
                    return []
                tokens = (await resp.json()).get("tokens")
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            log.info("routing: /tokenize on %s failed (%s); routing round robin", self.urls[i], exc)
            return []
        return tokens if isinstance(tokens, list) else []

    def close(self) -> None:
        self.feed.close()


def _lora(body: Mapping[str, Any]) -> str | None:
    """The adapter the request names as its model, as kvtier's and vLLM's events name it
    (None for the base model: a name no adapter event carries matches nothing, and the
    base model's blocks are tried then)."""
    model = body.get("model")
    return model if isinstance(model, str) else None
