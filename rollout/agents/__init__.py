"""Agent runner: pulls tasks, runs agents against the gateway, publishes rewards.

``runner`` (the NATS adapter ``AgentRunner`` and ``serve_agents``), ``agents`` (the agent kinds:
Python coroutine functions and external commands), ``verifiers`` (answer checks by name),
``arithmetic`` (the quickstart environment and its tasks), ``config`` (``AgentsConfig``).
"""
