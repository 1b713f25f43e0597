"""`sagesched compare`: the same replay against several targets, side by side."""

from loadgen.replay.cli import compare_main as main

__all__ = ["main"]
