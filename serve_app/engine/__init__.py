"""The continuous-batching engine. Imports neither Ray nor FastAPI.

Importing the package loads no torch (the serving layer reads `engine.config` in processes that never
run the engine): `LLM` is imported on first use.
"""

from typing import Any

from serve_app.types import FinishReason, GenerateRequest, RequestOutput, SamplingParams

__all__ = ["LLM", "FinishReason", "GenerateRequest", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from serve_app.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'serve_app.engine' has no attribute {name!r}")
