"""Attention: the dense reference, the blockwise flash kernel, the Pallas kernels, and the
dispatch that picks one (docs/attention.md)."""
