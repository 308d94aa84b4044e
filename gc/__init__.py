"""Garbage collection and consistency: what may be deleted, and is everything consistent?

Never on the request hot path: the store checks expiry itself on every read
(kvstore/retention.py), so an expired block is never served, even before a collector has run.
"""
