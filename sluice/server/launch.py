"""Start the engine and serve it with uvicorn until SIGINT/SIGTERM, then drain.

On the first signal the server drains: requests in flight run to their end (for up to
the shutdown timeout) while new ones get a 503 with Retry-After and /health turns 503,
so a load balancer sees why and goes elsewhere. Only then does uvicorn stop listening;
stopping at once, as uvicorn does by default, would refuse new connections with no
answer at all. A second signal stops without waiting for the drain.
"""

from __future__ import annotations

import logging
import math
import signal
import socket
import threading
from types import FrameType
from typing import TYPE_CHECKING, cast

import uvicorn

from sluice.config import EngineConfig
from sluice.distributed import DataParallelLLM
from sluice.engine.async_engine import DEFAULT_MAX_WAITING_REQUESTS, AsyncLLM, EngineClient
from sluice.loader.resolve import DEFAULT_MODEL
from sluice.server.app import build_app
from sluice.server.context import ServerContext
from sluice.server.http_protocol import SluiceH11Protocol

if TYPE_CHECKING:
    from sluice.engine.engine import LLMEngine
    from sluice.loader.tokenizer import Tokenizer

logger = logging.getLogger("sluice.server")


class _Server(uvicorn.Server):
    """Logs the URL once the socket is bound, and drains on the first signal."""

    def __init__(self, config: uvicorn.Config, ctx: ServerContext, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.ctx = ctx
        self.shutdown_timeout = shutdown_timeout
        self._drain: threading.Thread | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            host = self.config.host
            shown = f"[{host}]" if ":" in host else host
            logger.info(
                "sluice is serving %s at http://%s:%d/v1",
                self.ctx.model_name,
                shown,
                self.config.port,
            )

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain is not None or not self.started:
            super().handle_exit(sig, frame)  # a second signal, or not serving yet: stop now
            return
        # Set here, in the signal handler: a request that comes after the signal is refused.
        self.ctx.draining = True
        logger.info("draining: finishing requests in flight, refusing new ones")
        self._drain = threading.Thread(
            target=self._drain_then_exit, name="sluice-drain", daemon=True
        )
        self._drain.start()

    def _drain_then_exit(self) -> None:
        # Waits for the engine's requests in flight (aborting them after the timeout) and
        # stops its loop; their last outputs are already on their way to the clients.
        self.ctx.llm.shutdown(self.shutdown_timeout)
        self.should_exit = True


def _engine_client(
    config: EngineConfig, max_waiting_requests: int
) -> tuple[EngineClient, Tokenizer, int]:
    """The engine in this process, or data-parallel replicas in others (with Ray, also
    one replica: it then runs where the Ray cluster puts it); its tokenizer and vocab."""
    if config.data_parallel_size > 1 or config.distributed_executor_backend == "ray":
        dp = DataParallelLLM(config, max_waiting_requests=max_waiting_requests)
        return dp, dp.tokenizer, dp.vocab_size
    llm = AsyncLLM.from_config(config, max_waiting_requests=max_waiting_requests)
    engine = cast("LLMEngine", llm.engine)  # from_config builds an LLMEngine
    return llm, engine.tokenizer, engine.model_config.vocab_size


def run_server(
    config: EngineConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    metrics_without_auth: bool = False,
    served_model_name: str | None = None,
    max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
    shutdown_timeout: float = 10.0,
    log_level: str = "info",
) -> int:
    """Serve until a signal arrives; returns the process exit code."""
    llm, tokenizer, vocab = _engine_client(config, max_waiting_requests)
    name = served_model_name or config.model or DEFAULT_MODEL
    app = build_app(
        llm,
        tokenizer,
        name,
        vocab_size=vocab,
        api_key=api_key,
        metrics_without_auth=metrics_without_auth,
        reasoning_parser=config.reasoning_parser,
    )
    uv_config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=log_level == "debug",
        # After the drain, responses only have their last events to send; this bounds
        # it (then they are cancelled, which aborts their requests).
        # uvicorn's Config takes whole seconds: round up so the bound is never shorter.
        timeout_graceful_shutdown=math.ceil(shutdown_timeout),
        timeout_keep_alive=30,
        http=SluiceH11Protocol,  # a 431 for oversized headers (http_protocol.py)
    )
    server = _Server(uv_config, app.state.ctx, shutdown_timeout)
    # Uvicorn re-raises the signal it handled once it has shut down gracefully; a no-op
    # handler there makes SIGTERM/SIGINT a clean exit with code 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: None)
    try:
        server.run()
    finally:
        if llm.is_running:
            llm.shutdown()
    if not server.started:
        logger.error("the server did not start (is port %d on %s in use?)", port, host)
        return 1
    logger.info("sluice server stopped")
    return 0
