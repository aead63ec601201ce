"""Tools for multi-turn episodes: the toolbox, tool-call parsers, JSON schemas and the
subprocess worker (docs/tools.md)."""
