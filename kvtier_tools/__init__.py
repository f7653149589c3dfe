"""What kvtier's developers run beside the library: benchmarks (`bench`) and the helpers the
tests, the demo and the docs use (`dev`: tiny seeded models, local servers, the PD cluster,
the structure check, the docs' generated blocks).

The library never imports this package; `kvtier`'s CLI loads it lazily for `kvtier demo`
and `kvtier bench ...`.
"""
