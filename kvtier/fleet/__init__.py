"""The fleet's view of the cache: which instance holds which prefix (index.py), learned from
the KV events the instances' vLLM publishes (feed.py), kvtier's tiers' and vLLM's own."""
