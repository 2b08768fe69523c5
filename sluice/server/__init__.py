"""The OpenAI-compatible HTTP server: FastAPI app, protocol models, Prometheus metrics."""

from sluice.server.app import build_app
from sluice.server.launch import run_server
from sluice.server.protocol import OpenAIError

__all__ = ["OpenAIError", "build_app", "run_server"]
