"""For benchmarks and capacity planning, above the services: nothing in the product imports it.

- ``emulation.workload``: the shared workload model (lengths and modelled durations);
- ``emulation.engine`` and ``emulation.backend``: the ``emulated`` rollout engine and trainer
  backend, for benchmarks only: they spend the modelled time instead of computing, so the real
  worker, gateway, trajectory manager, scheduler and trainer run at a cluster's timing on a few
  cores. They are plugins (``common.plugins``): their configs (``emulation.config``) join the
  engine and backend kinds through this package's entry points, and a run on them says so;
- ``emulation.sim``: a discrete-event simulator of a cluster on the scheduler's own policy code,
  a capacity planner: ``emulation.fit`` fits it to a run's measured costs, ``emulation.plan``
  (``seamlessflow plan``) sweeps it for a cluster.
"""
