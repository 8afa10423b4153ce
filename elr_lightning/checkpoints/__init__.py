"""Checkpoints as data: reading one safely, its schema, the modules it may name, writing and resuming one.

``io`` (atomic checkpoint files, sharded folders), ``schema`` (what a checkpoint may say about its model),
``safe_load`` (``weights_only`` reads), ``trust`` (which modules a class path may name), ``record`` (what a
module saves and restores), ``resume``, ``tokenizer`` (the training tokenizer in a checkpoint) and
``upgrade`` (``elr upgrade-checkpoint``). Imports the model layer, never the module, inference or the tools.
"""
