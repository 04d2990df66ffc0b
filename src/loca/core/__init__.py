"""The method's pure tensor math: the head error (``head``), the ridge solves and their statistics
(``ridge``), and stacked-block helpers (``stacked``). No model, no data, no I/O."""
