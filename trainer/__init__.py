"""Trainer: pulls training samples from ``sf.<run>.samples``, updates the policy (torch or
megatron-core backends) and publishes each new weight version.

Planned (issue: trajectory manager, trainer and the closed RL loop).
"""
