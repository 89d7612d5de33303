"""Locust's web UI, extended: the tokenload tab (live TTFT/TPOT/ITL/e2e per step, charts, report links) and CSVs.

Sits above `tokenload.load` and imports only from it and below: the locustfile
imports `tab`, which adds itself at Locust's `init` event once the load plugin
has set up the run series. Nothing in the load path imports this package.
"""
