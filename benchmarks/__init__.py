"""Benchmarks: each measures kvcache against a baseline run on the same bytes in the same run and
reports the ratio. One module per benchmark (`kvcache bench NAME` parses its arguments and calls
it; `python -m kvcache.benchmarks.NAME` runs it too), helpers beside them, JSON reports in
`results/`, the method and latest ratios in README.md.
"""
