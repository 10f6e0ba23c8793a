"""The continuous-batching engine. Imports neither Ray nor FastAPI."""

from serve_app.engine.llm import LLM
from serve_app.types import FinishReason, GenerateRequest, RequestOutput, SamplingParams

__all__ = ["LLM", "FinishReason", "GenerateRequest", "RequestOutput", "SamplingParams"]
