"""Disaggregated prefill: a prefiller computes the KV, a decoder decodes from it.

    client ─▶ kvtier proxy (proxy.py) ─1─▶ prefiller vLLM (max_tokens=1, disagg_spec)
                   ▲                          │ KvtierConnector, pd_role: sender
                   │ 2: PrefillDone           ▼ sender.py: Alloc → write → Commit
                   └───────────────────── decoder's buffer (buffer.py; its ports: receiver.py)
              ─3─▶ decoder vLLM: its lookup finds the chunks as a hit and loads them;
                   the proxy streams its answer back and Releases the request's chunks

protocol.py holds every message, link.py a sender's connection to one decoder
(its reservations), channels.py how bytes cross (tcp, nixl, cuda_ipc). build.py
builds the receiver's pieces from the config.
"""
