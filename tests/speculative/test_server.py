"""Speculative decoding over HTTP: the `prediction` field (OpenAI's Predicted Outputs) on chat
and completions, with and without --speculative-config (the issue's flag as written); usage's
accepted/rejected_prediction_tokens; the spec_decode metrics; a malformed prediction is a 400
naming the field."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from radixserve.api.protocol import parse_chat, parse_completion
from radixserve.types import InvalidRequestError
from tests.server_proc import running_server
from tests.waiting import wait_until_sync

ISSUE_FLAG = ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
              '"prompt_lookup_min": 2}')
MESSAGES = [{"role": "user", "content": "Rewrite this: the quick brown fox jumps."}]


def test_prediction_parses_as_string_or_text_parts() -> None:
    chat = parse_chat({"messages": MESSAGES,
                       "prediction": {"type": "content", "content": "abc"}})
    assert chat.opts.prediction == "abc"
    parts = [{"type": "text", "text": "ab"}, {"type": "text", "text": "c"}]
    done = parse_completion({"prompt": "x", "prediction": {"type": "content", "content": parts}})
    assert done.opts.prediction == "abc"
    assert parse_chat({"messages": MESSAGES}).opts.prediction is None


@pytest.mark.parametrize("prediction, param", [
    ("abc", "prediction"),
    ({"type": "text", "content": "abc"}, "prediction.type"),
    ({"content": "abc"}, "prediction.type"),
    ({"type": "content", "content": 5}, "prediction.content"),
    ({"type": "content"}, "prediction.content"),
    ({"type": "content", "content": [{"type": "image_url", "text": "x"}]},
     "prediction.content[0]"),
    ({"type": "content", "content": ["abc"]}, "prediction.content[0]"),
    ({"type": "content", "content": "x", "extra": 1}, "extra"),
])
def test_malformed_prediction_names_the_field(prediction: Any, param: str) -> None:
    for parse, body in ((parse_chat, {"messages": MESSAGES}), (parse_completion, {"prompt": "x"})):
        with pytest.raises(InvalidRequestError) as err:
            parse({**body, "prediction": prediction})  # type: ignore[operator]
        assert err.value.param == param, err.value


@pytest.fixture(scope="module", params=["flag", "no-flag"])
def server(request: pytest.FixtureRequest, tiny_llama: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("spec-server") / "server.log"
    args = ["--kv-cache-tokens", "8192"]
    if request.param == "flag":
        args += ["--speculative-config", ISSUE_FLAG]
    with running_server(tiny_llama, log, args) as srv:
        if request.param == "flag":
            assert srv.info()["engine_config"]["speculative_config"]["method"] == "ngram"
        yield srv.url
    assert srv.proc.returncode == 0, srv.output()


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.mark.slow
def test_chat_prediction_keeps_the_output_and_counts_accepted_tokens(server: str) -> None:
    client = sdk(server)
    model = client.models.list().data[0].id
    plain = client.chat.completions.create(model=model, messages=MESSAGES,  # type: ignore
                                           max_tokens=40, temperature=0)
    text = plain.choices[0].message.content or ""
    assert text
    drafts_before = metric(server, "radixserve:spec_decode_num_draft_tokens_total")
    # A prediction that is the answer with an edit in the middle (a code edit's shape).
    predicted = text[: len(text) // 2] + "XYZ" + text[len(text) // 2 :]
    got = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=40, temperature=0,  # type: ignore
        prediction={"type": "content", "content": predicted})
    assert got.choices[0].message.content == text
    details = got.usage.completion_tokens_details  # type: ignore[union-attr]
    assert details is not None
    assert details.accepted_prediction_tokens > 0
    # "XYZ" was inserted: the drafts that ran into it were verified and rejected.
    assert details.rejected_prediction_tokens > 0
    assert got.usage.completion_tokens == plain.usage.completion_tokens  # type: ignore
    # The engine's stats reach /metrics shortly after the request (when it goes idle).
    wait_until_sync(lambda: metric(server, "radixserve:spec_decode_num_accepted_tokens_total")
                    >= details.accepted_prediction_tokens, timeout=20, what="spec metrics")
    assert metric(server, "radixserve:spec_decode_num_draft_tokens_total") > drafts_before
    assert metric(server, "radixserve:spec_decode_mean_acceptance_length") > 1


@pytest.mark.slow
def test_completion_prediction_as_text_parts_with_a_stop_string(server: str) -> None:
    client = sdk(server)
    model = client.models.list().data[0].id
    prompt = "Once upon a time, "
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=30, temperature=0)
    text = plain.choices[0].text
    stop = text[10:13]
    expected = client.completions.create(model=model, prompt=prompt, max_tokens=30,
                                         temperature=0, stop=[stop])
    parts = [{"type": "text", "text": text[:7]}, {"type": "text", "text": text[7:]}]
    got = client.completions.create(model=model, prompt=prompt, max_tokens=30, temperature=0,
                                    stop=[stop],
                                    extra_body={"prediction": {"type": "content",
                                                               "content": parts}})
    assert got.choices[0].text == expected.choices[0].text
    assert got.choices[0].finish_reason == expected.choices[0].finish_reason == "stop"
    details = got.usage.completion_tokens_details  # type: ignore[union-attr]
    assert details is not None and details.accepted_prediction_tokens > 0


@pytest.mark.slow
def test_malformed_prediction_is_a_400_over_http(server: str) -> None:
    client = sdk(server)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="x", messages=MESSAGES,  # type: ignore
                                       prediction={"type": "content", "content": 3})  # type: ignore
    assert err.value.status_code == 400
    assert "prediction.content" in str(err.value)
