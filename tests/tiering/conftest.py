"""Fixtures for the tier tests."""

from tests.tiering.object_helpers import moto  # noqa: F401  (the S3 server fixture)
