"""Storage tiers. Each keeps chunks by `ChunkKey`; a miss is `None`."""
