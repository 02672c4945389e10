"""Tag scheduler: matches worker capability tags to role demands, drives the rollout rhythm
(pause, weight update, resume) and lends idle trainer workers to rollout.

Planned. Role changes travel as ``RoleChangeRequested`` on ``sf.<run>.ctl.role.<worker_id>``.
"""
