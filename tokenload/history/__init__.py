"""The channel's history: latency samples over days, so peak and off-peak hours can be found.

`store` keeps request rows (the columns of requests.parquet plus a channel
fingerprint and a sample id) in SQLite; `sampler` is the loop behind
`tokenload watch`; `views` turns the rows into hour-of-day charts, peak and
off-peak windows and advice for `tokenload history`; `clock` folds time into
the (possibly compressed) day that both sides share with the simulator.
"""
