"""tokenload: a load-testing harness for streaming LLM channels.

Data flows one way: channel config -> protocol adapters (wire format in, token
events out) -> Locust users (load) -> request records -> analysis -> report.
"""

__version__ = "0.1.0"
