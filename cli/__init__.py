"""The `kvcache` command line: argparse -> config -> one call into the library."""
