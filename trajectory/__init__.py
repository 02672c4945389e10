"""Trajectory manager: turns call records into per-session token prefix trees, and finished
sessions into labelled training samples (loss mask, behaviour logprobs, version per token).

Planned (issue: trajectory manager, trainer and the closed RL loop).
"""
