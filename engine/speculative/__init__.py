"""Speculative decoding: drafters propose tokens, one target forward verifies them (verify.py),
a confidence-scheduled budget picks how many each request verifies (budget.py)."""
