"""LoRA adapter routes: POST /v1/load_lora_adapter and POST /v1/unload_lora_adapter (vLLM's).

Owns: parsing the two calls, their admin check, and the server's list of adapter names (what
`model` may name and /v1/models lists). Registered only with --enable-lora and
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in the environment, as vLLM does (else 404). Does not
know: adapter files (the engine reads them, off its step, and answers when loaded).
"""

from __future__ import annotations

import uuid

from aiohttp import web

from radixserve.api.fields import bad, check_fields
from radixserve.config.lora_config import check_lora_name
from radixserve.config.parsing import ConfigError
from radixserve.ipc.messages import LoadLoRAMsg, UnloadLoRAMsg
from radixserve.server.app_state import STATE_KEY, ServerState, read_json, request_caller
from radixserve.server.error_responses import APIError

LOAD_FIELDS = frozenset({"lora_name", "lora_path", "load_inplace"})
UNLOAD_FIELDS = frozenset({"lora_name", "lora_int_id"})


def _require_admin(request: web.Request, state: ServerState) -> None:
    if state.auth.enabled and not request_caller(request).admin:
        raise APIError(403, "loading and unloading LoRA adapters needs the admin key "
                            "(--admin-key)", code="admin_key_required")


def _name(body: dict[str, object]) -> str:
    name = body.get("lora_name")
    if not isinstance(name, str):
        raise bad("'lora_name' must be a string", "lora_name")
    try:
        return check_lora_name(name)
    except ConfigError as e:
        raise bad(str(e), "lora_name") from None


async def load_lora_adapter(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    _require_admin(request, state)
    state.ensure_ready()
    body = await read_json(request)
    check_fields(body, LOAD_FIELDS)
    name = _name(body)
    path = body.get("lora_path")
    if not isinstance(path, str) or not path:
        raise bad("'lora_path' must be a non-empty string", "lora_path")
    if name in state.loras and not body.get("load_inplace"):
        raise bad(f"The lora adapter '{name}' has already been loaded.", "lora_name")
    if name in (state.model_name, state.cfg.engine.model):
        raise bad(f"'{name}' is the base model's name", "lora_name")
    result = await state.client.call(LoadLoRAMsg(uuid.uuid4().hex, name, path))
    state.loras[name] = path  # only once the engine read it: a failed load raised above
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.",
                        headers={"X-LoRA-Digest": str(result.get("digest", ""))})


async def unload_lora_adapter(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    _require_admin(request, state)
    state.ensure_ready()
    body = await read_json(request)
    check_fields(body, UNLOAD_FIELDS)
    name = _name(body)
    if name not in state.loras:
        raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                       code="model_not_found")
    del state.loras[name]  # new requests naming it get 404 from now on
    await state.client.call(UnloadLoRAMsg(uuid.uuid4().hex, name))
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def add_lora_routes(app: web.Application, runtime_updates: bool) -> None:
    if runtime_updates:
        app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
