"""Retention and garbage collection: what may be deleted, and is everything consistent?

Never on the request hot path except `RetentionPolicy.is_expired`, which every read calls
so that an expired block is never served, even before a collector has run.
"""
