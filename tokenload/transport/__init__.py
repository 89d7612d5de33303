"""How bytes move: the load generator's hot-path client and its compiled reading core, and httpx for single requests.

- `gevent_client`: `Transport`, one per Locust process (geventhttpclient
  sockets, kernel receive stamps, `t0` when the request is on the wire);
- `reader` + `_chunked.c`: the body reader in the event loop (compiled where a
  C compiler was at install; the pure-Python reader otherwise);
- `httpx_client`: `probe`, `doctor`, `watch` and the storm probe's single
  requests, where clear errors matter more than CPU per token.

Both feed `tokenload.stream.StreamSession`; nothing here knows a wire format.
"""
