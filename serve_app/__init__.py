"""Continuous-batching LLM serving on Ray Serve."""
