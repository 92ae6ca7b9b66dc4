"""Worker agents and coordinator: run a :class:`testbed.plan.Plan` over real TCP.

* :mod:`agents.wire` — frame header, framing helpers, HMAC authentication;
* :mod:`agents.executor` — runs one node's program over sockets;
* :mod:`agents.agent` — the worker process (``python3 -m agents.agent --config node.json``);
* :mod:`agents.coordinator` — plan distribution, barrier, results (library and CLI);
* :mod:`agents.inputs` — deterministic exact-integer inputs;
* :mod:`agents.local` — ``run_local(plan)``: real agent processes on loopback.

Results of :meth:`agents.coordinator.Coordinator.run` / :func:`agents.local.run_local`::

    {"scheme", "nodes", "length", "dtype", "seed", "stop_and_wait",
     "iterations": [{"iteration", "go_ns", "cct_s", "iteration_s", "correct",
                     "workers": {node: {"go_ns", "compute_end_ns", "comm_start_ns",
                                        "comm_done_ns", "receiver", "correct", "max_abs_err",
                                        "digest"}}}],
     "transfers": {"columns": [...TRANSFER_COLUMNS], "rows": [[...], ...]},
     "errors": [str, ...]}      # wrong results; violations after the last iteration

A failed run raises :class:`agents.coordinator.Failure` (a ``RunError``) with ``culprit`` (the
node, or "coordinator", that stopped, died or misbehaved), ``link`` and ``results`` (what
completed); the command-line coordinator writes those results with a ``failure`` record.

Nothing here is imported eagerly: the agent process stays light.
"""
