"""Accelerator kernels, each with a pure-torch reference. Not built yet: see issues 4-6."""
