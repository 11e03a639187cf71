"""rl-kernel: bitwise-reproducible RL post-training across parallel topologies (see DESIGN.md)."""

__version__ = "0.1.0"
