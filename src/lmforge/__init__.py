"""lmforge: PyTorch-native LLM training from one YAML file."""

__version__ = "0.1.0"
