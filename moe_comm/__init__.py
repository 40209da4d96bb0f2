"""Wide expert-parallel DeepSeek-V3 training on TorchTitan with swappable MoE dispatch/combine."""

__version__ = "0.1.0"
