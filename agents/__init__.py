"""Worker agents and coordinator: run a :class:`testbed.plan.Plan` over real TCP.

* :mod:`agents.wire` — frame header, framing helpers, HMAC authentication;
* :mod:`agents.protocol` — control-message kinds and their fields, the coordinator's events,
  failure reports, the transfers table;
* :mod:`agents.executor` — runs one node's program over sockets;
* :mod:`agents.agent` — the worker process (``python3 -m agents.agent --config node.json``);
* :mod:`agents.coordinator` — plan distribution, barrier, results (library and CLI), and the
  driver API a run-time driver uses;
* :mod:`agents.crew`, :mod:`agents.crew_run`, :mod:`agents.crew_worker` — CREW's groups at run
  time: the pure controller, its coordinator-side driver, the agent-side worker loop;
* :mod:`agents.inputs` — deterministic exact-integer inputs;
* :mod:`agents.local` — ``run_local(plan)``: real agent processes on loopback.

Results of :meth:`agents.coordinator.Coordinator.run` / :func:`agents.local.run_local`::

    {"scheme", "nodes", "length", "dtype", "seed", "stop_and_wait", "connections",
     "iterations": [{"iteration", "go_ns", "cct_s", "iteration_s", "correct",
                     "workers": {node: {"go_ns", "compute_end_ns", "comm_start_ns",
                                        "comm_done_ns", "receiver", "correct", "max_abs_err",
                                        "digest"}}}],
     "transfers": {"columns": [...TRANSFER_COLUMNS], "rows": [[...], ...]},  # agents.protocol.Transfer
     "errors": [str, ...]}      # wrong results; violations after the last iteration

A failed run raises :class:`agents.coordinator.Failure` (a ``RunError``) with its
:class:`agents.protocol.FailureReport` (``culprit``: the node, or "coordinator", that stopped,
died or misbehaved; ``link``) and ``results`` (what completed); the command-line coordinator
writes those results with a ``failure`` record.

Nothing here is imported eagerly: the agent process stays light.
"""
