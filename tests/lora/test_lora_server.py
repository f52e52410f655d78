"""Multi-LoRA over HTTP: `radixserve serve --enable-lora --lora-modules ...` (one real server):
/v1/models lists the adapters with `parent`, concurrent requests under three adapters and the
base equal HF on the merged weights, an unknown name is a 404, adapters load and unload at run
time behind the admin key, and adapters never share cached prefixes."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson
import pytest

from tests.lora.conftest import NUM_NEW, LoRASet
from tests.server_proc import ServerProc, running_server

pytestmark = pytest.mark.slow
KEY, ADMIN = "user-key", "admin-key"


@pytest.fixture(scope="module")
def server(lora_set: LoRASet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    log = tmp_path_factory.mktemp("lora-server") / "server.log"
    beta = json.dumps({"name": "beta", "path": str(lora_set.adapters["beta"]),
                       "base_model_name": "tiny"})
    args = ["--kv-cache-tokens", "4096", "--api-key", KEY, "--admin-key", ADMIN,
            "--enable-lora", "--lora-modules", f"alpha={lora_set.adapters['alpha']}", beta,
            "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "3"]
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    with running_server(lora_set.base, log, args, key=KEY, env=env) as srv:
        yield srv
    assert srv.proc.returncode == 0, srv.output()


def post(srv: ServerProc, path: str, body: dict[str, Any], key: str = KEY
         ) -> tuple[int, Any]:
    req = urllib.request.Request(srv.url + path, data=orjson.dumps(body), headers={
        "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            raw = resp.read()
            return resp.status, orjson.loads(raw) if raw.startswith(b"{") else raw.decode()
    except urllib.error.HTTPError as err:
        return err.code, orjson.loads(err.read() or b"null")


def complete(srv: ServerProc, model: str, prompt: list[int]) -> tuple[list[int], int]:
    """(the greedy token ids, the cached prompt tokens), streamed with return_token_ids."""
    req = urllib.request.Request(srv.url + "/v1/completions", data=orjson.dumps({
        "model": model, "prompt": prompt, "max_tokens": NUM_NEW, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True, "stream": True,
        "stream_options": {"include_usage": True}}), headers={
        "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        lines = resp.read().decode().splitlines()
    events = [orjson.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert {e["model"] for e in events} == {model}  # the adapter's name, as vLLM answers
    ids = [t for e in events for c in e["choices"] for t in c.get("token_ids", [])]
    return ids, events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_models_lists_adapters_with_parent(server: ServerProc, lora_set: LoRASet) -> None:
    status, body = server.get("/v1/models")
    assert status == 200
    base, *adapters = body["data"]
    assert {a["id"]: (a["parent"], a["root"]) for a in adapters} == {
        "alpha": (base["id"], str(lora_set.adapters["alpha"])),
        "beta": ("tiny", str(lora_set.adapters["beta"]))}  # its JSON's base_model_name


def test_concurrent_adapters_and_base_equal_hf(server: ServerProc, lora_set: LoRASet) -> None:
    _, models = server.get("/v1/models")
    base = models["data"][0]["id"]
    names = [None, "alpha", "beta", "alpha", None, "beta"]
    with ThreadPoolExecutor(len(names)) as pool:
        outs = list(pool.map(lambda i: complete(server, names[i] or base, lora_set.prompts[i]),
                             range(len(names))))
    for i, (out, name) in enumerate(zip(outs, names, strict=True)):
        assert out[0] == lora_set.refs[name][i], (i, name)
    server.wait_idle()


def test_unknown_model_is_404(server: ServerProc) -> None:
    status, body = post(server, "/v1/completions", {"model": "nope", "prompt": "hi",
                                                     "max_tokens": 2})
    assert status == 404
    assert body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"
    assert "nope" in body["error"]["message"]


def test_adapter_is_part_of_the_cache_key(server: ServerProc, lora_set: LoRASet) -> None:
    prompt = list(range(100, 130))  # sent by no other test

    def cached(model: str) -> int:
        return complete(server, model, prompt)[1]

    assert cached("alpha") == 0
    assert cached("beta") == 0
    assert cached("alpha") == len(prompt) - 1


def test_load_serve_unload_at_run_time(server: ServerProc, lora_set: LoRASet) -> None:
    gamma = {"lora_name": "gamma", "lora_path": str(lora_set.adapters["gamma"])}
    status, body = post(server, "/v1/load_lora_adapter", gamma)  # a user key: 403
    assert status == 403 and body["error"]["code"] == "admin_key_required"
    status, body = post(server, "/v1/load_lora_adapter",
                        {"lora_name": "bad", "lora_path": str(lora_set.base)}, key=ADMIN)
    assert status == 400 and "adapter_config.json" in body["error"]["message"]
    status, body = post(server, "/v1/load_lora_adapter", gamma, key=ADMIN)
    assert status == 200, body
    assert post(server, "/v1/load_lora_adapter", gamma, key=ADMIN)[0] == 400  # loaded already
    assert "gamma" in [m["id"] for m in server.get("/v1/models")[1]["data"]]
    assert complete(server, "gamma", lora_set.prompts[2])[0] == lora_set.refs["gamma"][2]
    status, _ = post(server, "/v1/unload_lora_adapter", {"lora_name": "gamma"}, key=ADMIN)
    assert status == 200
    status, body = post(server, "/v1/completions", {"model": "gamma", "prompt": "hi",
                                                     "max_tokens": 2})
    assert status == 404, body
    status, body = post(server, "/v1/unload_lora_adapter", {"lora_name": "gamma"}, key=ADMIN)
    assert status == 404
    server.wait_idle()
