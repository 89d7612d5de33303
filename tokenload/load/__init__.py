"""The load stage: Locust users, load shapes, the run's control and stop rules, and its records.

Runs inside Locust's processes (the locustfile imports `plugin`, `shapes` and
`user`), except `runner` and `websession`, which supervise Locust from the
`tokenload` process without importing it. Reads what to send from
`tokenload.workload`, moves bytes with `tokenload.transport`, writes one record
per request (`records`, `rundirs`; `courier` sends a remote worker's records to
its master over Locust's messages); never imports the analysis, the web UI tab
or the commands above it.
"""
