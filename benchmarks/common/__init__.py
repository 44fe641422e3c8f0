"""What the benchmark scripts share (they run from benchmarks/, so import it as ``common``):
the machine line and run header (machine), the models and interleaved step timing of
step_time.py and its kin (step_timing), the interleaved runs of --hook auto (auto_runs), the
quality benchmark's tasks and charts (quality_tasks, quality_chart). No entry points."""
