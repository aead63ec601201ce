"""Batching: the step schedule, bin packing, packed micro-batches, preference pairs and the
schedule report (docs/data.md)."""
