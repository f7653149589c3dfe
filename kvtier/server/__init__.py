"""kvtier's store server (InfiniStore's role) and its client.

A separate program that lives in this repository: it never imports the
cache engine. `kvtier server --help` starts it; `KVClient` talks to it.
"""
