"""``elr ablate``: train the paper's ablation arms on a config (``run``) and check its claims (``report``)."""
