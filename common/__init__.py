"""The bottom of SeamlessFlow: helpers every part shares and that import nothing of ours.

``log`` (``event key=value`` lines), ``exceptions`` (the root ``SeamlessFlowError``), ``metrics``
(per-process Prometheus registries and their ``/metrics`` server), ``paths`` (the state folder)
and ``models`` (building and unpacking the CPU models that trainer and rollout both load).
"""
