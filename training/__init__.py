"""Training side: distillation data, collective boost-tuning, export (see the issues)."""
