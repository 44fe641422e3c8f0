"""fastddp inside frameworks that build their own DDP wrapper, picked by the framework's own
switches rather than by the ``-m fastddp`` launcher. Each module here is an optional
dependency's integration: importing ``fastddp`` imports none of them, and each imports its
framework only when it is itself imported (lightning.py: ``Trainer(strategy="fastddp")``;
accelerate.py: an ``Accelerator`` for ``accelerate launch``)."""
