"""What to send: the scenario (the data model every stage reads), prompts, datasets, sessions, traces, sampling.

The bottom of the load side: plain data and pure functions, no Locust, no
sockets, no run state. Imports only the channel, protocol request types,
records' column types and token estimates below it.
"""
