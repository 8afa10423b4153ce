"""Memory and cost of a config before a run: ``elr estimate`` (per-rank peak memory of a training step, traced on
fake tensors) and ``elr cost`` (parameters, FLOPs and KV memory per k).

``memory`` traces a step, ``fla`` stands in for fla's kernels there, ``steps`` extrapolates the fast path,
``target`` reads a config's run, ``hardware`` the devices, ``budget`` says what fits, ``report`` builds the
table, ``command`` is ``elr estimate``'s command line, ``fit`` the estimate ``elr fit`` logs, and ``cost`` is
``elr cost``. Nothing is imported here: ``elr cost`` does not load torch's memory tools.
"""
