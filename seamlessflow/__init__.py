"""SeamlessFlow: the CLI, the local launcher and the few helpers every process shares.

The parts live in sibling packages: ``broker`` (NATS JetStream, subjects, wire schemas),
``rollout`` (engines, workers, gateway), ``trajectory`` (call records -> training samples),
``trainer`` (policy updates, weight publication) and ``tagsched`` (tag-driven scheduling).
"""

__version__ = "0.1.0"
