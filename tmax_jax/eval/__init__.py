"""Evaluation over Harbor-format task directories: pass@k, resumable runs, reports."""
