"""Rollout: inference engines behind one interface, the rollout workers that serve generation
requests from ``sf.<run>.gen.req``, and the OpenAI-compatible gateway agents call.

Planned (issue: rollout). Talks to the other parts only through ``broker``.
"""
