"""The per-attempt step log and the resume audit: writing rows, their documents, comparing attempts, plots.

Nothing here reads or writes checkpoints; the audit judges only what the attempts logged.
"""
