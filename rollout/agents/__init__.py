"""Agent runner: pulls tasks, runs agents against the gateway, publishes rewards.

``runner`` (the NATS adapter ``AgentRunner`` and ``serve_agents``), ``once`` (a task delivered
again runs one group), ``environments`` (the built-in envs: each one's agent and reward),
``agents`` (the agent kinds: Python coroutine functions and external commands), ``rewards`` (how
an attempt is scored: a task's reward function, the agent's own reward, the verifier; unusable
rewards), ``verifiers`` (answer checks by name), ``sessions`` (session and group ids),
``arithmetic`` (the quickstart environment and its tasks), ``calculator`` (a tool environment:
products with a calculator function), ``reasoninggym`` (reasoning-gym generators as tasks),
``config`` (``AgentsConfig``).
"""
