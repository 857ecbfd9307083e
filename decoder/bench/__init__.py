"""The one measuring harness: workloads x methods x settings -> run records -> report and plots.

`protocol` (the timing protocol), `workloads`, `methods`, `summary` (metrics), `report`, `plots`;
its configurations: `suite` (also the single-file bench), `batched`, `strategies`, `scheduler`,
named in `configurations` for `specboost bench --suite NAME`.
"""
