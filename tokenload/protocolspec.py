"""One row per wire protocol: where its requests go, how they authenticate, how it says it stopped.

Everything about a protocol that is not its JSON (the adapters in
`tokenload/protocols/` and the simulator's framers in `tokenload/sim/wire.py`
own that) is here, once: the channel builds URLs and headers from it, doctor
probes and explains with it, the failure map reads its error fields, the
simulator routes by it and the tests parametrise over it. ARCHITECTURE.md's
"Where do I add ... a fourth protocol" lists what else a new row needs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# The environment variables each family of protocols reads, by channel field (a settings.json's
# `{"anthropic": {...}}` section uses the same field names).
ENV_VARS: dict[str, dict[str, str]] = {
    "anthropic": {
        "base_url": "ANTHROPIC_BASE_URL",
        "auth_token": "ANTHROPIC_AUTH_TOKEN",
        "api_key": "ANTHROPIC_API_KEY",
        "model": "ANTHROPIC_MODEL",
        "headers": "ANTHROPIC_CUSTOM_HEADERS",
    },
    "openai": {
        "base_url": "OPENAI_BASE_URL",
        "api_key": "OPENAI_API_KEY",
        "model": "OPENAI_MODEL",
    },
}


@dataclass(frozen=True)
class ProtocolSpec:
    """A wire protocol's addresses, credentials and error fields."""

    name: str
    endpoint: str  # the streaming endpoint under the API root; `{model}` where the path names the model
    default_base_url: str
    default_model: str
    env_families: tuple[str, ...]  # ENV_VARS families read, first the protocol's own, then fallbacks
    root: str = "/v1"  # the API's version root
    root_in_base: bool = False  # its SDKs' base URL ends in the root (added when it lacks it)
    key_header: str | None = None  # the header an API key travels in; None: `Authorization: Bearer`
    headers: tuple[tuple[str, str], ...] = ()  # sent with every request (the API version)
    models_path: str = "/models"  # GET under the root: the served model ids
    error_keys: tuple[str, ...] = ("type",)  # the error object's fields that name what went wrong
    natural_stop: str = "stop"  # the stop reason of a model that ended on its own (an end-of-sequence token)
    length_stop: str = "length"  # the stop reason of an answer cut at its output limit

    @property
    def family(self) -> str:
        """Which environment variables the protocol reads (`ENV_VARS`)."""
        return self.env_families[0]

    def api_root(self, base_url: str) -> str:
        """The base URL with the API root the way the SDKs join it: appended, or kept when the base has it."""
        base = base_url.rstrip("/")
        if not self.root_in_base:
            return base + self.root
        return base if base.endswith(self.root) else base + self.root

    def endpoint_url(self, base_url: str, model: str = "") -> str:
        """The streaming request's URL for `model`."""
        return self.api_root(base_url) + self.endpoint.format(model=model)

    def models_url(self, base_url: str) -> str:
        """The model list's URL, beside the endpoint under the root (a base that already ends in it keeps it)."""
        base = base_url.rstrip("/")
        return (base if base.endswith(self.root) else base + self.root) + self.models_path

    def route(self) -> re.Pattern[str]:
        """The endpoint's path under a server's base path, the model (if the path names one) as group `model`."""
        path = self.root + self.endpoint
        return re.compile(re.escape(path).replace(re.escape("{model}"), "(?P<model>[^/:]+)") + "$")

    def auth_headers(self, api_key: str | None, auth_token: str | None) -> dict[str, str]:
        """The credentials as the official SDKs send them: a key in `key_header` and a token as Bearer, or
        one Bearer (the key, else the token) where the protocol has no key header."""
        headers: dict[str, str] = {}
        if self.key_header is None:
            token = api_key or auth_token
            if token:
                headers["authorization"] = f"Bearer {token}"
            return headers
        if api_key:
            headers[self.key_header] = api_key
        if auth_token:
            headers["authorization"] = f"Bearer {auth_token}"
        return headers


SPECS: dict[str, ProtocolSpec] = {spec.name: spec for spec in (
    ProtocolSpec("anthropic", "/messages", "https://api.anthropic.com", "claude-sonnet-4-20250514",
                 ("anthropic",), key_header="x-api-key", headers=(("anthropic-version", "2023-06-01"),),
                 natural_stop="end_turn", length_stop="max_tokens"),
    ProtocolSpec("openai-chat", "/chat/completions", "https://api.openai.com/v1", "gpt-4o-mini",
                 ("openai", "anthropic"), root_in_base=True, error_keys=("type", "code")),
    ProtocolSpec("openai-responses", "/responses", "https://api.openai.com/v1", "gpt-4o-mini",
                 ("openai", "anthropic"), root_in_base=True, error_keys=("type", "code"),
                 natural_stop="completed", length_stop="max_output_tokens"),  # incomplete_details.reason
)}
PROTOCOLS: tuple[str, ...] = tuple(SPECS)
DEFAULT_PROTOCOL = PROTOCOLS[0]
