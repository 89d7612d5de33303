"""The official anthropic and openai SDKs talk to the simulator as to a real channel."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from simfixtures import read_truth

from tokenload.sim import SimHandle, serve_in_thread
from tokenload.tokens import estimate_tokens

KEY = "sk-sim-test-key"
PROMPT = "Explain continuous batching in two short sentences, please."


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimHandle]:
    truth = tmp_path_factory.mktemp("sdk") / "truth.jsonl"
    with serve_in_thread("fast", api_key=KEY, truth_path=truth, thinking_tokens=5) as handle:
        yield handle


def _anthropic(sim: SimHandle, **kw: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=sim.base_url, api_key=kw.pop("api_key", KEY), max_retries=0, **kw)


def _openai(sim: SimHandle, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=sim.base_url + "/v1", api_key=key, max_retries=0)


@pytest.mark.parametrize("thinking", [False, True])
def test_anthropic_messages_stream(sim: SimHandle, thinking: bool) -> None:
    extra: dict[str, Any] = {"thinking": {"type": "enabled", "budget_tokens": 1024}} if thinking else {}
    deltas: dict[str, int] = {"text_delta": 0, "thinking_delta": 0, "signature_delta": 0}
    with _anthropic(sim).messages.stream(model="sim-7b", max_tokens=12,
                                         messages=[{"role": "user", "content": PROMPT}], **extra) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                deltas[event.delta.type] += 1
        message = stream.get_final_message()
        request_id = stream.response.headers["request-id"]
    assert message.usage.input_tokens == estimate_tokens(PROMPT)
    assert message.usage.output_tokens == 12
    assert message.stop_reason == "max_tokens"
    assert deltas["thinking_delta"] == (5 if thinking else 0)
    assert deltas["signature_delta"] == (1 if thinking else 0)
    assert deltas["text_delta"] == 12 - deltas["thinking_delta"]
    text = next(b for b in message.content if b.type == "text").text
    assert estimate_tokens(text) == deltas["text_delta"]
    assert [b.type for b in message.content] == (["thinking", "text"] if thinking else ["text"])
    truth = read_truth(sim.truth_path)[request_id]
    assert truth["output_tokens"] == 12 and truth["thinking_tokens"] == deltas["thinking_delta"]


@pytest.mark.parametrize("thinking", [False, True])
def test_openai_chat_stream_with_usage(sim: SimHandle, thinking: bool) -> None:
    extra = {"reasoning_effort": "low"} if thinking else {}
    stream = _openai(sim).chat.completions.create(
        model="sim-30b", max_tokens=10, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": PROMPT}], **extra)
    content, reasoning, usage, finish = [], 0, None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                content.append(choice.delta.content)
            if getattr(choice.delta, "reasoning_content", None):
                reasoning += 1
            finish = choice.finish_reason or finish
    assert usage is not None and usage.prompt_tokens == estimate_tokens(PROMPT)
    assert usage.completion_tokens == 10
    assert reasoning == (5 if thinking else 0)
    assert len(content) == 10 - reasoning == estimate_tokens("".join(content))
    assert finish == "length"


def test_openai_chat_without_include_usage_has_no_usage_chunk(sim: SimHandle) -> None:
    chunks = list(_openai(sim).chat.completions.create(
        model="sim-7b", max_tokens=3, stream=True, messages=[{"role": "user", "content": PROMPT}]))
    assert all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)


@pytest.mark.parametrize("thinking", [False, True])
def test_openai_responses_stream(sim: SimHandle, thinking: bool) -> None:
    extra = {"reasoning": {"effort": "medium"}} if thinking else {}
    events = list(_openai(sim).responses.create(model="sim-7b", input=PROMPT, max_output_tokens=9, stream=True, **extra))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text_deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    reasoning = types.count("response.reasoning_text.delta")
    assert reasoning == (5 if thinking else 0)
    assert len(text_deltas) == 9 - reasoning
    usage = events[-1].response.usage
    assert usage.input_tokens == estimate_tokens(PROMPT)
    assert usage.output_tokens == 9
    assert usage.output_tokens_details.reasoning_tokens == reasoning
    assert events[-1].response.output_text == "".join(text_deltas)


def test_non_stream_requests(sim: SimHandle) -> None:
    message = _anthropic(sim).messages.create(model="sim-7b", max_tokens=4, messages=[{"role": "user", "content": PROMPT}])
    assert message.usage.output_tokens == 4 and estimate_tokens(message.content[0].text) == 4
    chat = _openai(sim).chat.completions.create(model="sim-7b", max_tokens=4, messages=[{"role": "user", "content": PROMPT}])
    assert chat.usage.completion_tokens == 4 and estimate_tokens(chat.choices[0].message.content) == 4
    response = _openai(sim).responses.create(model="sim-7b", input=PROMPT, max_output_tokens=4)
    assert response.usage.output_tokens == 4 and estimate_tokens(response.output_text) == 4


def test_count_tokens_and_models(sim: SimHandle) -> None:
    counted = _anthropic(sim).messages.count_tokens(model="sim-7b", messages=[{"role": "user", "content": PROMPT}],
                                                    system="Be brief.")
    assert counted.input_tokens == estimate_tokens(PROMPT) + estimate_tokens("Be brief.")
    assert [m.id for m in _openai(sim).models.list()] == ["sim-7b", "sim-30b"]
    assert [m.id for m in _anthropic(sim).models.list()] == ["sim-7b", "sim-30b"]


def test_both_auth_header_styles_and_wrong_keys(sim: SimHandle) -> None:
    bearer = anthropic.Anthropic(base_url=sim.base_url, auth_token=KEY, api_key=None, max_retries=0)
    assert bearer.messages.create(model="sim-7b", max_tokens=1, messages=[{"role": "user", "content": "hi"}]).usage.output_tokens == 1
    with pytest.raises(anthropic.AuthenticationError) as err:
        _anthropic(sim, api_key=KEY[:-1] + "X").messages.create(model="sim-7b", max_tokens=1,
                                                           messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError) as oerr:
        _openai(sim, key="sk-wrong").chat.completions.create(model="sim-7b", messages=[{"role": "user", "content": "hi"}])
    assert oerr.value.code == "invalid_api_key"
    assert KEY not in sim.truth_path.read_text()


def test_unknown_model_is_not_found_in_each_protocol(sim: SimHandle) -> None:
    with pytest.raises(anthropic.NotFoundError) as err:
        _anthropic(sim).messages.create(model="claude-nope", max_tokens=1, messages=[{"role": "user", "content": "hi"}])
    assert err.value.body == {"type": "error", "error": {"type": "not_found_error", "message": "model: claude-nope"},
                              "request_id": err.value.body["request_id"]}
    with pytest.raises(openai.NotFoundError) as oerr:
        _openai(sim).chat.completions.create(model="gpt-nope", messages=[{"role": "user", "content": "hi"}])
    assert oerr.value.body == {"message": "The model `gpt-nope` does not exist", "type": "invalid_request_error",
                               "param": "model", "code": "model_not_found"}
