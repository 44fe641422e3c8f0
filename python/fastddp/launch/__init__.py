"""Running unmodified scripts with fastddp: ``python -m fastddp`` (launcher.py) and
``fastddp.patch()`` (patch.py), which swap torch's DistributedDataParallel for fastddp's; the
``--hook`` language (hook_spec.py), ``--emulate-link`` (_emulate_link.py), the reports
(report.py) and ``make run``'s demo (demo.py)."""
