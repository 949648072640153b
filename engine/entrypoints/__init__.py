"""What programs call: the offline `LLM` (with tool calling and beam search), the `AsyncEngine`
that one engine loop serves many clients through, the OpenAI-compatible server (openai/), and
data-parallel replicas behind it on Ray Serve with their prefix-aware router.

Everything here builds on the engine's core (engine/*.py), which never imports it.
"""
