"""The fleet: which instance holds which prefix (index.py, from the KV events vLLM publishes,
fed by feed.py); P2P sharing (peers.py serves CPU RAM's chunks to peers, holders.py is the
index of who holds them); the controller (controller.py, controller_cli.py) and each rank's API
it calls (worker.py)."""
