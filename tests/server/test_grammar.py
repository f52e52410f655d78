"""/generate with json_schema, regex, choice and ebnf over a real server (tiny model, its own
engine process): outputs obey the constraint; bad constraints are 400s naming the field."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.server_proc import running_server

SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("grammar_server") / "server.log"
    with running_server(tiny_llama, log, ["--kv-cache-tokens", "8192"]) as srv:
        yield srv.url
    assert srv.proc.returncode == 0, srv.output()


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def generate(url: str, **sampling: Any) -> str:
    status, out = post(url, {"text": "Answer:", "sampling_params": {
        "temperature": 0, "max_new_tokens": 64, **sampling}})
    assert status == 200, out
    assert out["meta_info"]["finish_reason"] == {"type": "stop"}, out
    text: str = out["text"]
    return text


def test_each_constraint_field_over_http(server: str) -> None:
    jsonschema.validate(json.loads(generate(server, json_schema=SCHEMA)), SCHEMA)
    jsonschema.validate(json.loads(generate(server, json_schema=json.dumps(SCHEMA))), SCHEMA)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{4}", generate(server, regex=r"[0-9]{3}-[a-z]{4}"))
    assert generate(server, choice=["alpha", "beta", "gamma"]) in ("alpha", "beta", "gamma")
    assert generate(server, ebnf='root ::= "x" digit digit\ndigit ::= [0-9]')[0] == "x"
    sampled = generate(server, regex="(red|blue)-[0-9]", temperature=1.0, seed=3)
    assert re.fullmatch("(red|blue)-[0-9]", sampled)


@pytest.mark.parametrize(("sampling", "param"), [
    ({"json_schema": "{not json"}, "json_schema"),
    ({"json_schema": {"type": "object", "not": {}}}, "json_schema"),
    ({"regex": "(unclosed"}, "regex"),
    ({"choice": []}, "choice"),
    ({"ebnf": "root ::= undefined_rule"}, "ebnf"),
    ({"regex": "a", "json_schema": {"type": "object"}}, "regex"),
])
def test_bad_constraints_are_400_naming_the_field(server: str, sampling: dict[str, Any],
                                                  param: str) -> None:
    status, out = post(server, {"text": "hi", "sampling_params": sampling})
    assert status == 400, out
    assert out["error"]["param"] == param
    assert out["error"]["type"] == "invalid_request_error"


def test_vllm_and_sglang_extra_body_fields_over_http(server: str) -> None:
    """What vLLM / SGLang users send through the openai SDK's extra_body."""
    import openai

    sdk = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    model = sdk.models.list().data[0].id
    chat = sdk.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Pick one."}], temperature=0,
        max_tokens=16, extra_body={"guided_choice": ["alpha", "beta", "gamma"]})
    assert chat.choices[0].message.content in ("alpha", "beta", "gamma")
    completion = sdk.completions.create(model=model, prompt="Code:", temperature=0,
                                        max_tokens=16,
                                        extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})
    assert re.fullmatch("[0-9]{4}", completion.choices[0].text)
    obj = sdk.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "JSON please."}], temperature=0,
        max_tokens=64, extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(obj.choices[0].message.content or ""), SCHEMA)
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                    extra_body={"guided_regex": "(unclosed"})
    assert err.value.body["param"] == "guided_regex"  # type: ignore[index]
