"""Tiers: where block bytes live (host DRAM, local NVMe) and how they move between them."""
