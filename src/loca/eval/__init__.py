"""Evaluation: pure metrics (``metrics``), the model's CE and ranking accuracy on batches
(``evaluation``) and the report over run folders (``run_report``)."""
