"""A rollout worker and the trainer in one process, on one model: the worker serves as
``rollout``, the trainer steps as ``train`` (``colocate.worker``). Above the services, which must
not import one another; below the CLI.
"""
