"""Rollout: inference engines behind one interface (``rollout.engines``), the rollout worker
that serves generation requests from ``sf.<run>.gen.req`` (``rollout.worker``, its process
``rollout.serve``), and the OpenAI-compatible gateway agents call (``rollout.gateway``, with its
pure cores ``prompts`` and ``detok`` and the NATS side ``calls``).

Talks to the other parts only through ``broker``.
"""
