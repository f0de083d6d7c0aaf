"""LoRA adapters loaded and unloaded while the fleet runs: vLLM's `POST /v1/load_lora_adapter`
(`{"lora_name", "lora_path"}`) and `POST /v1/unload_lora_adapter` (`{"lora_name"}`), which vLLM
serves when `VLLM_ALLOW_RUNTIME_LORA_UPDATING` is set; a shoal gateway serves them with
`--allow-runtime-lora-updating` (or that variable), and answers 404 otherwise.

The fleet's run-time adapters are one Redis hash per base model (`Keys.loras`, name -> PEFT
directory on the workers). Loading one writes it there, then waits for every alive worker of the
model to load it (they read the hash with each heartbeat, `WorkerInfo.loras`): the reply comes
once the adapter serves everywhere, or names the worker that could not read it (the entry is
then taken back). Unloading deletes the entry; workers drop the adapter once their requests of
it finish, and the reply waits for that. Every gateway reads the hash each second
(`RuntimeLoRAs.refresh_forever`), so an adapter loaded through one is a model of all of them.
An adapter belongs to the model its load names in `base_model` (shoal's field; vLLM serves one
model), by default the gateway's first; `--lora-modules` adapters are not unloaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from gateway.schemas import APIError
from shoal.messages import WorkerInfo

log = logging.getLogger("shoal.gateway")

ENV_FLAG = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's switch, honoured as the flag is


def enabled_by_env() -> bool:
    """Whether `VLLM_ALLOW_RUNTIME_LORA_UPDATING` asks for the endpoints (vLLM's values)."""
    return os.environ.get(ENV_FLAG, "").strip().lower() in ("1", "true")


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's body of `/v1/load_lora_adapter`."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096,
                           description="the adapter's PEFT directory, as the workers see it")
    load_inplace: bool = Field(False, description="replace an adapter loaded under that name")
    base_model: str | None = Field(None, max_length=256, description=(
        "shoal's: the served model the adapter was trained on (default: the gateway's first)"))


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's body of `/v1/unload_lora_adapter` (`lora_int_id` is accepted and unused)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None


class RuntimeLoRAs:
    """The fleet's run-time adapters as one gateway loads, unloads and learns them.

    Args:
        gateway: the gateway (its Redis client, keys and model catalog).
        timeout_s: how long a load or unload waits for the workers, seconds.
        poll_s: how often it looks at their heartbeats meanwhile, seconds.
    """

    def __init__(self, gateway: Any, timeout_s: float = 60.0, poll_s: float = 0.2) -> None:
        self.gw, self.timeout_s, self.poll_s = gateway, timeout_s, poll_s

    def base(self, name: str | None):
        """The served model (`ServedModel`) `name` names, None: the gateway's first.

        Raises:
            APIError: 404 for a name that is not one of the gateway's models (an adapter is
                not a base).
        """
        catalog = self.gw.catalog
        if name is None:
            return catalog.default
        base = next((m for m in catalog.models if m.name == name), None)
        if base is None:
            raise APIError(f"base_model {name!r} is not a model this gateway serves; try "
                           f"{', '.join(repr(m.name) for m in catalog.models)}", status=404,
                           param="base_model", kind="not_found_error")
        return base

    async def refresh(self) -> None:
        """Serve, as models, exactly the adapters the fleet lists for each base model."""
        pipe = self.gw.redis.pipeline(transaction=False)
        for model in self.gw.catalog.models:
            pipe.hgetall(self.gw.keys.loras(model.name))
        for model, entries in zip(self.gw.catalog.models, await pipe.execute()):
            self.gw.catalog.set_runtime_loras(
                model, {k.decode(): v.decode() for k, v in entries.items()})

    async def refresh_forever(self, interval_s: float = 1.0) -> None:
        """`refresh` every `interval_s` seconds until cancelled; a Redis outage only delays
        it."""
        while True:
            with contextlib.suppress(Exception):
                await self.refresh()
            await asyncio.sleep(interval_s)

    async def _workers(self, base) -> list[WorkerInfo]:
        """The alive, undrained workers of model `base`, as their last heartbeats say."""
        return [info for info, alive in await self.gw.worker_infos()
                if alive and info.model == base.name and not info.draining]

    async def load(self, name: str, path: str, inplace: bool = False,
                   base_model: str | None = None) -> str:
        """Load adapter `name` from `path` on every worker of `base_model` (None: the
        gateway's first model).

        Raises:
            APIError: 400 for a name taken (by a model, a `--lora-modules` adapter, or a loaded
                adapter unless `inplace`) or an adapter a worker cannot read (named with the
                worker's reason); 404 for a `base_model` not served here; 503 where no worker
                serves the model or they did not load it within `timeout_s`.
        """
        base = self.base(base_model)
        catalog, key = self.gw.catalog, self.gw.keys.loras(base.name)
        await self.refresh()
        if catalog.is_static(name):
            raise APIError(f"{name!r} names a model or a --lora-modules adapter; choose another "
                           "name", param="lora_name")
        if name in catalog.names and not inplace:
            raise APIError(f"The lora adapter {name!r} has already been loaded.",
                           param="lora_name")
        owner = catalog.get(name).fleet_name if name in catalog.names else base.name
        if owner != base.name:  # an in-place load may not move an adapter to another model
            raise APIError(f"{name!r} is an adapter of {owner!r}, not of {base.name!r}; "
                           "unload it first", param="lora_name")
        if not await self._workers(base):
            raise APIError(f"no alive worker serves {base.name!r}: the adapter was not "
                           "loaded", status=503, kind="server_error")
        await self.gw.redis.hset(key, name, path)
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        while True:
            workers = await self._workers(base)
            failed = next((w for w in workers if w.lora_errors.get(name, [None])[0] == path),
                          None)
            if failed is not None or not workers:
                await self._take_back(key, name, path)
                if failed is None:
                    raise APIError(f"every worker of {base.name!r} left while loading "
                                   f"{name!r}", status=503, kind="server_error")
                raise APIError(f"worker {failed.worker_id} cannot load LoRA adapter {name!r}: "
                               f"{failed.lora_errors[name][1]}", param="lora_path")
            if all(w.loras.get(name) == path for w in workers):
                break
            if asyncio.get_running_loop().time() > deadline:
                await self._take_back(key, name, path)
                raise APIError(f"the workers did not load {name!r} within {self.timeout_s:.0f} s",
                               status=503, kind="server_error")
            await asyncio.sleep(self.poll_s)
        await self.refresh()
        log.info("LoRA adapter %s loaded from %s on %d workers", name, path, len(workers))
        return f"Success: LoRA adapter '{name}' added successfully."

    async def _take_back(self, key: str, name: str, path: str) -> None:
        """Remove the entry `name` -> `path` this load wrote, unless another has replaced it."""
        r = self.gw.redis
        if (await r.hget(key, name) or b"").decode() == path:
            await r.hdel(key, name)
        await self.refresh()  # the catalog may have learned it meanwhile

    async def unload(self, name: str) -> str:
        """Stop serving adapter `name`; returns once no worker serves it (its running requests
        finish first) or `timeout_s` has passed (they drop it when those finish).

        Raises:
            APIError: 404 for a name no run-time adapter has; 400 for a `--lora-modules` one.
        """
        catalog = self.gw.catalog
        await self.refresh()
        if catalog.is_static(name) and name in catalog.names:
            raise APIError(f"{name!r} was given on the command line (a model or a "
                           "--lora-modules adapter) and is not unloaded at run time",
                           param="lora_name")
        for base in catalog.models:  # the model whose list holds it
            if await self.gw.redis.hdel(self.gw.keys.loras(base.name), name):
                break
        else:
            raise APIError(f"The lora adapter {name!r} cannot be found.", status=404,
                           param="lora_name", kind="not_found_error")
        await self.refresh()
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        while (any(name in w.loras for w in await self._workers(base))
               and asyncio.get_running_loop().time() < deadline):
            await asyncio.sleep(self.poll_s)
        log.info("LoRA adapter %s unloaded", name)
        return f"Success: LoRA adapter '{name}' removed successfully."


def loras_router(runtime: RuntimeLoRAs, enabled: bool,
                 errors: Callable[..., dict]) -> APIRouter:
    """The two routes; without `enabled` they answer 404, as vLLM's absent ones do. `errors`
    gives the OpenAPI `responses` of a list of error statuses."""
    router = APIRouter()
    text = {200: {"content": {"text/plain": {}}, "description": "a line saying it is done"}}

    def check() -> None:
        if not enabled:
            raise APIError("loading LoRA adapters at run time is off: start the gateway with "
                           f"--allow-runtime-lora-updating (or {ENV_FLAG}=true)", status=404,
                           kind="not_found_error")

    @router.post("/v1/load_lora_adapter", responses={**text, **errors(400, 401, 404, 503)})
    async def load_lora_adapter(req: LoadLoRAAdapterRequest):
        """vLLM's: serve the PEFT adapter at `lora_path` as the model `lora_name` on every
        worker of its base model (`base_model`, shoal's; default the gateway's first)."""
        check()
        return PlainTextResponse(await runtime.load(req.lora_name, req.lora_path,
                                                    req.load_inplace, req.base_model))

    @router.post("/v1/unload_lora_adapter", responses={**text, **errors(400, 401, 404)})
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest):
        """vLLM's: stop serving an adapter loaded at run time."""
        check()
        return PlainTextResponse(await runtime.unload(req.lora_name))

    return router
