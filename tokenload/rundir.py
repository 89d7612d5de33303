"""The run directory's file names: what `tokenload run` writes and `analyze` reads.

One place for the contract between the load stage and the analysis stage, so
neither can drift from the other.
"""

REQUESTS_FILE = "requests.parquet"
MANIFEST_FILE = "manifest.json"
# The server's own Prometheus samples during the run (tokenload.servermetrics), when it publishes any.
SERVER_METRICS_FILE = "server_metrics.parquet"
# Where a run's records (and the server's samples) wait as segments until the run is finalised.
SEGMENTS_DIR = "segments"
