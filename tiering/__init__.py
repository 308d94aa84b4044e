"""Tiers: where block bytes live (host DRAM, local NVMe, object storage) and how they move between them."""
