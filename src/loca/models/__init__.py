"""Model plumbing: the parts of a decoder-only LM that LoCA uses (``parts``), tiny architectures
for tests and benchmarks (``archs``) and the aliases installed from PyPI wheels (``zoo``)."""
