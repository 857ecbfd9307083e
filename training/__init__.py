"""Training side: the reference LLM, distillation data, collective boost-tuning, the
match-length predictor, pool export.

Sections cited as "ALGORITHMS.md section N" are those of docs/ALGORITHMS.md in the repository.
"""
