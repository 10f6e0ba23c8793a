"""The Ray Serve layer: OpenAI-compatible ingress → LLMServer replicas → backends.

Nothing here imports torch at module load; `app.build_app` is the Serve YAML entry point.
"""
