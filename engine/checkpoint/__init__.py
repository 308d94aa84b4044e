"""Checkpoints: official safetensors layout, quantised formats, transformers name maps, demo init."""
