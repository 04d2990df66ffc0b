"""LoCA itself: adapters, feedback maps and their calibration (Stage I), the forward-only fit
(Stage II) with its state, step controls and credit, CUDA graphs and the artefacts on disk."""
