"""Trainer: pulls training samples from ``sf.<run>.samples``, trains the policy on complete
groups (decoupled PPO/GRPO, torch or megatron-core backends, data-parallel ranks) and publishes
each new weight version. Entry point: ``trainer.serve.serve_trainer``; the pure core is
``trainer.batcher``, ``trainer.losses`` and ``trainer.step``.
"""
