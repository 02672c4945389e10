"""The gateway process: tokenizer, NATS connection and HTTP server, as ``async with``."""

import asyncio
import contextlib
import logging
import socket
from pathlib import Path
from typing import Any

import uvicorn
from nats.errors import Error as NatsError
from nats.js import JetStreamContext

from broker.client import connect, disconnect
from broker.permissions import Principal
from broker.provision import run_stream_info
from broker.subjects import RunNames
from common.exceptions import ModelError
from common.log import kv
from common.models import eos_token_ids, load_tokenizer, model_info
from common.ready import announce_ready
from rollout.exceptions import GenerationUnavailableError, RolloutError
from rollout.gateway.app import build_app
from rollout.gateway.config import GatewayConfig
from rollout.gateway.keys import gateway_keys
from rollout.gateway.service import OpenAIService
from rollout.gateway.tools import tool_support

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the caller's ``stop`` event ends the gateway."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def default_stop_token_ids(model_path: Path, tokenizer: Any) -> list[int]:
    """The model's eos ids: the tokenizer's, config.json's and generation_config.json's."""
    extra = set() if tokenizer.eos_token_id is None else {tokenizer.eos_token_id}
    return sorted(eos_token_ids(model_path) | extra)


class Gateway:
    """A running gateway (NATS connection, tokenizer, HTTP server), as ``async with``."""

    def __init__(
        self, config: GatewayConfig, nats_url: str, stop: asyncio.Event | None = None
    ) -> None:
        self.config = config
        self.nats_url = nats_url
        self._stop = stop
        """Given (a service): wait for the broker at start until it is set."""
        self.service: OpenAIService | None = None
        self._server: _Server | None = None
        self._serving: asyncio.Task | None = None
        self._socket: socket.socket | None = None
        self.app: Any = None

    @property
    def port(self) -> int:
        assert self._socket is not None, "the gateway is not started"
        return self._socket.getsockname()[1]

    @property
    def url(self) -> str:
        """The base URL clients use (``.../v1``)."""
        return f"http://{self.config.host}:{self.port}/v1"

    async def __aenter__(self) -> "Gateway":
        config = self.config
        keys = gateway_keys(config.keys_file, config.host)  # before anything slow: a bad file
        if keys is None:
            log.warning(
                kv(
                    "gateway_unauthenticated",
                    host=config.host,
                    note="no keys_file: every local process can call this gateway and read its "
                    "/metrics; for a throwaway local run only",
                )
            )
        tokenizer = await asyncio.to_thread(load_tokenizer, config.model_path)
        tools = await asyncio.to_thread(
            tool_support, tokenizer, config.tool_parser, config.tool_template
        )
        max_model_len = config.max_model_len or model_info(config.model_path).get(
            "max_position_embeddings"
        )
        if not max_model_len:
            raise ModelError(
                f"{config.model_path}/config.json has no max_position_embeddings: set max_model_len"
            )
        stop_ids = config.stop_token_ids
        if stop_ids is None:
            stop_ids = default_stop_token_ids(config.model_path, tokenizer)
        nc = await connect(
            self.nats_url,
            "seamlessflow-gateway",
            stop=self._stop,
            principal=Principal.GATEWAY,
        )
        try:
            js = nc.jetstream(timeout=config.nats_timeout_s)
            await _check_provisioned(js, RunNames(config.run))
            self.service = OpenAIService(config, tokenizer, tools, nc, js, max_model_len, stop_ids)
            self.app = build_app(self.service, keys)
            self._socket = _listen(config.host, config.port)
            self._server = _Server(
                uvicorn.Config(
                    self.app,
                    log_level="warning",
                    lifespan="off",
                    timeout_keep_alive=config.keep_alive_s,
                    timeout_graceful_shutdown=5,
                )
            )
            self._serving = asyncio.create_task(self._server.serve(sockets=[self._socket]))
            while not self._server.started:
                if self._serving.done():
                    self._serving.result()
                    raise RolloutError("the HTTP server stopped while starting")
                await asyncio.sleep(0.01)
        except BaseException:
            try:
                await self._stop_server()
            finally:
                await disconnect(nc)
            raise
        log.info(
            kv(
                "gateway_started",
                url=self.url,
                model=config.model,
                run=config.run,
                keys=keys.source if keys else "none (open)",
            )
        )
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        try:
            await self._stop_server()
        finally:
            if self.service is not None:
                await self.service.close()
                await disconnect(self.service.nc)
        log.info(kv("gateway_stopped", model=self.config.model, run=self.config.run))

    async def _stop_server(self) -> None:
        try:
            if self._server is not None and self._serving is not None:
                self._server.should_exit = True
                await self._serving
        finally:
            if self._socket is not None:
                self._socket.close()


def _listen(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise RolloutError(f"the gateway cannot listen on {host}:{port}: {exc}") from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise RolloutError(f"the gateway cannot listen on {host}:{port}: {exc}") from exc
    return sock


async def _check_provisioned(js: JetStreamContext, names: RunNames) -> None:
    for stream in (names.gen_stream, names.traj_stream):
        try:
            await run_stream_info(js, names, stream)
        except (NatsError, OSError) as exc:
            raise GenerationUnavailableError(
                f"cannot check run {names.run!r} on NATS: {type(exc).__name__}: {exc}"
            ) from exc


async def serve_gateway(config: GatewayConfig, nats_url: str, stop: asyncio.Event) -> None:
    """Serve the gateway until ``stop`` is set."""
    async with Gateway(config, nats_url, stop) as gateway:
        metrics = f"http://{config.host}:{gateway.port}/metrics"
        announce_ready("gateway", metrics, url=gateway.url, model=config.model, run=config.run)
        await stop.wait()
