"""Single streaming requests over httpx, for `probe` and `doctor`.

Under load the Locust user drives `StreamSession` with its own client; here
clarity and excellent errors matter more than CPU per token, so httpx it is.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from tokenload import errors as ek
from tokenload.channel import Channel
from tokenload.measure import Timeline
from tokenload.protocols import adapter_for
from tokenload.stream import StreamSession
from tokenload.tokens import estimate_tokens


def timeouts(channel: Channel) -> httpx.Timeout:
    """Read timeout covers the wait for the first token; stalls are checked per chunk."""
    return httpx.Timeout(
        connect=channel.connect_timeout_s,
        read=max(channel.first_token_timeout_s, channel.idle_timeout_s),
        write=channel.connect_timeout_s,
        pool=channel.connect_timeout_s,
    )


def stream_once(
    channel: Channel,
    prompt: str,
    max_tokens: int,
    *,
    extra_body: Mapping[str, Any] | None = None,
    on_text: Callable[[str, str], None] | None = None,
    client: httpx.Client | None = None,
) -> dict[str, Any]:
    """Send one streaming request and return its SPEC.md record (never raises for HTTP trouble)."""
    return stream_exchange(channel, prompt, max_tokens, extra_body=extra_body, on_text=on_text, client=client)[0]


def stream_exchange(
    channel: Channel,
    prompt: str,
    max_tokens: int,
    *,
    extra_body: Mapping[str, Any] | None = None,
    on_text: Callable[[str, str], None] | None = None,
    client: httpx.Client | None = None,
) -> tuple[dict[str, Any], Timeline]:
    """`stream_once`, plus the raw timeline: `doctor` reads its chunk arrival times to spot buffering proxies."""
    adapter = adapter_for(channel)
    request = adapter.prepare(prompt, max_tokens, extra_body)
    own = client is None
    http = client or httpx.Client(timeout=timeouts(channel), follow_redirects=False)
    session = StreamSession(adapter, time.perf_counter(), estimated_input_tokens=estimate_tokens(prompt), on_text=on_text)
    try:
        with http.stream("POST", request.url, headers=request.headers, content=request.body) as response:
            session.on_headers(time.perf_counter(), response.status_code, response.headers)
            last = time.perf_counter()
            for chunk in response.iter_raw():
                now = time.perf_counter()
                if session.timeline.t_first_token is not None and now - last > channel.idle_timeout_s:
                    session.on_failure(now, ek.TIMEOUT_STALL, f"no data for {now - last:.1f} s")
                    break
                session.on_data(now, chunk)
                last = now
            else:
                session.on_end(time.perf_counter())
    except httpx.TimeoutException as exc:
        kind = ek.TIMEOUT_FIRST_TOKEN if isinstance(exc, httpx.ReadTimeout) else ek.BAD_BASE_URL
        session.on_failure(time.perf_counter(), kind, f"{type(exc).__name__}: no answer within the timeout")
    except httpx.ConnectError as exc:
        session.on_failure(time.perf_counter(), ek.BAD_BASE_URL, f"cannot connect to {channel.base_url}: {exc}")
    except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
        session.on_failure(time.perf_counter(), ek.DISCONNECTED, f"{type(exc).__name__}: {exc}")
    except httpx.HTTPError as exc:
        session.on_failure(time.perf_counter(), ek.CLIENT_ERROR, f"{type(exc).__name__}: {exc}")
    finally:
        if own:
            http.close()
    record = session.record()
    record.update(protocol=channel.protocol, model=channel.model, max_tokens=max_tokens)
    return record, session.timeline
